"""`scdd`: self-correcting discrete diffusion (docs/strategies.md §2.2), a LLaDA backbone that can also rewrite
visible tokens it got wrong.

Corruption: t on the grid {1/T, ..., (T-1)/T}; each supervised token becomes [MASK] with the schedule's
absorbed mass, or a random other non-mask token with its uniform mass (`corrupt_scdd`); `p_mask`
carries t. The model reads the noisy ids with bidirectional attention (no time conditioning) and the
loss is the discrete-time NELBO `scdd_loss_sum` (absorbed term at [MASK] positions, correction term at
every supervised visible one), normalised by the global supervised count.

Run: `dllmflow train --params params/tiny_scdd.yaml`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_batch, corrupt_scdd
from dllmflow.diffusion.losses import scdd_loss_sum
from dllmflow.errors import UserError
from dllmflow.models.doc_attention import forward_bidirectional_batch
from dllmflow.models.limits import config_vocab_size
from dllmflow.models.wrappers import unwrap

from .base import Batch, LossOutput, Strategy, denoiser_keys
from .mdlm import require_mask_id


class SCDDConfigError(UserError, ValueError):
    """The model or tokenizer does not fit the `dllm:` scdd settings."""


class SCDDStrategy(Strategy):
    name = "scdd"

    def setup(self, model: nn.Module, tokenizer, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        vocab = config_vocab_size(unwrap(model))
        if vocab is not None and vocab != self.cfg.vocab_size:
            raise SCDDConfigError(
                f"dllm.vocab_size={self.cfg.vocab_size} does not match the model's vocabulary size {vocab}; "
                f"set dllm.vocab_size: {vocab}"
            )
        if not 0 <= int(self.mask_token_id) < self.cfg.vocab_size:
            raise SCDDConfigError(
                f"dllm.mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.cfg.vocab_size}) "
                "(dllm.vocab_size)"
            )

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        c = self.cfg
        z, noise, t = corrupt_batch(
            corrupt_scdd,
            seeds,
            batch,  # packed or not (docs/strategies.md §1.8)
            draw_length=self.settings.dataset.seq_length,
            mask_token_id=require_mask_id(self),
            vocab_size=c.vocab_size,
            num_timesteps=c.num_timesteps,
            uniform_ratio=c.uniform_ratio,
            schedule_shape=c.schedule_shape,
            schedule_peak=c.schedule_peak,
            eps=c.eps,
        )
        return {"noisy_input_ids": z, "noise_mask": noise, "p_mask": t}  # p_mask carries the time t

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": (batch["loss_mask"] != 0).sum()}  # all supervised tokens, corrupted or not

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        c = self.cfg
        z = batch["noisy_input_ids"]  # [B, L]
        attended = {**batch, "attention_mask": denoiser_keys(batch)}  # the supervised tail too
        logits = forward_bidirectional_batch(model, z, attended)  # [B, L, V]; packed or not
        total = scdd_loss_sum(
            logits,
            batch["input_ids"],
            z,
            batch["loss_mask"],
            batch["p_mask"],
            mask_token_id=require_mask_id(self),
            num_timesteps=c.num_timesteps,
            uniform_ratio=c.uniform_ratio,
            schedule_shape=c.schedule_shape,
            schedule_peak=c.schedule_peak,
            chunk_size=c.chunk_size,
        )
        return LossOutput(sums={"diffusion": total})
