"""`mdlm`: LLaDA-style masked diffusion (docs/strategies.md §2.1).

Corruption: one level t ~ U[0,1) per sample, p = (1-eps) t + eps, each supervised position becomes
[MASK] with probability p. The model reads the noisy ids with bidirectional attention (padding keys
blocked) and the loss is

    diffusion = Σ_i CE(logits_i, x_i) · 1[noise_i ∧ sup_i] / p_i        -> / N_sup (global supervised count)

Only positions that are noised and supervised in some row of the micro-batch reach the LM head (HF
`logits_to_keep` with their indices): the rest add nothing to the loss, and at a real vocabulary the
head over every position is about a fifth of the step and [B, L, V] its largest tensor (SmolLM2 on
the arithmetic rows: 4-8 such columns of 64).

Run: `dllmflow train --params params/tiny_mdlm.yaml`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_batch, corrupt_uniform
from dllmflow.diffusion.losses import mdlm_loss_sum
from dllmflow.errors import UserError
from dllmflow.models.doc_attention import forward_bidirectional_batch

from .base import Batch, LossOutput, Strategy


class MDLMStrategy(Strategy):
    name = "mdlm"

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        z, noise, p = corrupt_batch(
            corrupt_uniform,
            seeds,
            batch,  # packed or not (docs/strategies.md §1.8)
            draw_length=self.settings.dataset.seq_length,
            mask_token_id=require_mask_id(self),
            eps=self.cfg.eps,
        )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p}

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": (batch["loss_mask"] != 0).sum()}  # supervised normalisation

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        cols = loss_columns(batch["noise_mask"].bool() & (batch["loss_mask"] != 0))  # [n]
        logits = forward_bidirectional_batch(model, batch["noisy_input_ids"], batch, cols)  # [B, n, V]
        total = mdlm_loss_sum(
            logits, *(batch[k][:, cols] for k in ("input_ids", "noise_mask", "loss_mask", "p_mask"))
        )
        return LossOutput(sums={"diffusion": total})


def loss_columns(selected: Tensor) -> Tensor:
    """Positions [n] where any row of `selected` [B, L] is set, ascending. Never empty: a micro-batch
    with nothing selected keeps its last column (it contributes zero) so the graph still reaches
    every parameter."""
    cols = selected.any(0).nonzero().squeeze(1)  # [n]
    return cols if cols.numel() else torch.tensor([selected.shape[1] - 1], device=selected.device)


def require_mask_id(strategy: Strategy) -> int:
    """The resolved mask id, or a clear error when neither settings nor `setup` provided one."""
    if strategy.mask_token_id is None:
        raise UserError(
            f"dllm.mode={strategy.name}: no mask token id; set dllm.mask_token_id or call strategy.setup(model, "
            "tokenizer, device) with a tokenizer that has a mask token"
        )
    return int(strategy.mask_token_id)
