"""KV caches of the block samplers (docs/strategies.md §3.0 "Caches"): exact ones where attention
allows it (`llada2`'s block-causal canvas, `idlm`'s causal one) and Fast-dLLM's approximate prefix and
dual caches for the bidirectional `llada` and `scdd`.

Every source here decodes a left-padded canvas (`loop.build_left_padded_canvas`): block j is the same
slice of every row, position ids restart at each row's first real token and padded keys are blocked,
so a row decodes as it would alone. A source is called `source(lo, hi, rows)` -> logits [R, hi-lo, V]
of the canvas positions [lo, hi) (`cols`) of the canvas rows `rows` [R] (idlm: the logits that fill
them, read one position earlier; rows None: every row), counts its model forwards in `calls` and leaves
the canvas span its forward computed in `span`. Its cache holds the rows it is called with, in that
order: rows leave it through `select_rows` (the block loop's `LiveRows`: a row stopped at its EOS is
computed no more). `loop.iter_block_loop` decodes with any of them, as with its uncached `FullForward`.

    source = CausalShiftCache(model, canvas)               # idlm, exact
    nfe, row_nfe, positions = drain(iter_block_loop(source, canvas, cfg, geometry, mask_id, fill_id))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask
from dllmflow.diffusion.masks.causal import causal_mask
from dllmflow.errors import UserError
from dllmflow.models.logit_shift import is_logit_shifted
from dllmflow.settings.pipeline import CacheMode

from .loop import LeftPaddedCanvas, build_left_padded_canvas
from .stopping import LiveRows


def on_rows(t: Tensor, rows: Tensor | None) -> Tensor:
    """The canvas rows `rows` of `t` [B, ...] (None: all of it)."""
    return t if rows is None else t[rows]


def check_cache_fits(model: Any, length: int, sampler: str, what: str) -> None:
    """UserError naming the limit when a cached canvas of `length` positions exceeds the model's
    `max_position_embeddings` (checked before the first forward)."""
    from dllmflow.models.limits import max_positions

    limit = max_positions(model)
    if limit is not None and length > limit:
        raise UserError(
            f"sampler {sampler} with {what} would cache {length} positions (the longest prompt plus "
            f"max_new_tokens), beyond the model's max_position_embeddings ({limit}); lower "
            "--max-new-tokens or shorten the prompt"
        )


def check_cache_model(model: Any, sampler: str, what: str) -> None:
    """A cache needs an HF decoder that takes a KV cache, position ids and a 4D float mask; the
    natively bidirectional remote-code families (LLaDA) take none of them."""
    from dllmflow.models.attention import NATIVELY_BIDIRECTIONAL

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model is None or model_type in NATIVELY_BIDIRECTIONAL:
        raise UserError(
            f"sampler {sampler} with {what} needs a Hugging Face decoder that takes a KV cache and a 4D "
            f"attention mask, got {type(model).__name__} (model_type {model_type}); use cache 'none'"
        )


def fast_dllm_canvas(sampler: Any, prompt_ids: list[list[int]], gen_length: int, cache: str):
    """The left-padded canvas of an approximate (Fast-dLLM) cache, once the sampler may use one: its own
    model (not a custom forward) that takes a KV cache, and a canvas within the model's positions."""
    what = f"cache {cache!r}"
    if sampler._forward != sampler.model_forward:
        raise UserError(
            f"sampler {sampler.name} with {what} needs the model itself, not a forward; use cache 'none'"
        )
    check_cache_model(sampler.model, sampler.name, what)
    canvas = build_left_padded_canvas(
        prompt_ids, gen_length, sampler.mask_id, sampler.fill_id, sampler.device, sampler=sampler.name
    )
    check_cache_fits(sampler.model, canvas.x.shape[1], sampler.name, what)
    return canvas


class ModelCache:
    """A model and its DynamicCache: forward new positions against the cached keys, crop back."""

    def __init__(self, model, device: torch.device):
        from transformers import DynamicCache

        from dllmflow.models.attention import mask_dtype, takes_logits_to_keep

        self.model, self.cache = model, DynamicCache(config=model.config)
        self.dtype = mask_dtype(model, device)
        self.keep_arg = takes_logits_to_keep(model.forward)
        self.cache_arg = cache_argument(model.forward)
        self.calls = 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, ids: Tensor, mask: Tensor, position_ids: Tensor, lo: int, hi: int) -> Tensor:
        """Append `ids` [B, Q] (4D mask [B, 1, Q, cached + Q]); logits [B, hi-lo, V] of its positions
        [lo, hi). A model that takes HF's `logits_to_keep` runs its LM head on those alone (a window
        of positions, as `attention.model_logits`): the head is a large share of a forward at a real
        vocabulary, and a refresh or a prefix step would otherwise run it on the whole suffix too."""
        Q = ids.shape[1]
        if not self.keep_arg:
            kw = {}
        elif hi == Q:
            kw = {"logits_to_keep": Q - lo}
        else:
            kw = {"logits_to_keep": torch.arange(lo, hi, device=ids.device)}  # [hi-lo]
        kw[self.cache_arg] = self.cache
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kw)
        self.calls += 1
        return out.logits if self.keep_arg else out.logits[:, lo:hi]  # [B, hi-lo, V]

    def select_rows(self, index: Tensor) -> None:
        select_cache_rows(self.cache, index)

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        if self.length > length:
            self.cache.crop(-(self.length - length))

    def drop(self, lo: int, hi: int) -> None:
        """Remove cached positions [lo, hi) (the dual cache keeps the suffix after the prefix)."""
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :lo, :], layer.keys[..., hi:, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :lo, :], layer.values[..., hi:, :]], dim=-2)


def cache_argument(forward) -> str:
    """The keyword a model's forward takes its KV cache by: transformers 5 renamed `past_key_values` to
    `cache`; a forward naming only the old one (remote code) gets that."""
    import inspect

    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # no inspectable signature: today's name
        return "cache"
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


def select_cache_rows(cache, index: Tensor) -> None:
    """Keep the batch rows `index` [B'] of an HF cache, through transformers' `batch_select_indices`. A
    cache holding no position (cropped to 0: `cache: none`, a refresh) is reset instead:
    `batch_select_indices` skips an empty layer, which would keep the old batch size and fail the next
    forward's append; a reset layer starts again from the rows that forward brings."""
    if cache.get_seq_length() == 0:
        cache.reset()
    else:
        cache.batch_select_indices(index)


def key_mask(key_valid: Tensor, num_queries: int, dtype: torch.dtype) -> Tensor:
    """Every query sees every valid key: key_valid [B, K] -> float additive [B, 1, Q, K]. Only for
    queries at real positions (a padded query would have no key left)."""
    low = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=key_valid.device)
    zero = torch.zeros((), dtype=dtype, device=key_valid.device)
    keep = key_valid.bool()[:, None, None, :].expand(-1, 1, num_queries, -1)  # [B, 1, Q, K]
    return torch.where(keep, zero, low)


class CacheSource:
    """What every cached logits source shares: the canvas, a `ModelCache` whose forwards are the
    source's `calls`, and rows selected alike in the cache (the canvas is shared with the loop, which
    selects it)."""

    def __init__(self, model, canvas: LeftPaddedCanvas):
        self.c, self.kv = canvas, ModelCache(model, canvas.x.device)

    @property
    def calls(self) -> int:
        return self.kv.calls

    def rows(self, needs: Tensor, live: LiveRows) -> Tensor:
        """The rows a step of `loop.iter_block_loop` forwards: every live one (the cache holds them all,
        a row done with the block while others are not stays until the block ends)."""
        return live.index  # [R]

    def select_rows(self, index: Tensor) -> None:
        self.kv.select_rows(index)


# ---- exact caches ------------------------------------------------------------------------------------


class CausalShiftCache(CacheSource):
    """idlm (causal, logit shift 1): the block [lo, hi) is filled from the logits of [lo-1, hi-1).
    The cache holds the committed prefix [0, lo-1): the LAST committed token stays out of it and is
    re-fed with the block, its query giving the block's first logit. A block's first forward also
    re-feeds the previous block (now final) and keeps its keys, so no forward is added."""

    def __call__(self, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        c, start, end = self.c, self.kv.length, hi - 1  # forward [start, end)
        valid = on_rows(c.valid, rows)
        mask = causal_mask(valid[:, :end], self.kv.dtype, start, end - start)  # [R, 1, end - start, end]
        Q = end - start  # its last hi - lo positions are [lo-1, hi-1)
        ids, positions = on_rows(c.x, rows)[:, start:end], on_rows(c.position_ids, rows)[:, start:end]
        logits = self.kv.forward(ids, mask, positions, Q - (hi - lo), Q)
        self.span, self.cols = (start, end), (lo, hi)
        self.kv.truncate(lo - 1)  # the block (and the last committed token) are re-fed next time
        return logits  # [B, hi-lo, V]


class BlockCausalCache(CacheSource):
    """llada2 (block-causal; the prompt bidirectional, or causal with `causal_prefix`): the cache holds
    the prompt and the committed blocks [0, lo); each step forwards the block against it. A block's
    first forward also feeds the previous block (now final; block-causal attention makes its keys
    independent of later blocks).
    With `shift` 1 (a `dllm.logit_shift` model) the block is filled from the logits of [lo-1, hi-1):
    the last committed position stays out of the cache and is re-fed with the block (its query, in
    the previous block or the prompt, does not see the block, so its logit is the same every step)."""

    def __init__(
        self, model, canvas: LeftPaddedCanvas, block_size: int, shift: int = 0, causal_prefix: bool = False
    ):
        super().__init__(model, canvas)
        self.bs, self.shift, self.causal_prefix = block_size, shift, causal_prefix

    def __call__(self, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        c, start, a = self.c, self.kv.length, lo - self.shift  # forward [start, hi), logits of [a, a+hi-lo)
        valid = on_rows(c.valid, rows)
        mask = block_causal_mask(
            valid[:, :hi], c.prefix_len, self.bs, self.causal_prefix, self.kv.dtype, start, hi - start
        )
        ids, positions = on_rows(c.x, rows)[:, start:hi], on_rows(c.position_ids, rows)[:, start:hi]
        logits = self.kv.forward(ids, mask, positions, a - start, hi - self.shift - start)
        self.span, self.cols = (start, hi), (lo, hi)
        self.kv.truncate(a)
        return logits  # [B, hi-lo, V]


# ---- Fast-dLLM's approximate caches (bidirectional attention) ---------------------------------------


class FastDLLMCache(CacheSource):
    """llada/scdd with `cache` 'prefix' or 'dual' (Fast-dLLM, Wu et al. 2025). The first call for a
    new block [lo, hi) is a full bidirectional forward over the canvas (its logits are that step's) that
    refreshes the cache: 'prefix' keeps the keys of [0, lo) (prompt and committed blocks), 'dual' also
    those of the suffix [hi, T) (stored after the prefix: RoPE is applied before caching, so key order
    is free). Later calls for the same block forward [lo, T) ('prefix') or [lo, hi) ('dual') against
    the cache and crop what they appended. The cached keys are stale within a block (they were
    computed when the block still held its masks): that is the approximation.

    A `dllm.logit_shift` model (models/logit_shift.py) reads position i's logit from i-1: the span
    then starts at a = lo - 1 (the last position before the block is re-fed, and kept out of the cache),
    and its first len(block) outputs fill the block."""

    def __init__(self, model, canvas: LeftPaddedCanvas, mode: CacheMode):
        super().__init__(model, canvas)
        self.mode = mode
        self.block: tuple[int, int] | None = None  # the block the cache was refreshed for
        self.shift = int(is_logit_shifted(model))

    def refresh(self, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        """Full forward over the canvas; cache [0, a) (+ [hi, T) for dual); logits [R, hi-lo, V]."""
        from dllmflow.models.attention import bidirectional_mask

        c, a = self.c, lo - self.shift
        self.kv.truncate(0)
        valid = on_rows(c.valid, rows)
        mask = bidirectional_mask(valid, self.kv.dtype)  # [R, 1, T, T]; padded queries keep a diagonal
        logits = self.kv.forward(on_rows(c.x, rows), mask, on_rows(c.position_ids, rows), a, a + hi - lo)
        self.span, self.cols = (0, c.x.shape[1]), (lo, hi)
        if self.mode == "dual":
            self.kv.drop(a, hi)
        else:
            self.kv.truncate(a)
        self.block = (lo, hi)
        return logits

    def __call__(self, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        if self.block != (lo, hi):
            return self.refresh(lo, hi, rows)
        c, total, a = self.c, self.c.x.shape[1], lo - self.shift
        end = hi if self.mode == "dual" else total
        cached, valid = self.kv.length, on_rows(c.valid, rows)
        keys = torch.cat([valid[:, :a], valid[:, hi:]], 1) if self.mode == "dual" else valid[:, :a]
        keys = torch.cat([keys, valid[:, a:end]], dim=1)  # [R, cached + Q] in cache order
        mask = key_mask(keys, end - a, self.kv.dtype)  # [R, 1, Q, K]
        ids, positions = on_rows(c.x, rows)[:, a:end], on_rows(c.position_ids, rows)[:, a:end]
        logits = self.kv.forward(ids, mask, positions, 0, hi - lo)
        self.kv.truncate(cached)
        self.span, self.cols = (a, end), (lo, hi)
        return logits  # [R, hi-lo, V]
