"""`mdlm`: LLaDA-style masked diffusion (docs/strategies.md §2.1).

Corruption: one level t ~ U[0,1) per sample, p = (1-eps) t + eps, each supervised position becomes
[MASK] with probability p. The model reads the noisy ids with bidirectional attention (unsupervised
padding keys blocked; a supervised tail is attended as the sampler attends it: `denoiser_keys`) and the
loss is

    diffusion = Σ_i CE(logits_i, x_i) · 1[noise_i ∧ sup_i] / p_i        -> / N_sup (global supervised count)

Only positions that are noised and supervised in some row of the micro-batch reach the LM head (HF
`logits_to_keep` with their indices): the rest add nothing to the loss, and at a real vocabulary the
head over every position is about a fifth of the step and [B, L, V] its largest tensor (SmolLM2 on
the arithmetic rows: 4-8 such columns of 64).

With `dllm.attention_annealing_steps: N` (DiffuLLaMA's attention-mask annealing, for a model converted
from a causal LM), step s < N attends causally plus a share s/N of each query's future keys, drawn per
sample from its own generator on ANNEALING_STREAM (so resume and world size redraw the same keys);
from step N on, bidirectionally as above.

Run: `dllmflow train --params params/tiny_mdlm.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.corruption import corrupt_batch, corrupt_uniform
from dllmflow.diffusion.losses import loss_columns, mdlm_loss_sum
from dllmflow.diffusion.seeding import restream
from dllmflow.errors import UserError
from dllmflow.models.doc_attention import check_key_filter, forward_bidirectional_batch

from .base import Batch, LossOutput, Strategy, denoiser_keys

ANNEALING_STREAM = 2**40  # per-sample stream of the annealed future keys (beside the +2^41..2^43 ones)


class MDLMStrategy(Strategy):
    name = "mdlm"

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        if self.cfg.attention_annealing_steps:
            check_key_filter(model, "dllm.attention_annealing_steps")

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        z, noise, p = corrupt_batch(
            corrupt_uniform,
            seeds,
            batch,  # packed or not (docs/strategies.md §1.8)
            draw_length=self.settings.dataset.seq_length,
            mask_token_id=require_mask_id(self),
            eps=self.cfg.eps,
        )
        side = {"noisy_input_ids": z, "noise_mask": noise, "p_mask": p}
        anneal = self.cfg.attention_annealing_steps
        if self.step is not None and self.step < anneal:  # a packed row draws as one row
            share = self.step / anneal
            side["future_keys"] = future_keys(seeds, z.shape[1], share).to(z.device)  # [B, L, L]
        return side

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        return {"diffusion": (batch["loss_mask"] != 0).sum()}  # supervised normalisation

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        cols = loss_columns(batch["noise_mask"].bool() & (batch["loss_mask"] != 0))  # [n]
        keys = annealed_keys(batch["future_keys"]) if "future_keys" in batch else None  # [B, L, L]
        z, attended = batch["noisy_input_ids"], {**batch, "attention_mask": denoiser_keys(batch)}
        logits = forward_bidirectional_batch(model, z, attended, cols, keys)  # [B, n, V]
        total = mdlm_loss_sum(
            logits, *(batch[k][:, cols] for k in ("input_ids", "noise_mask", "loss_mask", "p_mask"))
        )
        return LossOutput(sums={"diffusion": total})


def future_keys(seeds: list[int], length: int, share: float) -> Tensor:
    """[B, L, L] bool: which future keys (k > q) each query sees this step, each with probability
    `share`, drawn from sample b's own generator on ANNEALING_STREAM (the noise's stream untouched)."""
    rows = []
    for seed in seeds:
        gen = torch.Generator(device="cpu").manual_seed(restream(seed, ANNEALING_STREAM))
        rows.append(torch.rand(length, length, generator=gen) < share)  # [L, L]
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)  # k > q
    return torch.stack(rows) & upper  # [B, L, L]


def annealed_keys(future: Tensor) -> Tensor:
    """[B, L, L] bool: every past key and the query itself, plus the drawn `future` keys."""
    L = future.shape[-1]
    past = torch.ones(L, L, dtype=torch.bool, device=future.device).tril()  # k <= q
    return past | future


def require_mask_id(strategy: Strategy) -> int:
    """The resolved mask id, or a clear error when neither settings nor `setup` provided one."""
    if strategy.mask_token_id is None:
        raise UserError(
            f"dllm.mode={strategy.name}: no mask token id; set dllm.mask_token_id or call strategy.setup(model, "
            "tokenizer, device) with a tokenizer that has a mask token"
        )
    return int(strategy.mask_token_id)
