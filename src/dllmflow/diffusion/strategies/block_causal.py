"""`block_causal`: block-causal A2D, a causal LM trained to decode as `llada2` does (docs/strategies.md §2.8).

The sampler (`llada2`, exact KV cache) decodes blocks of `block_size` after the prompt: a block sees
the prompt, the committed blocks and itself (bidirectionally), never a later block. This mode trains
exactly that view (SDAR, Fast-dLLM v2), so a converted causal LM keeps its causal attention everywhere
but inside the block being denoised. Per row (`corrupt_one_block`): the prompt is everything before
the first supervised position S, blocks start at S, one block j is drawn uniformly among the response's
blocks and its supervised positions are masked with p = (1-eps) t + eps; earlier blocks stay clean.
One forward over the row under the block-causal mask of `dllmflow.diffusion.masks.block_causal`
(prompt causal with `dllm.causal_prompt`, each row its own S) gives

    diffusion = Σ_{i in block j} CE(logit_i, x_i) · 1[noise_i ∧ sup_i] / p     -> / N_block (global
                supervised count of the drawn blocks)

With `dllm.logit_shift` (a Dream-style A2D, the preset) logit_i is read from position i-1: a block's
first token from the last position before it, which cannot see the block (an AR prediction, as the
sampler makes it). Positions of block j past the row's content are attended as [MASK] keys, as the
sampler's canvas holds them before the EOS stop; positions after block j cannot reach block j's queries,
so the forward stops at the batch's last drawn block. A step costs one forward over L positions, as a
plain AR step (`bench/train_step.py`); one block per row is drawn instead of all of them at 2L.

Causal blocks, the model a causal LM everywhere with a lookahead loss, are their own mode:
`causal_blocks` (strategies/causal_blocks.py), which draws its blocks with `draw_blocks` here.

Run: `dllmflow train --params params/tiny_block_causal.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_one_block, per_sample
from dllmflow.diffusion.losses import loss_columns, mdlm_loss_sum
from dllmflow.diffusion.masks.block_causal import block_causal_mask
from dllmflow.errors import UserError
from dllmflow.models.attention import NATIVELY_BIDIRECTIONAL, mask_dtype, model_logits
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy


class BlockCausalStrategy(Strategy):
    name = "block_causal"

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        refuse_natively_bidirectional(model, self.name)

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        suffix = self.cfg.mask_pattern == "suffix"
        return draw_blocks(batch, seeds, self.cfg, mask_token_id=int(self.mask_token_id),
                           draw_length=self.settings.dataset.seq_length, suffix=suffix)  # fmt: skip

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": (batch["block"] & (batch["loss_mask"] != 0)).sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        cols = loss_columns(batch["noise_mask"] & (batch["loss_mask"] != 0))  # [n]
        cfg = self.cfg
        logits = block_causal_logits(
            model, batch, cols, cfg.block_size, cfg.causal_prompt, int(self.mask_token_id)
        )  # [B, n, V]
        total = mdlm_loss_sum(
            logits, *(batch[k][:, cols] for k in ("input_ids", "noise_mask", "loss_mask", "p_mask"))
        )
        return LossOutput(sums={"diffusion": total})


def refuse_natively_bidirectional(model: nn.Module, mode: str) -> None:
    """UserError for a model that takes no 4D mask (both block modes attend through one)."""
    model_type = getattr(getattr(unwrap(model), "config", None), "model_type", None)
    if model_type in NATIVELY_BIDIRECTIONAL:
        raise UserError(
            f"dllm.mode={mode}: the {model_type} model attends through its own mask and takes no 4D "
            "block-causal mask; pick a causal LM (Llama, Qwen3, SmolLM2, ...) or dllm.mode: mdlm"
        )


def draw_blocks(
    batch: Batch, seeds: list[int], cfg: Any, *, mask_token_id: int, draw_length: int, suffix: bool
) -> Batch:
    """One block per row (`corrupt_one_block` with `cfg.block_size` and `cfg.eps`), masked at random or
    as a suffix: the noisy ids, noise mask, p_mask, the block's positions and each row's prompt length.
    `draw_length` is the recipe's seq_length, so the noise does not depend on the padding."""
    z, noise, p, block, prefix = per_sample(
        corrupt_one_block,
        seeds,
        batch["input_ids"],
        batch["loss_mask"],
        draw_length=draw_length,
        mask_token_id=mask_token_id,
        block_size=cfg.block_size,
        eps=cfg.eps,
        suffix=suffix,
    )
    return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p, "block": block, "prefix_len": prefix}


def block_causal_logits(
    model: nn.Module, batch: Batch, cols: Tensor, block_size: int, causal_prompt: bool, mask_token_id: int
) -> Tensor:
    """Logits [B, n, V] at positions `cols` [n] of the corrupted batch (`noisy_input_ids`, `block`,
    `prefix_len`, `attention_mask`) under the block-causal mask, each row its own prompt length: what
    llada2 computes for those positions while it decodes the drawn block (the logit shift applied by
    `model_logits` for a shifted model)."""
    x, block = batch["input_ids"], batch["block"]  # [B, L]
    drawn = block.any(0).nonzero()
    # No query reads a key past its block; `cols` may hold a column past every block (loss_columns keeps
    # the last one when nothing was noised).
    end = max(int(drawn[-1]) + 1 if drawn.numel() else 0, int(cols.max()) + 1)
    valid = batch.get("attention_mask", torch.ones_like(x)).bool()
    z = torch.where(block & ~valid, mask_token_id, batch["noisy_input_ids"])[:, :end]  # [B, end]
    keys = (valid | block)[:, :end]  # the drawn block's tail is attended as [MASK]s
    mask = block_causal_mask(
        keys, batch["prefix_len"], block_size, causal_prompt, mask_dtype(model, x.device)
    )  # [B, 1, end, end]
    positions = torch.arange(end, device=x.device).expand(x.shape[0], end)  # right-padded rows
    return model_logits(
        model, cols, input_ids=z, attention_mask=mask, position_ids=positions, use_cache=False
    )
