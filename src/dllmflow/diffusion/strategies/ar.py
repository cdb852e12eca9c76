"""`ar`: causal next-token SFT of the base model, the AR control of every dLLM mode (docs/strategies.md §2.7).

Nothing is corrupted: the model reads the clean ids causally (the right padding hidden by the
attention mask) and logit i predicts token i+1. The supervised targets are the prepared loss mask
(the assistant tokens) shifted by one:

    sup_i = m_sup[i+1] and valid[i+1]                       (i = 0..L-2)
    ar    = Σ_i CE(logits[:, i], x[i+1]) · sup_i            -> / N_ar,  N_ar = Σ_i sup_i (global)

i.e. Hugging Face's causal-LM loss with the unsupervised labels at -100, as a sum and a count so the
trainer's global normalisation holds (docs/strategies.md §1.3). Only positions whose next token is
supervised in some row reach the LM head (`logits_to_keep` with their indices).

Same Trainer, Checkpointer, LoRA/full, FSDP2, live tracking and export as the dLLM modes; its export
decodes with the `ar` sampler (greedy, KV cache). The flow trains one beside a dLLM run on the same
prepared rows with `eval.ar_control` (workflow/ar_control.py).

Run: `dllmflow train --params params/tiny_ar.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.losses import loss_columns, per_token_ce, shifted_supervision
from dllmflow.models.attention import model_logits

from .base import Batch, LossOutput, Strategy


class ARStrategy(Strategy):
    name = "ar"

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        """Nothing to resolve: no token is masked, so no mask id is needed."""

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        return {}

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"ar": shifted_supervision(batch["loss_mask"], batch.get("attention_mask")).sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        x = batch["input_ids"]  # [B, L]
        sup = shifted_supervision(batch["loss_mask"], batch.get("attention_mask"))  # [B, L-1]
        cols = loss_columns(sup)  # [n]: positions whose next token some row supervises
        inputs = {"input_ids": x, "use_cache": False}
        if batch.get("attention_mask") is not None:
            inputs["attention_mask"] = batch["attention_mask"]
        logits = model_logits(model, cols, **inputs)  # [B, n, V]
        ce = per_token_ce(logits, x[:, cols + 1])  # [B, n]
        return LossOutput(sums={"ar": (ce * sup[:, cols].float()).sum()}, dllm_terms=("ar",))
