"""`llada2`: LLaDA2 block refinement (spec §3.3), with LLaDA2.1's token editing.

A checkpoint that ships its own remote-code `generate(inputs, gen_length, block_length, steps, ...)`
(LLaDA2.x) is decoded with it. Otherwise the same algorithm runs here, one prompt at a time:

* blocks of `block_size` (preset 32) after the prompt; `steps` (preset 32) is the step budget of
  EACH block, as in LLaDA2's own generate (not a total as for `llada`);
* each forward covers the prompt and the blocks up to the current one under the block-causal mask
  (`dllmflow.diffusion.masks.block_causal`: prompt bidirectional, a block sees the prompt, earlier
  blocks and itself);
* per step, the block's masks with confidence >= `threshold` (preset 0.5) are committed, and at
  least the schedule's count (the most confident ones); the block's last step commits the rest;
* editing (LLaDA2.1, `editing_threshold` > 0; preset 0 = off): a committed token of the current block
  is replaced when the model's confidence in a different token exceeds `editing_threshold`; once the
  block has no mask left, up to `max_post_steps` (preset 16) editing-only forwards run, stopping at
  the first one that edits nothing;
* decoding stops at an EOS with no mask before it (the EOS id: `eos_token_id`, else the tokenizer's).

    sampler = LLaDA2Sampler(model, tok, LLaDA2Config(editing_threshold=0.9))
    result = sampler.generate([ids])
"""

from __future__ import annotations

import inspect
import math
from typing import Literal

import torch
from pydantic import Field, NonNegativeFloat, PositiveInt
from torch import Tensor

from dllmflow.diffusion.masks.block_causal import block_causal_mask

from .base import Sampler, SamplerConfig, native_generate
from .loop import block_geometry, first_eos_done, get_num_transfer_tokens, gumbel_argmax


class LLaDA2Config(SamplerConfig):
    """Preset (spec §3.3): blocks of 32, 32 steps EACH, greedy, threshold 0.5, editing off."""

    steps: PositiveInt = Field(32, description="Step budget of each block (not a total).")
    block_size: PositiveInt | None = 32
    temperature: NonNegativeFloat = 0.0
    threshold: float | None = Field(0.5, gt=0.0, le=1.0)
    eos_token_id: int | Literal["tokenizer"] | None = Field(None, description="None = the tokenizer's EOS.")
    # LLaDA2.1 editing: a committed token of the current block is replaced when the model's confidence
    # in a different token exceeds this; 0 = off.
    editing_threshold: float = Field(0.0, ge=0.0, le=1.0)
    max_post_steps: int = Field(16, ge=0, description="Editing-only forwards after a block is full.")


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


class LLaDA2Sampler(Sampler):
    name = "llada2"
    config_cls = LLaDA2Config
    supports_infill = False
    supports_kv_cache = False
    supports_batching = False  # LLaDA2's generate takes one prompt; the base class loops

    def model_forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """attention_mask: the 4D block-causal float mask."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _eos_id(self) -> int | None:
        if self.config.eos_token_id is not None:
            return self.config.eos_token_id
        return getattr(self.tokenizer, "eos_token_id", None)

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
        native = native_generate(self.model, "gen_length", "block_length") if self.model is not None else None
        if native is not None:
            return self._generate_native(native, prompt_ids[0])
        (prompt,) = prompt_ids
        cfg, gen = self.config, self.generator()
        geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, use_kv_cache=False)
        S, G, bs, spb = len(prompt), geometry.gen_length, geometry.block_size, cfg.steps
        x = torch.full((1, S + G), self.mask_id, dtype=torch.long, device=self.device)  # [1, T]
        x[0, :S] = torch.tensor(prompt, dtype=torch.long, device=self.device)
        valid = torch.ones_like(x)
        dtype = self._mask_dtype()
        eos, start = self._eos_id(), torch.tensor([S], device=self.device)
        nfe, done = 0, False
        for j in range(geometry.num_blocks):
            lo, hi = S + j * bs, min(S + (j + 1) * bs, S + G)
            mask = block_causal_mask(valid[:, :hi], S, bs, causal_prefix=False, dtype=dtype)  # [1, 1, hi, hi]
            block = x[:, lo:hi]  # [1, b] a view: writes land in x
            schedule = get_num_transfer_tokens(block == self.mask_id, spb)  # [1, spb]
            post_steps = 0
            for i in range(spb + cfg.max_post_steps):
                masked = block == self.mask_id  # [1, b]
                if not masked.any():
                    if cfg.editing_threshold <= 0 or post_steps >= cfg.max_post_steps:
                        break
                    post_steps += 1
                logits = self._forward(x[:, :hi], mask)[:, lo:hi].float()  # [1, b, V]
                logits[..., self.mask_id] = -math.inf
                nfe += 1
                x0 = gumbel_argmax(logits, cfg.temperature, generator=gen)  # [1, b]
                conf = torch.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # [1, b]
                if masked.any():
                    last = i >= spb - 1  # the step budget is spent: commit the rest
                    k = masked.sum(dim=1) if last else schedule[:, i]
                    transfer = refine_transfer(conf, masked, k, None if last else cfg.threshold)
                else:
                    transfer = torch.zeros_like(masked)
                edits = edit_index(x0, conf, block, ~masked, cfg.editing_threshold)
                block[transfer | edits] = x0[transfer | edits].to(x.dtype)
                if not masked.any() and not edits.any():
                    break  # post-steps: nothing left to edit
                if eos is not None and bool(first_eos_done(x, start, G, eos, self.mask_id)[0]):
                    done = True
                    break
            if done:
                break
        x[x == self.mask_id] = self.fill_id  # after an early EOS stop
        return [x[0, S:].tolist()], nfe, [nfe]

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
