"""`llada2`: LLaDA2 block refinement (docs/strategies.md §3.3), with LLaDA2.1's token editing.

A checkpoint that ships its own remote-code `generate(inputs, gen_length, block_length, steps, ...)`
(LLaDA2.x) is decoded with it, one prompt at a time. Otherwise the same algorithm runs here, on a batch
(prompts left-padded to a common length, each row decoded as it would be alone):

* blocks of `block_size` (preset 32) after the prompt; `steps` (preset 32) is the step budget of
  EACH block, as in LLaDA2's own generate (not a total as for `llada`);
* each forward covers the prompt and the blocks up to the current one under the block-causal mask
  (`dllmflow.diffusion.masks.block_causal`: prompt bidirectional, or causal for a `block_causal` model
  trained so (models/causal_prompt.py); a block sees the prompt, earlier blocks and itself, causally
  for a `causal_blocks` model);
* per step, the block's masks with confidence >= `threshold` (preset 0.5) are committed, and at
  least the schedule's count (the most confident ones); the block's last step commits the rest;
* editing (LLaDA2.1, `editing_threshold` > 0; preset 0 = off): a committed token of the current block
  is replaced when the model's confidence in a different token exceeds `editing_threshold`; once the
  block has no mask left, up to `max_post_steps` (preset 16) editing-only forwards run, stopping at
  the first one that edits nothing;
* decoding stops at an EOS with no mask before it (the EOS id: `eos_token_id`, else the tokenizer's);
* KV cache (`cache: exact`, the preset; `none` turns it off): the prompt and the committed blocks are cached, each
  step forwards the current block against them (a block's first forward also feeds the previous,
  now final, block). Block-causal attention makes every cached key final, so the tokens are those of
  the uncached path (`cache: none`, or a canvas `forward` handed in).

    sampler = LLaDA2Sampler(model, tok, LLaDA2Config(editing_threshold=0.9))
    result = sampler.generate([ids_a, ids_b])
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask
from dllmflow.models.causal_prompt import has_causal_blocks, has_causal_prompt
from dllmflow.models.logit_shift import is_logit_shifted

from .base import Sampler, native_generate
from .configs import LLaDA2Config
from .kv import BlockCausalCache, check_cache_fits, on_rows
from .loop import (
    BlockGeometry,
    BlockLoop,
    LeftPaddedCanvas,
    LoopRows,
    SettledRows,
    between_blocks,
    block_geometry,
    build_left_padded_canvas,
    drain,
    get_num_transfer_tokens,
    gumbel_argmax,
)
from .stopping import first_eos_done

# logits = forward(input_ids [B, T], 4D mask, position_ids [B, T], num_logits) -> [B, >= num_logits, V]
RefineForward = Callable[[Tensor, Tensor, Tensor, int], Tensor]


def refine_transfer(conf: Tensor, masked: Tensor, k: Tensor, threshold: float | None) -> Tensor:
    """Masks to commit: every one with conf >= threshold, and at least the k most confident.
    conf, masked [B, L]; k [B] -> [B, L] bool."""
    conf = torch.where(masked, conf, torch.full_like(conf, -math.inf))
    order = conf.argsort(dim=1, descending=True, stable=True)  # [B, L]
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order)
    )
    chosen = ranks < k[:, None]
    if threshold is not None:
        chosen |= conf >= threshold
    return chosen & masked


def edit_index(
    x0: Tensor, conf: Tensor, current: Tensor, editable: Tensor, editing_threshold: float
) -> Tensor:
    """LLaDA2.1 editing: committed (editable) positions whose proposal differs from the current token
    with confidence above `editing_threshold`; 0 = never. All [B, L] -> [B, L] bool."""
    if editing_threshold <= 0:
        return torch.zeros_like(editable)
    return editable & (x0 != current) & (conf > editing_threshold)


class CanvasBlockCausal:
    """The uncached source: block [lo, hi)'s logits [B, hi-lo, V] from a forward over the canvas up to
    the block's end (block j never sees later positions) under the block-causal mask. With `shift` 1 (a
    `dllm.logit_shift` model) they are the raw logits of [lo-1, hi-1): the block's first position is
    read off the last position before it, which block-causal attention keeps from seeing the block."""

    def __init__(
        self,
        forward: RefineForward,
        canvas: LeftPaddedCanvas,
        block_size: int,
        dtype: torch.dtype,
        shift: int = 0,
        causal_prefix: bool = False,
    ):
        self.forward, self.c, self.bs, self.dtype, self.calls = forward, canvas, block_size, dtype, 0
        self.shift, self.causal_prefix = shift, causal_prefix

    def __call__(self, lo: int, hi: int, rows: Tensor | None = None) -> Tensor:
        c, n, s = self.c, hi - lo, self.shift
        valid = on_rows(c.valid, rows)
        mask = block_causal_mask(
            valid[:, :hi], c.prefix_len, self.bs, self.causal_prefix, self.dtype
        )  # [R,1,hi,hi]
        self.calls, self.span = self.calls + 1, (0, hi)
        ids, positions = on_rows(c.x, rows)[:, :hi], on_rows(c.position_ids, rows)[:, :hi]
        logits = self.forward(ids, mask, positions, n + s)  # [R, >= n+s, V]
        return logits[:, logits.shape[1] - n - s : logits.shape[1] - s]  # [R, n, V]

    def select_rows(self, index: Tensor) -> None:
        pass  # no state of its own: the canvas is shared with the loop, which selects it


def iter_refine_blocks(
    source: Callable[[int, int], Tensor],
    canvas: LeftPaddedCanvas,
    cfg: LLaDA2Config,
    geometry: BlockGeometry,
    mask_id: int,
    eos_id: int | None,
    generator: torch.Generator | None = None,
) -> BlockLoop:
    """LLaDA2 block refinement of a batch, in place on `canvas.x` (module docstring), one block at a
    time (a `loop.BlockLoop`: a block is yielded once every row left it, so its tokens, edits included,
    are final). Every row does what it would alone: it leaves a block once it is full (or, with
    editing, once a post-step edits nothing or `max_post_steps` ran), and stops at its EOS (then leaves
    the forwards); the batch moves on when no row is left. `source(lo, hi, rows)` -> logits [R, hi-lo,
    V] of the block (`CanvasBlockCausal`, `kv.BlockCausalCache`). -> (nfe = forward calls, row_nfe [B]
    = forwards each row took part in, positions [B] = positions they computed for it)."""
    S, G, bs, spb = canvas.prefix_len, geometry.gen_length, geometry.block_size, cfg.steps
    state = LoopRows.new(torch.full((canvas.x.shape[0],), S, device=canvas.x.device))
    for j in range(geometry.num_blocks):
        if j:
            yield from between_blocks(state, canvas, j * bs, source)
        start, done, row_nfe, live = state.start, state.done, state.row_nfe, state.live
        if not len(live):
            break
        x, B = canvas.x, canvas.x.shape[0]
        lo, hi = S + j * bs, min(S + (j + 1) * bs, S + G)
        block = x[:, lo:hi]  # [B, b] a view: writes land in x
        schedule = get_num_transfer_tokens(block == mask_id, spb)  # [B, spb]
        post_steps = torch.zeros(B, dtype=torch.long, device=x.device)  # [B]
        left = done.clone()  # [B] rows finished with this block
        settled = SettledRows(done)
        for i in range(spb + cfg.max_post_steps):
            masked = block == mask_id  # [B, b]
            full = ~masked.any(dim=1)  # [B]
            # A full block is refined further only by editing, for at most max_post_steps forwards.
            left |= full & ((cfg.editing_threshold <= 0) | (post_steps >= cfg.max_post_steps))
            active = ~left  # [B]
            if not active.any():
                break
            post_steps += (full & active).long()
            row_nfe += active.long()
            r = live.index  # [R] the rows the source holds (every row not stopped at its EOS)
            logits = source(lo, hi, r).float()  # [R, b, V]
            live.computed(r, canvas.valid[r, source.span[0] : source.span[1]])
            x0, conf = _proposals(logits, cfg.temperature, mask_id, generator, B, r)  # [R, b] each
            last = i >= spb - 1  # the step budget is spent: commit the rest
            k = masked[r].sum(dim=1) if last else schedule[r, i]  # [R]
            sub, act = block[r], active[r, None]  # [R, b] a copy (written back), [R, 1]
            transfer = refine_transfer(conf, masked[r] & act, k, None if last else cfg.threshold)
            edits = edit_index(x0, conf, sub, ~masked[r] & act, cfg.editing_threshold)  # [R, b]
            sub[transfer | edits] = x0[transfer | edits].to(x.dtype)
            block[r] = sub
            left[r] |= (
                act[:, 0] & full[r] & ~edits.any(dim=1)
            )  # a post-step that edited nothing ends the block
            if eos_id is not None:
                done |= first_eos_done(x, start, G, eos_id, mask_id)
                left |= done
            if settled:  # a row that left the block never changes it again (edits included)
                settled.update(x, start, hi, left)
            state.retire_done(source)
        if not len(live):
            break
    return source.calls, state.row_nfe, state.live.positions


def _proposals(
    logits: Tensor, temperature: float, mask_id: int, generator, batch: int, rows: Tensor
) -> tuple[Tensor, Tensor]:
    """(proposal, its confidence) [R, b] each from the live rows' logits [R, b, V] (the [MASK] column
    never proposed). The Gumbel noise is drawn for the whole batch of `batch` rows and read at `rows`,
    so a stopped row leaving the forwards does not move the others' draws."""
    logits[..., mask_id] = -math.inf
    uniform = None
    if temperature > 0:
        shape = (batch, *logits.shape[1:])
        uniform = torch.rand(shape, generator=generator, device=logits.device, dtype=torch.float64)[rows]
    x0 = gumbel_argmax(logits, temperature, uniform)  # [R, b]
    conf = torch.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # [R, b]
    return x0, conf


class LLaDA2Sampler(Sampler):
    name = "llada2"
    config_cls = LLaDA2Config
    supports_infill = False
    supports_batching = True  # a checkpoint's own generate takes one prompt: then one at a time

    def __init__(self, model, tokenizer, config, mask_id: int | None = None, forward=None, **kw):
        super().__init__(model, tokenizer, config, mask_id, forward, **kw)
        # A canvas forward handed in cannot take a cache; the cache is exact, so its tokens are the same.
        self.cached = self.config.cache == "exact" and forward is None

    def model_forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, num_logits: int
    ) -> Tensor:
        """Logits [B, >= num_logits, V] ending at the last position; attention_mask: the 4D
        block-causal float mask. Only the block's logits are computed when the model can (a 157k vocab
        makes the prompt's logits the costliest part of a forward)."""
        keep = {"logits_to_keep": num_logits} if self._keeps_logits else {}
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **keep,
        ).logits

    @functools.cached_property
    def _keeps_logits(self) -> bool:
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _eos_id(self) -> int | None:
        if self.config.eos_token_id is not None:
            return self.config.eos_token_id
        return getattr(self.tokenizer, "eos_token_id", None)

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        native = native_generate(self.model, "gen_length", "block_length") if self.model is not None else None
        if native is not None:  # the checkpoint's own generate: no blocks to yield
            out = [self._generate_native(native, p) for p in prompt_ids]
            return [s for o in out for s in o[0]], sum(o[1] for o in out), [n for o in out for n in o[2]]
        cfg = self.config
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, whole_blocks=False)
        canvas = build_left_padded_canvas(
            prompt_ids, geometry.gen_length, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        # A Dream-style A2D model (mdlm with dllm.logit_shift) reads each position's logit one earlier.
        shift = int(self.model is not None and is_logit_shifted(self.model))
        # A block_causal model is decoded under the mask it was trained with (models/causal_prompt.py): a
        # causal prompt, and a causal_blocks model a causal mask throughout (blocks of 1 in the mask only).
        causal_blocks = self.model is not None and has_causal_blocks(self.model)
        causal = causal_blocks or (self.model is not None and has_causal_prompt(self.model))
        mask_block = 1 if causal_blocks else geometry.block_size
        if self.cached:
            check_cache_fits(self.model, canvas.x.shape[1], self.name, "cache 'exact'")
            source = BlockCausalCache(self.model, canvas, mask_block, shift, causal)
        else:
            source = CanvasBlockCausal(self._forward, canvas, mask_block, self._mask_dtype(), shift, causal)
        nfe, row_nfe, positions = yield from iter_refine_blocks(
            source, canvas, cfg, geometry, self.mask_id, self._eos_id(), self.generator()
        )
        gen = canvas.x[:, canvas.prefix_len :]  # [B, G]
        gen[gen == self.mask_id] = self.fill_id  # after an early EOS stop
        return gen.tolist(), nfe, row_nfe.tolist(), positions.tolist()

    def _mask_dtype(self) -> torch.dtype:
        if self.model is None:  # a scripted forward in tests
            return torch.float32
        from dllmflow.models.attention import mask_dtype

        return mask_dtype(self.model, self.device)

    def _generate_native(self, native, prompt: list[int]) -> tuple[list[list[int]], int, list[int]]:
        """The checkpoint's own generate (returns the generated ids only); forwards counted on the head."""
        cfg = self.config
        kwargs = dict(
            temperature=cfg.temperature, block_length=cfg.block_size or cfg.max_new_tokens, steps=cfg.steps, gen_length=cfg.max_new_tokens,
            eos_early_stop=True, threshold=cfg.threshold, editing_threshold=cfg.editing_threshold,
            max_post_steps=cfg.max_post_steps, eos_id=self._eos_id(), mask_id=self.mask_id,
        )  # fmt: skip
        params = inspect.signature(native).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in params}  # LLaDA2.0 has no editing arguments
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, P]
        calls = [0]
        head = self.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            torch.manual_seed(cfg.seed)
            out = native(inputs=ids, **kwargs)
        finally:
            hook.remove()
        gen = out[0].tolist()
        return [gen[len(prompt) :] if gen[: len(prompt)] == prompt else gen], calls[0], [calls[0]]
