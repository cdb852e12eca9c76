"""Shared sampler machinery (spec §3.0): config + presets, transfer schedule, token selection with the
Gumbel trick, logit shift, the standalone semi-autoregressive block sampler, infill, and the
`Sampler` base class every sampler file subclasses.

    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config
    cfg = build_sampler_config("llada", {"threshold": 0.9})
    out = SAMPLERS["llada"](model, tokenizer, cfg).generate([prompt_ids])   # GenerationResult

Departures from the reference, on purpose (spec §7 caveat 6): with a threshold the last step of a
block commits every remaining [MASK] of that block (never a stranded mask), and the EOS stop is per
row (a finished row stops changing; the batch stops when every row is done). The [MASK] column is
never a candidate token, so a committed position can never hold [MASK].
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, ValidationError
from torch import Tensor

from dllmflow.errors import UserError

# logits = forward(input_ids [B, T], attention_mask [B, T]) -> [B, T, V]
ForwardFn = Callable[[Tensor, Tensor], Tensor]


class SamplerConfig(BaseModel):
    """Every knob of every sampler (spec §3.0 defaults). Presets override these; flags override presets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: PositiveInt = 128
    max_new_tokens: PositiveInt = 128
    block_size: PositiveInt | None = 32
    temperature: NonNegativeFloat = 0.0
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    use_kv_cache: bool = False
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    causal_context: bool = False
    eos_token_id: int | None = Field(
        None, description="Set = stop a row once it has an EOS with no [MASK] before."
    )
    logit_shift: int = Field(0, ge=0, description="Position p reads logits[p - shift] (I-DLM: 1).")
    seed: int = 42
    # SCDD only (must match training).
    uniform_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    schedule_shape: float = Field(1.0, gt=0.0)
    schedule_peak: float = Field(0.5, gt=0.0, lt=1.0)
    eps: float = Field(1e-3, gt=0.0, le=1.0)
    # llada2 only (LLaDA2.1 editing): a committed token of the current block is replaced when the
    # model's confidence in a different token exceeds this; 0 = off.
    editing_threshold: float = Field(0.0, ge=0.0, le=1.0)
    max_post_steps: int = Field(16, ge=0, description="llada2: editing-only forwards after a block is full.")


# Guide "Generation Parameters" + spec §3.1-3.6. `eos_token_id: "tokenizer"` = filled from the tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    "llada": dict(steps=128, max_new_tokens=128, block_size=128, temperature=0.0, remasking="low_confidence"),
    "scdd": dict(steps=128, max_new_tokens=128, temperature=1.0),
    "llada2": dict(
        steps=32, max_new_tokens=128, block_size=32, temperature=0.0, threshold=0.5, editing_threshold=0.0,
        max_post_steps=16,
    ),
    "nemotron": dict(
        steps=1024, max_new_tokens=1024, block_size=32, use_kv_cache=True, threshold=0.9, causal_context=True,
        eos_token_id="tokenizer",
    ),
    "gemma": dict(steps=48, max_new_tokens=256),
    "idlm": dict(
        steps=256, max_new_tokens=256, block_size=4, threshold=0.9, logit_shift=1, eos_token_id="tokenizer",
    ),
}  # fmt: skip

# What each sampler can do, readable without importing its module (checked before loading a model).
# The sampler classes carry the same facts as class attributes; a test keeps the two in agreement.
CAPABILITIES: dict[str, dict[str, bool]] = {
    "llada": dict(infill=True, kv_cache=False, batching=True),
    "scdd": dict(infill=False, kv_cache=False, batching=True),
    "llada2": dict(infill=False, kv_cache=False, batching=False),
    "nemotron": dict(infill=False, kv_cache=True, batching=True),
    "gemma": dict(infill=False, kv_cache=False, batching=False),
    "idlm": dict(infill=False, kv_cache=False, batching=True),
}


def build_sampler_config(
    name: str, overrides: dict[str, Any] | None = None, tokenizer: Any = None
) -> SamplerConfig:
    """Preset of `name`, then the non-None `overrides` (CLI flags, eval settings). `no_kv_cache=True`
    turns off both the cache and the causal context (spec §3.7)."""
    if name not in PRESETS:
        raise UserError(f"unknown sampler {name!r}; choose one of: {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    if values.pop("no_kv_cache", False):
        values.update(use_kv_cache=False, causal_context=False)
    if values.get("eos_token_id") == "tokenizer":
        values["eos_token_id"] = getattr(tokenizer, "eos_token_id", None)
    try:
        return SamplerConfig(**values)
    except ValidationError as e:
        problems = "; ".join(f"--{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise UserError(f"invalid {name} sampler settings: {problems}") from None


def sampler_supports(name: str, feature: Literal["infill", "kv_cache", "batching"]) -> bool:
    """Ask the sampler class when its module exists, else the capability table."""
    from dllmflow.diffusion.samplers import SAMPLERS

    if name not in SAMPLERS:
        raise UserError(f"unknown sampler {name!r}; choose one of: {', '.join(SAMPLERS)}")
    try:
        return bool(getattr(SAMPLERS[name], f"supports_{feature}"))
    except ImportError:
        return CAPABILITIES[name][feature]


def resolve_mask_id(explicit: int | None, tokenizer: Any, model: Any = None) -> int:
    """Spec §3.0 priority: explicit (`--mask_id`) > tokenizer.mask_token_id > model.config.mask_token_id."""
    for candidate in (explicit, getattr(tokenizer, "mask_token_id", None)):
        if candidate is not None:
            return int(candidate)
    config_id = getattr(getattr(model, "config", None), "mask_token_id", None)
    if config_id is not None:
        return int(config_id)
    raise UserError(
        "no mask token id: the tokenizer has no mask token and model.config.mask_token_id is unset; pass --mask_id"
    )


def stop_token_ids(tokenizer: Any) -> set[int]:
    """Ids that end a response: eos, eot, pad and the usual end-of-turn specials present in the vocab."""
    ids = {getattr(tokenizer, a, None) for a in ("eos_token_id", "eot_token_id", "pad_token_id")}
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids |= {vocab.get(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")}
    ids.discard(None)
    mask = getattr(tokenizer, "mask_token_id", None)
    ids.discard(mask)
    return {int(i) for i in ids}


def trim_at_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    """Cut a response at its first stop id (the stop id itself is dropped)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i]
    return ids


# Attribute `load_for_generation` sets on a loaded model: the training Settings of its checkpoint.
TRAINING_SETTINGS_ATTR = "dllmflow_training_settings"


# ---- schedule and token selection ---------------------------------------------------------------


def get_num_transfer_tokens(mask_index: Tensor, steps: int) -> Tensor:
    """Tokens to commit per step: n masked in a row -> base = n // steps; the first n % steps steps
    get base + 1, the rest base. mask_index [B, L] bool -> [B, steps] long (rows sum to n)."""
    n = mask_index.sum(dim=1, keepdim=True)  # [B, 1]
    base, rem = n // steps, n % steps
    step = torch.arange(steps, device=mask_index.device)[None, :]  # [1, steps]
    return base + (step < rem).long()  # [B, steps]


def gumbel_argmax(
    logits: Tensor, temperature: float, uniform: Tensor | None = None, generator=None
) -> Tensor:
    """LLaDA's sampling trick: argmax of exp(logits) / (-log U)^temperature, which samples from
    softmax(logits / temperature). Computed as logits - temperature * log(-log U) in float64 (same
    argmax, no overflow of exp). temperature 0 = argmax. logits [..., V] -> [...] long."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    if uniform is None:
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    uniform = uniform.clamp_min(torch.finfo(torch.float64).tiny)  # U = 0 would give log(inf)
    scores = logits.double() - temperature * torch.log(-torch.log(uniform))
    return scores.argmax(dim=-1)


def get_transfer_index(
    logits: Tensor,
    temperature: float,
    remasking: str,
    mask_index: Tensor,
    x: Tensor,
    k: Tensor,
    threshold: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick the tokens to commit this step (spec §3.0 "Token selection").

    logits [B, L, V], mask_index [B, L] bool (the candidates), x [B, L], k [B] (tokens to commit per
    row). Returns (x0 [B, L]: proposals on candidates, x elsewhere; transfer [B, L] bool). With a
    threshold every candidate at or above it is committed, and the top-1 of each row always is.
    """
    # 1) proposals and confidences, only where a candidate sits (the rest is never committed)
    rows, cols = mask_index.nonzero(as_tuple=True)
    cand_logits = logits[rows, cols].float()  # [N, V]
    x0_c = gumbel_argmax(cand_logits, temperature, generator=generator)  # [N]
    if remasking == "low_confidence":
        conf_c = torch.softmax(cand_logits, dim=-1).gather(-1, x0_c[:, None]).squeeze(-1)  # [N]
    elif remasking == "random":
        conf_c = torch.rand(x0_c.shape, generator=generator, device=x0_c.device)
    else:
        raise ValueError(f"remasking must be low_confidence or random, got {remasking!r}")
    x0 = x.clone()
    x0[rows, cols] = x0_c.to(x.dtype)
    conf = torch.full(x.shape, -math.inf, device=x.device)  # [B, L]
    conf[rows, cols] = conf_c.float()

    # 2) per-row top-k by confidence (rank 0 = most confident)
    num_cand = mask_index.sum(dim=1)  # [B]
    k = num_cand if threshold is not None else torch.minimum(k.to(num_cand.device), num_cand)
    order = conf.argsort(dim=1, descending=True, stable=True)  # [B, L]
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(x.shape[1], device=x.device).expand_as(order)
    )
    transfer = (ranks < k[:, None]) & mask_index  # [B, L]
    if threshold is not None:
        transfer &= (conf >= threshold) | (ranks == 0)
    return x0, transfer


def shift_logits(logits: Tensor, shift: int) -> Tensor:
    """Position p reads logits[p - shift]; the first `shift` positions get zeros. [B, L, V] -> same."""
    if shift == 0:
        return logits
    out = torch.zeros_like(logits)
    out[:, shift:] = logits[:, :-shift]
    return out


# ---- the standalone block sampler ---------------------------------------------------------------


@dataclass(frozen=True)
class BlockGeometry:
    gen_length: int  # G: new tokens per row
    num_blocks: int  # nb
    steps_per_block: int  # spb
    block_size: int


def block_geometry(
    max_new_tokens: int, block_size: int | None, steps: int, use_kv_cache: bool
) -> BlockGeometry:
    """Spec §3.0 step 1. With the cache G is a whole number of blocks and steps a multiple of nb."""
    bs = block_size or max_new_tokens
    if use_kv_cache:
        g = (max_new_tokens // bs) * bs or bs
        nb = g // bs
        total = (steps // nb) * nb or nb
        return BlockGeometry(g, nb, total // nb, bs)
    nb = math.ceil(max_new_tokens / bs)
    return BlockGeometry(max_new_tokens, nb, math.ceil(steps / nb), bs)


@dataclass
class Canvas:
    """Prompts left-aligned, [MASK] over each row's own window [P_b, P_b + G), eos filler after."""

    x: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T] 1 on [0, P_b + G)
    gen_start: Tensor  # [B] = P_b


def build_canvas(prompts: list[list[int]], gen_length: int, mask_id: int, fill_id: int, device) -> Canvas:
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    total = int(lengths.max()) + gen_length
    x = torch.full((len(prompts), total), fill_id, dtype=torch.long, device=device)  # [B, T]
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        x[b, len(p) : len(p) + gen_length] = mask_id
    pos = torch.arange(total, device=device)[None, :]  # [1, T]
    attention_mask = (pos < (lengths + gen_length)[:, None]).long()  # [B, T]
    return Canvas(x, attention_mask, lengths)


def first_eos_done(x: Tensor, gen_start: Tensor, gen_length: int, eos_id: int, mask_id: int) -> Tensor:
    """Rows whose generation window holds an EOS with no [MASK] before it. -> [B] bool."""
    pos = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
    window = (pos >= gen_start[:, None]) & (pos < (gen_start + gen_length)[:, None])  # [B, T]
    masked_before = (window & (x == mask_id)).long().cumsum(dim=1)  # [B, T] masks up to and incl. p
    return (window & (x == eos_id) & (masked_before == 0)).any(dim=1)


def run_block_sampler(
    forward: ForwardFn,
    canvas: Canvas,
    cfg: SamplerConfig,
    geometry: BlockGeometry,
    mask_id: int,
    fill_id: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int, Tensor]:
    """Semi-autoregressive block decoding without a KV cache (spec §3.0 step 4, no-cache path), in place
    on `canvas.x`. Block j of row b covers [P_b + j*bs, P_b + min((j+1)*bs, G)). Returns (x [B, T],
    nfe = forward calls, row_nfe [B] = forwards made while the row still had masks to fill)."""
    x, attn, start = canvas.x, canvas.attention_mask, canvas.gen_start
    bsz, total = x.shape
    pos = torch.arange(total, device=x.device)[None, :]  # [1, T]
    gen_end = start + geometry.gen_length  # [B]
    done = torch.zeros(bsz, dtype=torch.bool, device=x.device)  # [B]
    nfe, row_nfe = 0, torch.zeros(bsz, dtype=torch.long, device=x.device)
    for j in range(geometry.num_blocks):
        lo = start + j * geometry.block_size  # [B]
        hi = torch.minimum(lo + geometry.block_size, gen_end)  # [B]
        in_block = (pos >= lo[:, None]) & (pos < hi[:, None])  # [B, T]
        schedule = get_num_transfer_tokens(in_block & (x == mask_id), geometry.steps_per_block)  # [B, spb]
        for i in range(geometry.steps_per_block):
            candidates = in_block & (x == mask_id) & ~done[:, None]  # [B, T]
            if not candidates.any():
                break
            logits = shift_logits(forward(x, attn), cfg.logit_shift)  # [B, T, V]
            logits[..., mask_id] = -math.inf  # a committed position must never hold [MASK]
            nfe += 1
            row_nfe += candidates.any(dim=1).long()  # forwards a row needed, not the batch's
            # Last step of the block: commit everything left (caveat 6: never strand masks).
            last = i == geometry.steps_per_block - 1
            k = candidates.sum(dim=1) if last else schedule[:, i]
            x0, transfer = get_transfer_index(
                logits,
                cfg.temperature,
                cfg.remasking,
                candidates,
                x,
                k,
                None if last else cfg.threshold,
                generator,
            )
            x[transfer] = x0[transfer]
            if cfg.eos_token_id is not None:
                done |= first_eos_done(x, start, geometry.gen_length, cfg.eos_token_id, mask_id)
        if cfg.eos_token_id is not None and bool(done.all()):
            break
    # Finished rows stop early: their leftover masks become filler (trimmed away after the EOS).
    leftover = (x == mask_id) & (pos >= start[:, None]) & (pos < gen_end[:, None])  # [B, T]
    x[leftover] = fill_id
    return x, nfe, row_nfe


def run_infill(
    forward: ForwardFn,
    seqs: list[list[int]],
    cfg: SamplerConfig,
    mask_id: int,
    fill_id: int,
    device,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Fill every [MASK] of `seqs` in place (spec §3.0 "Infill"): blocks of `block_size` over the whole
    sequence, the transfer schedule per block, full forwards, no threshold. Returns (x [B, T],
    lengths [B], nfe)."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # [B]
    total = int(lengths.max())
    x = torch.full((len(seqs), total), fill_id, dtype=torch.long, device=device)  # [B, T]
    for b, s in enumerate(seqs):
        x[b, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    pos = torch.arange(total, device=device)[None, :]  # [1, T]
    attn = (pos < lengths[:, None]).long()  # [B, T]
    bs = cfg.block_size or total
    nb = math.ceil(total / bs)
    spb = math.ceil(cfg.steps / nb)
    nfe = 0
    for j in range(nb):
        in_block = (pos >= j * bs) & (pos < (j + 1) * bs) & attn.bool()  # [B, T]
        schedule = get_num_transfer_tokens(in_block & (x == mask_id), spb)  # [B, spb]
        for i in range(spb):
            candidates = in_block & (x == mask_id)
            if not candidates.any():
                break
            logits = shift_logits(forward(x, attn), cfg.logit_shift)  # [B, T, V]
            logits[..., mask_id] = -math.inf
            nfe += 1
            k = candidates.sum(dim=1) if i == spb - 1 else schedule[:, i]
            x0, transfer = get_transfer_index(
                logits, cfg.temperature, cfg.remasking, candidates, x, k, None, generator
            )
            x[transfer] = x0[transfer]
    return x, lengths, nfe


def native_generate(model: Any, *names: str) -> Callable | None:
    """The checkpoint's own remote-code `generate` when its class defines one taking every keyword in
    `names` (transformers' generic `GenerationMixin.generate` never counts), else None."""
    import inspect

    from transformers import GenerationMixin

    method = getattr(type(model), "generate", None)
    if method is None or method is GenerationMixin.generate:
        return None
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return None
    return model.generate if all(n in params for n in names) else None


# ---- the sampler interface ----------------------------------------------------------------------


@dataclass
class GenerationResult:
    """sequences: generated ids only, cut at the first stop id (for infill: the whole filled sequence).
    nfe: model forward calls; row_nfe: forwards each row took part in (speed per sequence)."""

    sequences: list[list[int]]
    nfe: int
    num_generated_tokens: int
    elapsed_s: float
    row_nfe: list[int] = field(default_factory=list)


class Sampler(ABC):
    """One generation algorithm. Subclasses set the `supports_*` flags and implement `_generate`."""

    name: ClassVar[str] = "base"
    supports_infill: ClassVar[bool] = False
    supports_kv_cache: ClassVar[bool] = False
    supports_batching: ClassVar[bool] = True
    # Why a sampler has no KV-cache path (said when a cache is asked for).
    no_kv_cache_reason: ClassVar[str] = "it has no KV-cache path"

    def __init__(
        self,
        model,
        tokenizer,
        config: SamplerConfig,
        mask_id: int | None = None,
        forward=None,
        *,
        training_settings: Any = None,
    ):
        if config.use_kv_cache and not self.supports_kv_cache:
            raise UserError(
                f"sampler {self.name}: {self.no_kv_cache_reason}; drop the cache setting (--no_kv_cache)"
            )
        self.model, self.tokenizer, self.config = model, tokenizer, config
        # The checkpoint's training Settings (settings.json), or None: given, or left on the model by
        # `dllmflow.inference.generate.load_for_generation`.
        if training_settings is None:
            training_settings = getattr(model, TRAINING_SETTINGS_ATTR, None)
        self.training_settings = training_settings
        self.mask_id = resolve_mask_id(mask_id, tokenizer, model)
        fill = getattr(tokenizer, "eos_token_id", None)
        self.fill_id = int(fill if fill is not None else getattr(tokenizer, "pad_token_id", 0) or 0)
        self.stop_ids = stop_token_ids(tokenizer)
        self._forward = forward or self.model_forward

    @property
    def device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except (StopIteration, AttributeError):
            return torch.device("cpu")

    def model_forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits [B, T, V] of the canvas. Default: a causal HF forward; masked-diffusion samplers
        override this with the bidirectional one."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.config.seed)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationResult:
        if not prompt_ids:
            return GenerationResult([], 0, 0, 0.0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.supports_batching:
                seqs, nfe, row_nfe = self._generate(prompt_ids)
            else:  # one prompt at a time
                seqs, nfe, row_nfe = [], 0, []
                for p in prompt_ids:
                    s, n, r = self._generate([p])
                    seqs += s
                    nfe += n
                    row_nfe += r
        trimmed = [trim_at_stop(s, self.stop_ids) for s in seqs]
        elapsed = time.perf_counter() - t0
        return GenerationResult(trimmed, nfe, sum(map(len, trimmed)), elapsed, row_nfe)

    @abstractmethod
    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        """-> (generated ids per row, untrimmed; forward calls; forwards per row)."""

    def infill(self, seqs: list[list[int]]) -> GenerationResult:
        raise UserError(f"sampler {self.name} does not support infill; use --sampler llada")
