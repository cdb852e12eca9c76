"""`scdd`: the ancestral sampler of self-correcting discrete diffusion (docs/strategies.md §3.2).

Every canvas position is redrawn at every step from the exact reverse posterior q(z_s | z_t, x ~ p_θ)
of the SCDD forward process, walking t from 1 down to eps over `steps` steps. Per step s < t the
forward process keeps a visible token with probability α' = clean_t/clean_s, redraws it uniformly
over the K = V-1 non-mask tokens with β' = γ_t/γ_s - α', and masks it with η = 1 - α' - β' (the
sampler's mass ratios, not training's ρ ratios: docs/strategies.md §7 caveat 8). The posterior, with p = p_θ:

    visible c:  q(v) ∝ (clean_s p(v) + uniform_s/K) (α' δ_vc + β'/K),   q([MASK]) = 0
    masked:     q(v) = η (clean_s p(v) + uniform_s/K) / absorbed_t,     q([MASK]) = absorbed_s / absorbed_t

so a committed token can be rewritten but never re-masked. A last forward takes the argmax at every
canvas position ("noise removal": leftover masks and wrong visible tokens alike). NFE = steps + 1.
Each row draws from its own RNG stream (seeded alike), so a batch never changes a row's output.
`cache` 'prefix' (Fast-dLLM, approximate): prompts left-padded, each step forwards only the window
against the prompt's cached keys, refreshed by a full forward every `cache_refresh` steps ('dual' is
refused: every window position changes at every step, so no suffix keeps its keys).
`eos_truncate` (approximate, cache 'none'): positions after the first EOS of a row's window become
filler and leave the forwards, and a row whose window holds an EOS with no [MASK] before it stops
(no further redraws, no noise-removal pass), so a short answer costs about its own length.
The schedule (`uniform_ratio`, `schedule_shape`, `schedule_peak`) must be the training one: unset
flags take the checkpoint's settings.json values, an explicit flag that differs warns.

    sampler = SCDDSampler(model, tok, SCDDConfig(steps=64), training_settings=s)
    result = sampler.generate([ids_a, ids_b])
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from dllmflow.diffusion.schedules import TINY, scdd_schedule
from dllmflow.errors import UserError

from .base import GenerationResult, Sampler
from .configs import SCDDConfig
from .kv import FastDLLMCache, fast_dllm_canvas
from .loop import (
    build_canvas,
)
from .stopping import first_eos_done, truncate_after_eos

SCHEDULE_FIELDS = ("uniform_ratio", "schedule_shape", "schedule_peak")


def resolve_scdd_schedule(config: SCDDConfig, training_settings: Any) -> tuple[SCDDConfig, list[str]]:
    """Fill the schedule fields the caller left unset from the training settings (scdd mode only);
    -> (config, one message per explicitly set field that disagrees with training)."""
    dllm = getattr(training_settings, "dllm", None)
    if getattr(dllm, "mode", None) != "scdd":
        return config, []
    update, mismatches = {}, []
    for name in SCHEDULE_FIELDS:
        trained = float(getattr(dllm, name))
        if name not in config.model_fields_set:
            update[name] = trained
        elif not math.isclose(getattr(config, name), trained, rel_tol=1e-6, abs_tol=1e-9):
            mismatches.append(
                f"--{name} {getattr(config, name)} but the checkpoint was trained with {trained}"
            )
    return config.model_copy(update=update), mismatches


def scdd_step_probs(
    log_p: Tensor, current: Tensor, mask_id: int, t: float, s: float, config: SCDDConfig
) -> Tensor:
    """Reverse-posterior probabilities [N, V] for N canvas positions.

    log_p [N, V]: log p_θ with the [MASK] column at -inf; current [N]: z_t. Rows whose posterior is
    all zero (a degenerate schedule) come back all zero; the caller keeps their token.
    """
    sch = scdd_schedule(
        torch.tensor([t, s], dtype=torch.float64),
        config.uniform_ratio,
        config.schedule_shape,
        config.schedule_peak,
    )
    clean_t, clean_s = float(sch.clean[0]), float(sch.clean[1])
    uni_t, uni_s = float(sch.uniform[0]), float(sch.uniform[1])
    abs_t, abs_s = float(sch.absorbed[0]), float(sch.absorbed[1])
    gamma_t, gamma_s = float(sch.gamma[0]), float(sch.gamma[1])
    alpha = clean_t / max(clean_s, TINY)
    beta = gamma_t / max(gamma_s, TINY) - alpha
    eta = 1.0 - alpha - beta

    p = log_p.double().exp()  # [N, V]; exactly 0 on the mask column
    n, vocab = p.shape
    k = vocab - 1
    rows = torch.arange(n, device=p.device)
    masked = current == mask_id  # [N]
    cur = current.clamp(0, vocab - 1)
    p_c = p[rows, cur]  # [N]

    # 1) visible rows: stay (α'), or any non-mask token (β'), weighted by where x may be at s
    den = (uni_t / k + clean_t * p_c).clamp_min(TINY)  # [N]
    visible = (clean_s * beta / k) * p + uni_s * beta / k**2  # [N, V]
    visible[rows, cur] += clean_s * alpha * p_c + alpha * uni_s / k
    visible[:, mask_id] = 0.0
    visible = visible / den[:, None]

    # 2) masked rows: unmask to where x may be at s (η), or stay masked
    rel = eta / max(abs_t, TINY)
    unmask = rel * uni_s / k + rel * clean_s * p  # [N, V]
    unmask[:, mask_id] = abs_s / max(abs_t, TINY)

    probs = torch.where(masked[:, None], unmask, visible)
    return probs.clamp_min(0.0)


class SCDDSampler(Sampler):
    name = "scdd"
    config_cls = SCDDConfig
    supports_infill = False
    supports_batching = True

    no_cache_reason = "it redraws every canvas position every step, so it has no KV-cache path"

    def __init__(self, model, tokenizer, config: SCDDConfig, mask_id: int | None = None, forward=None, **kw):
        super().__init__(model, tokenizer, config, mask_id, forward, **kw)
        self.config, mismatches = resolve_scdd_schedule(config, self.training_settings)
        for msg in mismatches:
            warnings.warn(f"scdd schedule does not match training: {msg}", UserWarning, stacklevel=2)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        if self.config.eos_truncate and self.eos_id is None:
            raise UserError("sampler scdd with eos_truncate needs a tokenizer with an EOS token")

    def model_forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        from dllmflow.models.attention import forward_bidirectional

        return forward_bidirectional(self.model, input_ids, attention_mask)  # [B, T, V]

    def _denoiser_log_probs(self, logits: Tensor) -> Tensor:
        """log p_θ [N, V] from logits [N, V]: [MASK] excluded, tempered; temperature 0 = one-hot argmax."""
        logits = logits.float()
        logits[:, self.mask_id] = -math.inf
        if self.config.temperature == 0:
            one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
            return one_hot.log()
        return torch.log_softmax(logits / self.config.temperature, dim=-1)

    def _window_logits(self, prompt_ids: list[list[int]]):
        """(x [B, T], rows, cols of the B*G window positions, row-major; logits(i) -> [B, G, V] at step i)."""
        cfg, G, B = self.config, self.config.max_new_tokens, len(prompt_ids)
        if cfg.cache == "none":
            canvas = build_canvas(prompt_ids, G, self.mask_id, self.fill_id, self.device)
            x, attn, start = canvas.x, canvas.valid, canvas.gen_start  # [B, T], [B, T], [B]
            pos = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
            rows, cols = ((pos >= start[:, None]) & (pos < (start + G)[:, None])).nonzero(as_tuple=True)
            return x, rows, cols, lambda i: self._forward(x, attn)[rows, cols].view(B, G, -1)
        canvas = fast_dllm_canvas(self, prompt_ids, G, cfg.cache)
        S, source = canvas.prefix_len, FastDLLMCache(self.model, canvas, "prefix")
        rows = torch.arange(B, device=self.device).repeat_interleave(G)  # [B*G]
        cols = torch.arange(S, S + G, device=self.device).repeat(B)  # [B*G]
        # Every `cache_refresh` steps a full forward refreshes the prompt's keys (and is that step's).
        return (
            canvas.x,
            rows,
            cols,
            lambda i: (source.refresh if i % cfg.cache_refresh == 0 else source)(S, S + G),
        )

    def _generate(self, prompt_ids: list[list[int]]) -> tuple:
        cfg, B, G = self.config, len(prompt_ids), self.config.max_new_tokens
        # One RNG stream per row, each seeded alike: a batch never changes a row's draws.
        gens = [self.generator() for _ in prompt_ids]
        if cfg.eos_truncate:
            return self._generate_truncated(prompt_ids, gens)
        x, rows, cols, window = self._window_logits(prompt_ids)
        ts = torch.linspace(1.0, cfg.eps, cfg.steps + 1, dtype=torch.float64).tolist()
        for i in range(cfg.steps):
            logits = window(i).reshape(B * G, -1)  # [N, V]
            probs = scdd_step_probs(self._denoiser_log_probs(logits), x[rows, cols], self.mask_id, ts[i],
                                    ts[i + 1], cfg)  # fmt: skip
            alive = probs.sum(dim=-1) > 0  # [N] a degenerate (all-zero) posterior keeps its token
            for b, gen in enumerate(gens):
                sel = torch.zeros_like(alive)
                sel[b * G : (b + 1) * G] = True
                sel &= alive
                if sel.any():
                    draw = torch.multinomial(probs[sel], 1, generator=gen).squeeze(-1)  # [N_b]
                    x[rows[sel], cols[sel]] = draw.to(x.dtype)

        # noise removal: argmax everywhere on the canvas, [MASK] excluded
        logits = window(cfg.steps).reshape(B * G, -1).float()  # [N, V]
        logits[:, self.mask_id] = -math.inf
        x[rows, cols] = logits.argmax(-1).to(x.dtype)
        nfe = cfg.steps + 1
        return x[rows, cols].view(B, G).tolist(), nfe, [nfe] * B, self._positions(prompt_ids).tolist()

    def _positions(self, prompt_ids: list[list[int]]) -> Tensor:
        """[B] positions the steps + 1 forwards computed per row: the prompt and window, or with the
        prefix cache, the window plus the prompt at each refresh."""
        cfg, G = self.config, self.config.max_new_tokens
        lengths = torch.tensor([len(p) for p in prompt_ids])  # [B]
        refreshes = len(range(0, cfg.steps + 1, cfg.cache_refresh)) if cfg.cache != "none" else cfg.steps + 1
        return refreshes * lengths + (cfg.steps + 1) * G

    def _generate_truncated(self, prompt_ids: list[list[int]], gens: list[torch.Generator]) -> tuple:
        """`_generate` with `eos_truncate` (cache 'none'): each forward runs on the rows not stopped,
        as wide as the longest of them still is; only window positions before a row's cut are redrawn."""
        cfg, G, mask = self.config, self.config.max_new_tokens, self.mask_id
        canvas = build_canvas(prompt_ids, G, mask, self.fill_id, self.device)
        x, attn, start = canvas.x, canvas.valid, canvas.gen_start  # [B, T], [B, T], [B]
        pos = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
        window = (pos >= start[:, None]) & (pos < (start + G)[:, None])  # [B, T]
        done = torch.zeros(len(prompt_ids), dtype=torch.bool, device=x.device)  # [B]
        row_nfe, positions = torch.zeros_like(start), torch.zeros_like(start)  # [B] each
        ts = torch.linspace(1.0, cfg.eps, cfg.steps + 1, dtype=torch.float64).tolist()
        nfe = 0
        for i in range(cfg.steps + 1):
            r = (~done).nonzero().flatten()  # [R]
            if not len(r):
                break
            width = int(attn[r].sum(dim=1).max())
            logits = self._forward(x[r, :width], attn[r, :width])  # [R, W, V]
            nfe, row_nfe[r], positions[r] = nfe + 1, row_nfe[r] + 1, positions[r] + attn[r, :width].sum(1)
            rr, cc = (window & attn.bool())[r, :width].nonzero(as_tuple=True)  # [N] each
            logits, at = logits[rr, cc].float(), r[rr]  # [N, V], [N] canvas rows
            if i == cfg.steps:  # noise removal, as `_generate`
                logits[:, mask] = -math.inf
                x[at, cc] = logits.argmax(-1).to(x.dtype)
                break
            probs = scdd_step_probs(self._denoiser_log_probs(logits), x[at, cc], mask, ts[i], ts[i + 1], cfg)
            alive = probs.sum(dim=-1) > 0  # [N]
            for k, b in enumerate(r.tolist()):
                sel = (rr == k) & alive
                if sel.any():
                    draw = torch.multinomial(probs[sel], 1, generator=gens[b]).squeeze(-1)  # [N_b]
                    x[at[sel], cc[sel]] = draw.to(x.dtype)
            truncate_after_eos(x, attn, start, G, self.eos_id, self.fill_id)
            done |= first_eos_done(x, start, G, self.eos_id, mask)
        x[window & (x == mask)] = self.fill_id  # a stopped row's masks after its EOS
        seqs = [x[b, int(s) : int(s) + G].tolist() for b, s in enumerate(start)]
        return seqs, nfe, row_nfe.tolist(), positions.tolist()

    def infill(self, seqs: list[list[int]]) -> GenerationResult:
        raise UserError(
            "sampler scdd does not support infill (it redraws the whole canvas); use --sampler llada"
        )
