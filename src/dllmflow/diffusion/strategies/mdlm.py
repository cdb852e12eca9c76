"""`mdlm`: LLaDA-style masked diffusion (docs/strategies.md §2.1).

Corruption: one level t ~ U[0,1) per sample, p = (1-eps) t + eps, each supervised position becomes
[MASK] with probability p. The model reads the noisy ids with bidirectional attention (padding keys
blocked) and the loss is

    diffusion = Σ_i CE(logits_i, x_i) · 1[noise_i ∧ sup_i] / p_i        -> / N_sup (global supervised count)

Run: `dllmflow train --params params/tiny_mdlm.yaml`.
"""

from __future__ import annotations

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
        logits = forward_bidirectional_batch(model, batch["noisy_input_ids"], batch)  # [B, L, V]
        total = mdlm_loss_sum(
            logits, batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"]
        )
        return LossOutput(sums={"diffusion": total})


def require_mask_id(strategy: Strategy) -> int:
    """The resolved mask id, or a clear error when neither settings nor `setup` provided one."""
    if strategy.mask_token_id is None:
        raise UserError(
            f"dllm.mode={strategy.name}: no mask token id; set dllm.mask_token_id or call strategy.setup(model, "
            "tokenizer, device) with a tokenizer that has a mask token"
        )
    return int(strategy.mask_token_id)
