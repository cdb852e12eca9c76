"""`nemotron`: Nemotron-Labs-Diffusion block decoding with a KV cache (docs/strategies.md §3.4).

A checkpoint that ships its own remote-code `generate(..., block_length, causal_context, ...)`
(returning `(ids, nfe)`) is decoded with it, one prompt at a time. Our hybrid checkpoints are plain
HF decoders (Qwen3, Llama), decoded here in a batch:

1. Canvas: prompts LEFT-padded to a common length S (position ids restart at each row's first real
   token, padded keys are blocked), then G = whole blocks of [MASK] (`block_size`, preset 32).
2. Attention is block-causal (`dllmflow.diffusion.masks.block_causal`): the prompt attends causally
   (`causal_context`, else bidirectionally within itself); each block sees the prompt, the earlier
   blocks and itself bidirectionally.
3. With `causal_context` the first token of each block is seeded from the logit of the position just
   before it (the AR seed: that query sees exactly its causal past), then the block's masks are filled
   over `steps / num_blocks` steps: the top-1 and every proposal with confidence >= `threshold`
   (preset 0.9), the block's last step commits the rest (never a stranded mask), per-row EOS stop.

With the KV cache (preset) the prompt is prefilled once, each step runs only the current block
against the cache, and a finished block is appended with one more forward (whose last logit is the
next block's seed). Without it (`cache: none`, or its CLI alias `--no-kv-cache`) every forward runs
over the whole canvas with the same 4D mask, so both paths compute the same logits and greedy decoding
gives the same tokens. `causal_context` is its own option (`--causal-context on|off`, preset on): the
cache setting leaves it as it is, so the two paths compare with the same context.

    sampler = NemotronSampler(model, tok, NemotronConfig(max_new_tokens=256))
    result = sampler.generate([ids_a, ids_b])
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask

from .base import Sampler, native_generate
from .configs import NemotronConfig
from .kv import select_cache_rows
from .loop import (
    BlockGeometry,
    LeftPaddedCanvas,
    LoopRows,
    block_geometry,
    build_left_padded_canvas,
    commit_step,
    get_num_transfer_tokens,
    gumbel_argmax,
)
from .stopping import first_eos_done


class _BlockCausalForward:
    """Logits of the canvas under the block-causal mask, with or without a KV cache, for the canvas
    rows `rows` [R] (the rows its cache holds, in order; `select_rows` drops some of them).

    `prefix(rows)` -> [R, V] logit of the last prompt position; `block(lo, hi, rows)` -> [R, hi-lo, V]
    logits of one block; `commit(lo, hi, rows)` -> [R, V] logit of the block's last position once it
    is final (with the cache this also appends the block). `calls` counts model forwards, `span` is the
    canvas span the last one computed."""

    def __init__(
        self, model, canvas: LeftPaddedCanvas, block_size: int, causal_prefix: bool, use_cache: bool
    ):
        from dllmflow.models.attention import mask_dtype

        self.model, self.c, self.bs, self.causal = model, canvas, block_size, causal_prefix
        self.dtype = mask_dtype(model, canvas.x.device)
        self.cache = None
        if use_cache:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        self.keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.calls, self.span = 0, (0, 0)

    def select_rows(self, index: Tensor) -> None:
        if self.cache is not None:
            select_cache_rows(self.cache, index)

    def _mask(self, q_start: int, q_end: int, rows: Tensor) -> Tensor:
        valid = self.c.valid[rows]
        keys = valid[:, :q_end] if self.cache is not None else valid
        return block_causal_mask(
            keys, self.c.prefix_len, self.bs, self.causal, self.dtype, q_start, q_end - q_start
        )

    def _logits(self, lo: int, hi: int, append: bool, rows: Tensor) -> Tensor:
        """Logits [R, hi-lo, V] of positions [lo, hi)."""
        self.calls += 1
        ids, positions = self.c.x[rows], self.c.position_ids[rows]  # [R, T]
        if self.cache is None:  # the whole canvas, every forward
            T = ids.shape[1]
            kwargs = {"logits_to_keep": torch.arange(lo, hi, device=ids.device)} if self.keep_arg else {}
            out = self.model(input_ids=ids, attention_mask=self._mask(0, T, rows), position_ids=positions,
                             use_cache=False, **kwargs)  # fmt: skip
            self.span = (0, T)
            return out.logits if self.keep_arg else out.logits[:, lo:hi]
        out = self.model(input_ids=ids[:, lo:hi], attention_mask=self._mask(lo, hi, rows),
                         position_ids=positions[:, lo:hi], cache=self.cache, use_cache=True)  # fmt: skip
        self.span = (lo, hi)
        if not append:  # the forward appended this block's provisional keys/values: drop them
            self.cache.crop(-(hi - lo))
        return out.logits

    def prefix(self, rows: Tensor) -> Tensor:
        S = self.c.prefix_len
        if self.cache is not None:
            return self._logits(0, S, True, rows)[:, -1]
        return self._logits(S - 1, S, False, rows)[:, -1]

    def block(self, lo: int, hi: int, rows: Tensor) -> Tensor:
        return self._logits(lo, hi, False, rows)

    def commit(self, lo: int, hi: int, rows: Tensor) -> Tensor:
        if self.cache is not None:
            return self._logits(lo, hi, True, rows)[:, -1]
        return self._logits(hi - 1, hi, False, rows)[:, -1]


def decode_block_causal(
    model,
    canvas: LeftPaddedCanvas,
    cfg: NemotronConfig,
    geometry: BlockGeometry,
    mask_id: int,
    fill_id: int,
    generator: torch.Generator | None = None,
) -> tuple[int, Tensor, Tensor]:
    """Fill `canvas.x` in place, block by block (module docstring); a row stopped at its EOS leaves the
    forwards (and the cache). -> (nfe, row_nfe [B], positions [B] computed per row)."""
    x, S, bs = canvas.x, canvas.prefix_len, geometry.block_size
    G, B = geometry.gen_length, x.shape[0]
    source = _BlockCausalForward(model, canvas, bs, cfg.causal_context, cfg.cache == "exact")
    state = LoopRows.new(torch.full((B,), S, device=x.device))
    live, row_nfe = state.live, state.row_nfe  # rows are never re-indexed here: no pause between blocks

    def forward(fn, *args):
        r = live.index  # [R] every row not stopped at its EOS
        row_nfe[r] += 1
        logits = fn(*args, r).float()
        live.computed(r, canvas.valid[r, source.span[0] : source.span[1]])
        logits[..., mask_id] = -math.inf  # a committed position must never hold [MASK]
        return logits

    def check_eos():
        if cfg.eos_token_id is not None:
            state.done |= first_eos_done(x, state.start, G, cfg.eos_token_id, mask_id)
            state.retire_done(source)

    # the prompt pass: fills the cache, and gives block 0's AR seed
    seed_logits = forward(source.prefix) if (cfg.cache == "exact" or cfg.causal_context) else None  # [R, V]
    for j in range(geometry.num_blocks):
        lo, hi = S + j * bs, S + (j + 1) * bs
        block = x[:, lo:hi]  # [B, bs] a view: writes land in x
        if cfg.causal_context:  # AR seed: the causal logit of the position before the block
            r = live.index
            uniform = None  # drawn for the whole batch: a stopped row does not move the others' draws
            if cfg.temperature > 0:
                shape, dev = (B, seed_logits.shape[-1]), x.device
                uniform = torch.rand(shape, generator=generator, device=dev, dtype=torch.float64)[r]
            seed = gumbel_argmax(seed_logits, cfg.temperature, uniform)  # [R]
            put = block[r, 0] == mask_id  # [R]
            x[r[put], lo] = seed[put].to(x.dtype)
            check_eos()
        schedule = get_num_transfer_tokens(block == mask_id, geometry.steps_per_block)  # [B, spb]
        for i in range(geometry.steps_per_block):
            r = live.index
            candidates = block[r] == mask_id  # [R, bs]
            if not candidates.any():
                break
            logits = forward(source.block, lo, hi)  # [R, bs, V]
            last = i == geometry.steps_per_block - 1  # commit the rest: never strand a mask
            sub = block[r]  # [R, bs] a copy: written back below
            commit_step(logits, candidates, sub, schedule[r, i], last, cfg, mask_id, generator)
            block[r] = sub
            check_eos()
        if not len(live) or j == geometry.num_blocks - 1:
            break
        if cfg.cache == "exact" or cfg.causal_context:
            seed_logits = forward(source.commit, lo, hi)
    # rows that stopped at an EOS keep masks after it: filler (trimmed away with the EOS)
    x[:, S:][x[:, S:] == mask_id] = fill_id
    return source.calls, row_nfe, live.positions


class NemotronSampler(Sampler):
    name = "nemotron"
    config_cls = NemotronConfig
    supports_infill = False
    supports_batching = True

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, whole_blocks=True)
        native = native_generate(self.model, "block_length", "causal_context")
        if native is not None:
            return self._generate_native(native, prompt_ids, geometry)
        canvas = build_left_padded_canvas(
            prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        nfe, row_nfe, positions = decode_block_causal(
            self.model, canvas, cfg, geometry, self.mask_id, self.fill_id, self.generator()
        )
        S = canvas.prefix_len
        return canvas.x[:, S:].tolist(), nfe, row_nfe.tolist(), positions.tolist()

    def _generate_native(self, native, prompt_ids, geometry: BlockGeometry):
        """The checkpoint's own generate, one prompt at a time (it takes a [1, P] prompt)."""
        cfg, seqs, nfes = self.config, [], []
        for p in prompt_ids:
            ids = torch.tensor([p], dtype=torch.long, device=self.device)
            torch.manual_seed(cfg.seed)
            out, nfe = native(
                ids, max_new_tokens=geometry.gen_length, block_length=geometry.block_size, threshold=cfg.threshold,
                temperature=cfg.temperature, causal_context=cfg.causal_context, eos_token_id=cfg.eos_token_id,
            )  # fmt: skip
            gen = out[0].tolist()
            seqs.append(gen[len(p) :] if gen[: len(p)] == p else gen)  # with or without the prompt
            nfes.append(int(nfe))
        return seqs, sum(nfes), nfes
