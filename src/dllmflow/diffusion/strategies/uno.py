"""`uno`: a drafting adapter on a frozen causal LM (docs/strategies.md §2.9; NeMo AutoModel's `uno`,
I-DLM's gated LoRA). The causal LM (the base, or the run's AR-control export) stays exactly as it is; a
LoRA adapter gated to [MASK] positions (`models/drafting_adapter.py`) learns to guess the tokens after a
clean prefix from m = block_size - 1 [MASK] slots, which is what `selfspec` feeds it:

    1) anchors   k_1..k_A per row, uniform among positions where x[k] and x[k+1] are supervised (seeded
                 per sample: `corruption.draw_draft_anchors`)
    2) clean     the row x [B, L] through the causal LM, no gradients, adapters off (no [MASK] in it):
                 its KV cache, the keys every decoding forward sees
    3) slots     A*m [MASK]s appended against that cache; slot (a, t) at position k_a + t sees x[<k_a] and
                 the slots before it in its group (`masks/drafting.py`); its logit guesses x[k_a + t + 1]
    draft = Σ CE(logit(a, t), x[k_a + t + 1]) · 1[x[k_a + t + 1] supervised]   -> / N_draft (global)

Nothing else is trained: a clean position's logits are the causal LM's (the gate adds exact zeros there),
so no next-token term exists to keep. The backward runs through the A*m slots alone, so a step costs a
no-grad forward over L plus a small forward/backward: less than the AR control's step over L. Draft
accuracy per offset (`draft_acc_k{k}`: slot k-1 right) is logged as DFlash's is.

Run: `dllmflow train --params params/tiny_uno.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import draw_draft_anchors, per_sample
from dllmflow.diffusion.dflash_loss import accuracy_sums, draft_accuracy
from dllmflow.diffusion.losses import per_token_ce
from dllmflow.diffusion.masks.drafting import drafting_slots_mask
from dllmflow.errors import UserError
from dllmflow.models.attention import NATIVELY_BIDIRECTIONAL, mask_dtype
from dllmflow.models.drafting_adapter import apply_drafting_gate
from dllmflow.models.lora import has_lora
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy


class UnoStrategy(Strategy):
    name = "uno"
    merge_adapters = False  # the export is the causal LM + its adapter, never one merged model

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        inner = unwrap(model)
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        if model_type in NATIVELY_BIDIRECTIONAL:
            raise UserError(
                f"dllm.mode=uno drafts for a causal LM; the {model_type} model is not one: set "
                "model.pretrained_model_name_or_path to an AR model"
            )
        if not has_lora(inner):
            raise UserError("dllm.mode=uno trains a LoRA drafting adapter: add a peft: section")
        apply_drafting_gate(inner, int(self.mask_token_id))

    @property
    def slots(self) -> int:
        return self.cfg.block_size - 1

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        (anchors,) = per_sample(
            draw_draft_anchors,
            seeds,
            batch["input_ids"],
            batch["loss_mask"],
            draw_length=self.settings.dataset.seq_length,  # the draw does not depend on the padding
            anchors=self.cfg.anchors,
        )
        return {"anchors": anchors}

    def targets(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """(target ids [B, A*m], supervised [B, A*m] bool): slot (a, t) guesses x[k_a + t + 1]."""
        x, sup = batch["input_ids"], batch["loss_mask"] != 0  # [B, L]
        L = x.shape[1]
        k = batch["anchors"].repeat_interleave(self.slots, dim=1)  # [B, A*m]
        t = torch.arange(self.slots, device=x.device).repeat(batch["anchors"].shape[1])  # [A*m]
        at = k + t[None] + 1  # [B, A*m]
        inside = (k >= 0) & (at < L)
        at = at.clamp(0, L - 1)
        return x.gather(1, at), inside & sup.gather(1, at)

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"draft": self.targets(batch)[1].sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        from transformers import DynamicCache

        x = batch["input_ids"]  # [B, L]
        B, L = x.shape
        valid = batch.get("attention_mask", torch.ones_like(x)).bool()  # [B, L]
        anchors, m = batch["anchors"], self.slots  # [B, A]
        # 2) the clean row: the causal LM's own keys, computed once without gradients
        cache = DynamicCache(config=unwrap(model).config)
        with torch.no_grad():
            model(input_ids=x, attention_mask=valid.long(), cache=cache, use_cache=True, logits_to_keep=1)
        # 3) the slots against it
        Q = anchors.shape[1] * m
        ids = torch.full((B, Q), int(self.mask_token_id), dtype=x.dtype, device=x.device)  # [B, A*m]
        t = torch.arange(m, device=x.device).repeat(anchors.shape[1])  # [A*m]
        pos = (anchors.repeat_interleave(m, dim=1).clamp_min(0) + t[None]).clamp_max(L - 1)  # [B, A*m]
        mask = drafting_slots_mask(valid, anchors, m, mask_dtype(model, x.device))  # [B, 1, Q, L + Q]
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
        ).logits  # [B, Q, V]
        target, sup = self.targets(batch)  # [B, Q]
        ce = per_token_ce(logits[sup], target[sup])  # [n]
        correct = torch.zeros_like(sup)
        correct[sup] = logits[sup].detach().argmax(-1) == target[sup]
        return LossOutput(
            sums={"draft": ce.sum()},
            dllm_terms=("draft",),
            metric_sums=accuracy_sums(correct, sup, self.cfg.block_size),
        )

    def finalize_metrics(self, metric_sums: dict[str, float]) -> dict[str, float]:
        return draft_accuracy(metric_sums)

    def export(self, model: nn.Module, state_dict: dict[str, Tensor], tokenizer: Any, out_dir) -> None:
        """The causal LM as it is (HF layout, its weights untouched) + the card; `drafter.json` records
        the weights' digest (the adapter itself is written beside it by `export_with_lora`)."""
        from dllmflow.models.drafting_adapter import write_drafter_info

        super().export(model, state_dict, tokenizer, out_dir)
        write_drafter_info(
            out_dir,
            self.settings.model.pretrained_model_name_or_path,
            self.cfg.block_size,
            int(self.mask_token_id),
        )
