"""`hybrid`: Nemotron-Labs-Diffusion, a diffusion loss plus an AR loss on one model (docs/strategies.md §2.3).

Corruption masks supervised positions only: uniformly (one level per sequence) when `dllm.block_size`
is unset, else blockwise (exactly k = round(m len) per block, biased to later positions). The model
receives the CLEAN ids and `masked_indices` and returns `logits` (diffusion) and `causal_logits` (AR);
any HF causal LM gets that interface from `dllmflow.models.hybrid_adapter`. Two loss terms:

    diffusion = sum_i CE(logits_i, x_i) / p_i  over noise & supervised   -> / N_noise, weight ar_loss_alpha
    ar        = sum_{i>=1} CE(causal_{i-1}, x_i) m_sup_i                  -> / N_sup (all supervised tokens)

`ar_loss_alpha` weights the DIFFUSION term, and the AR denominator counts every supervised token while
its numerator skips position 0: both as in the reference (docs/strategies.md §7 caveat 5). `dllm_loss` logs
alpha * diffusion. Run: `dllmflow train --params params/tiny_hybrid.yaml`.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_blockwise, corrupt_uniform, per_sample
from dllmflow.diffusion.losses import mdlm_loss_sum, per_token_ce
from dllmflow.errors import UserError
from dllmflow.models.hybrid_adapter import HybridAdapter, accepts_masked_indices
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy


class HybridStrategy(Strategy):
    name = "hybrid"

    def setup(self, model: nn.Module, tokenizer, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        inner = unwrap(model)
        if not (isinstance(inner, HybridAdapter) or accepts_masked_indices(inner)):
            raise UserError(
                f"dllm.mode=hybrid: {type(inner).__name__} does not accept `masked_indices`; build it with "
                "the mode's builder, dllmflow.models.hybrid_adapter.build_hybrid_model"
            )

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        x, m = batch["input_ids"], batch["loss_mask"]
        if self.cfg.block_size is None:
            z, noise, p = per_sample(
                corrupt_uniform,
                seeds,
                x,
                m,
                mask_token_id=self.mask_token_id,
                eps=self.cfg.eps,
                draw_length=self.settings.dataset.seq_length,
            )
        else:
            z, noise, p = per_sample(
                corrupt_blockwise,
                seeds,
                x,
                m,
                draw_length=self.settings.dataset.seq_length,
                mask_token_id=self.mask_token_id,
                block_size=self.cfg.block_size,
                eps=self.cfg.eps,
                half_life_ratio=self.cfg.half_life_ratio,
            )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p}

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        sup = batch["loss_mask"] != 0
        return {"diffusion": (batch["noise_mask"] & sup).sum(), "ar": sup.sum()}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        x = batch["input_ids"]  # [B, L] clean: the model masks internally
        out = model(**self._model_inputs(model, batch))
        logits, causal = split_hybrid_logits(out.logits, getattr(out, "causal_logits", None), x.shape[1])
        if causal is None:
            raise UserError(
                f"dllm.mode=hybrid: {type(unwrap(model)).__name__} returned no causal_logits (and no concatenated "
                "[B, L+L_ar, V] logits); load Nemotron-Labs-Diffusion with dlm_paradigm: block_diff, or use a plain "
                "causal LM so build_hybrid_model can wrap it in the hybrid adapter"
            )
        diffusion, ar = hybrid_loss_sums(
            logits, causal, x, batch["noise_mask"], batch["p_mask"], batch["loss_mask"]
        )
        return LossOutput(
            sums={"diffusion": diffusion, "ar": ar},
            weights={"diffusion": self.cfg.ar_loss_alpha, "ar": 1.0},
            dllm_terms=("diffusion",),
        )

    def _model_inputs(self, model: nn.Module, batch: Batch) -> dict:
        if isinstance(unwrap(model), HybridAdapter):
            # Our adapter blocks padded keys in the bidirectional branch.
            return {
                "input_ids": batch["input_ids"],
                "masked_indices": batch["noise_mask"],
                "attention_mask": batch.get("attention_mask"),
            }
        # The native remote-code model, fed as the reference does (no attention_mask, no cache), minus the
        # keys its forward does not take.
        kwargs = {
            "input_ids": batch["input_ids"],
            "masked_indices": batch["noise_mask"],
            "labels": batch["input_ids"],
            "skip_loss": True,
        }
        params = inspect.signature(unwrap(model).forward).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return kwargs
        return {k: v for k, v in kwargs.items() if k in params}


def split_hybrid_logits(
    logits: Tensor, causal_logits: Tensor | None, seq_len: int
) -> tuple[Tensor, Tensor | None]:
    """(diffusion [B, L, V], causal [B, L_ar, V] or None); a legacy [B, L+L_ar, V] output splits at L."""
    if causal_logits is None and logits.shape[1] > seq_len:
        return logits[:, :seq_len], logits[:, seq_len:]
    return logits, causal_logits


def hybrid_loss_sums(
    logits: Tensor,  # [B, L, V] diffusion logits
    causal_logits: Tensor,  # [B, L_ar >= L-1, V] AR logits; position i-1 predicts x_i
    input_ids: Tensor,  # [B, L] clean targets
    noise_mask: Tensor,  # [B, L] bool
    p_mask: Tensor,  # [B, L] masking probability
    loss_mask: Tensor,  # [B, L]
) -> tuple[Tensor, Tensor]:
    """Summed (unnormalised) diffusion and AR losses of docs/strategies.md §2.3."""
    L = input_ids.shape[1]
    # 1) diffusion: the MDLM sum, 1/p importance weight on corrupted supervised positions
    diffusion = mdlm_loss_sum(logits, input_ids, noise_mask, loss_mask, p_mask)
    # 2) AR: shifted causal logits, numerator over supervised i >= 1
    sup_next = (loss_mask[:, 1:] != 0).float()  # [B, L-1]
    ar = (per_token_ce(causal_logits[:, : L - 1], input_ids[:, 1:]) * sup_next).sum()
    return diffusion, ar
