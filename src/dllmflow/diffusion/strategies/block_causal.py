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

`dllm.block_attention: causal` (with the suffix pattern) keeps the model a causal LM everywhere: the
drawn block's masked suffix k..k+m-1 is appended after the clean row at its own positions, so one causal
forward over L + m positions gives the `ar` mode's next-token loss on every supervised token and a
lookahead loss on the masks (`lookahead_loss`; llada2 then decodes with a causal mask throughout).

Run: `dllmflow train --params params/tiny_block_causal.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dllmflow.diffusion.corruption import corrupt_one_block, per_sample
from dllmflow.diffusion.losses import loss_columns, mdlm_loss_sum, per_token_ce, shifted_supervision
from dllmflow.diffusion.masks.block_causal import block_causal_mask, lookahead_mask
from dllmflow.errors import UserError
from dllmflow.models.attention import NATIVELY_BIDIRECTIONAL, mask_dtype, model_logits
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy


class BlockCausalStrategy(Strategy):
    name = "block_causal"

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        model_type = getattr(getattr(unwrap(model), "config", None), "model_type", None)
        if model_type in NATIVELY_BIDIRECTIONAL:
            raise UserError(
                f"dllm.mode=block_causal: the {model_type} model attends through its own mask and takes no "
                "4D block-causal mask; pick a causal LM (Llama, Qwen3, SmolLM2, ...) or dllm.mode: mdlm"
            )

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        z, noise, p, block, prefix = per_sample(
            corrupt_one_block,
            seeds,
            batch["input_ids"],
            batch["loss_mask"],
            draw_length=self.settings.dataset.seq_length,  # the noise does not depend on the padding
            mask_token_id=int(self.mask_token_id),
            block_size=self.cfg.block_size,
            eps=self.cfg.eps,
            suffix=self.cfg.mask_pattern == "suffix",
        )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p, "block": block, "prefix_len": prefix}

    @property
    def causal_blocks(self) -> bool:
        return self.cfg.block_attention == "causal"

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        if self.causal_blocks:  # every next-token target, and each drawn mask but the first (§2.8)
            lookahead = (batch["noise_mask"].sum(1) - 1).clamp_min(0).sum()
            return {"ar": next_token_targets(batch).sum(), "diffusion": lookahead}
        return {"diffusion": (batch["block"] & (batch["loss_mask"] != 0)).sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        if self.causal_blocks:
            out = lookahead_loss(model, batch, int(self.mask_token_id))
            out.weights["diffusion"] = self.cfg.lookahead_weight
            return out
        cols = loss_columns(batch["noise_mask"] & (batch["loss_mask"] != 0))  # [n]
        cfg = self.cfg
        logits = block_causal_logits(
            model, batch, cols, cfg.block_size, cfg.causal_prompt, int(self.mask_token_id)
        )  # [B, n, V]
        total = mdlm_loss_sum(
            logits, *(batch[k][:, cols] for k in ("input_ids", "noise_mask", "loss_mask", "p_mask"))
        )
        return LossOutput(sums={"diffusion": total})


def next_token_targets(batch: Batch) -> Tensor:
    """[B, L] bool: the `ar` mode's targets (docs/strategies.md §2.7) at the target's own position."""
    return F.pad(shifted_supervision(batch["loss_mask"], batch.get("attention_mask")), (1, 0))


def lookahead_loss(model: nn.Module, batch: Batch, mask_token_id: int) -> LossOutput:
    """Causal blocks (docs/strategies.md §2.8): the clean row, then the row's drawn masks appended at
    their own positions k..k+m-1, one causal forward. The clean part gives the next-token loss on every
    supervised token (the `ar` mode's); appended slot t sees the clean tokens before k and the slots
    before it, as llada2 sees a block's masks, and slot t-1's logit predicts x[k+t] (t >= 1; t = 0 is
    the clean position k-1's, already an `ar` target)."""
    x, noise = batch["input_ids"], batch["noise_mask"]  # [B, L]
    B, L = x.shape
    dev = x.device
    m = noise.sum(1)  # [B] masks drawn per row (a suffix of one block)
    W = max(int(m.max()), 1)
    k = torch.where(m > 0, noise.float().argmax(1), 0)  # [B] the first masked position
    slot = torch.arange(W, device=dev)  # [W]
    slot_valid = slot[None] < m[:, None]  # [B, W]
    ids = torch.cat([x, torch.full((B, W), mask_token_id, dtype=x.dtype, device=dev)], 1)  # [B, L+W]
    positions = torch.cat([torch.arange(L, device=dev).expand(B, L), k[:, None] + slot[None]], 1)  # [B, L+W]
    valid = torch.cat([batch.get("attention_mask", torch.ones_like(x)).bool(), slot_valid], 1)  # [B, L+W]
    mask = lookahead_mask(valid, k, L, mask_dtype(model, dev))  # [B, 1, L+W, L+W]
    ar = next_token_targets(batch)  # [B, L]
    ahead = slot_valid & (slot[None] >= 1)  # [B, W]: slot t's target x[k + t], read off slot t-1
    cols = loss_columns(torch.cat([ar, ahead], 1))  # [n], canvas columns (the shift reads col - 1)
    logits = model_logits(
        model, cols, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
    )
    gather = (k[:, None] + slot[None]).clamp_max(L - 1)  # [B, W]
    targets = torch.cat([x, x.gather(1, gather)], 1)[:, cols]  # [B, n]
    sel_ar, sel_ahead = F.pad(ar, (0, W))[:, cols], F.pad(ahead, (L, 0))[:, cols]  # [B, n] each
    return LossOutput(
        sums={
            "ar": per_token_ce(logits[sel_ar], targets[sel_ar]).sum(),
            "diffusion": per_token_ce(logits[sel_ahead], targets[sel_ahead]).sum(),
        }
    )


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
