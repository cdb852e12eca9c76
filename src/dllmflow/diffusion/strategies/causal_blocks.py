"""`causal_blocks`: a causal LM that also guesses ahead from [MASK] slots (docs/strategies.md §2.10).

The model stays a causal LM everywhere. Per row one block of `block_size` after the prompt is drawn as in
`block_causal` (`draw_blocks`, always the suffix pattern): a clean prefix of the block, then m masks at
positions k..k+m-1. The masks are not written over the row: they are appended after the clean row at
their own positions, and one causal forward over L + m positions (`masks/block_causal.py`
`lookahead_mask`: a slot sees the clean tokens before k and the slots before it) gives

    ar        = Σ_{i >= 1} CE(logit_{i-1}, x_i) · sup_i · valid_i        -> / N_ar (the `ar` mode's loss)
    lookahead = Σ_{t=1}^{m-1} CE(logit of slot t-1, x_{k+t})             -> / Σ_rows (m-1), x lookahead_weight

(t = 0 is read off the clean position k-1: already an `ar` target). Every logit is read one position
early (the causal LM's alignment), so `dllm_loss` is the weighted lookahead and `lookahead` (logged) its
unweighted mean. The export's config.json carries `dllm_causal_blocks`: llada2 then decodes with a
causal mask throughout, and selfspec (§3.10) losslessly, the slots' guesses checked by the model's own
next-token choices in the next forward.

Run: `dllmflow train --params params/tiny_causal_blocks.yaml`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dllmflow.diffusion.losses import loss_columns, per_token_ce, shifted_supervision
from dllmflow.diffusion.masks.block_causal import lookahead_mask
from dllmflow.models.attention import mask_dtype, model_logits

from .base import Batch, LossOutput, Strategy
from .block_causal import draw_blocks, refuse_natively_bidirectional

# metric_sums keys: the unweighted lookahead CE and its count, summed over ranks and micro-batches.
_SUM, _COUNT = "lookahead_ce_sum", "lookahead_ce_count"


class CausalBlocksStrategy(Strategy):
    name = "causal_blocks"

    def setup(self, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().setup(model, tokenizer, device)
        refuse_natively_bidirectional(model, self.name)

    def corrupt(self, batch: Batch, seeds: list[int]) -> Batch:
        return draw_blocks(batch, seeds, self.cfg, mask_token_id=int(self.mask_token_id),
                           draw_length=self.settings.dataset.seq_length, suffix=True)  # fmt: skip

    def token_counts(self, batch: Batch) -> dict[str, Tensor]:
        lookahead = (batch["noise_mask"].sum(1) - 1).clamp_min(0).sum()  # each drawn mask but the first
        return {"ar": next_token_targets(batch).sum(), "lookahead": lookahead}

    def loss(self, model: nn.Module, batch: Batch) -> LossOutput:
        out = lookahead_loss(model, batch, int(self.mask_token_id))
        out.weights["lookahead"] = self.cfg.lookahead_weight
        out.metric_sums = {
            _SUM: out.sums["lookahead"].detach(),
            _COUNT: self.token_counts(batch)["lookahead"],
        }
        return out

    def finalize_metrics(self, metric_sums: dict[str, float]) -> dict[str, float]:
        return {"lookahead": metric_sums[_SUM] / max(metric_sums[_COUNT], 1.0)}


def next_token_targets(batch: Batch) -> Tensor:
    """[B, L] bool: the `ar` mode's targets (docs/strategies.md §2.7) at the target's own position."""
    return F.pad(shifted_supervision(batch["loss_mask"], batch.get("attention_mask")), (1, 0))


def lookahead_loss(model: nn.Module, batch: Batch, mask_token_id: int) -> LossOutput:
    """The clean row, then the row's drawn masks appended at their own positions k..k+m-1, one causal
    forward. The clean part gives the next-token loss on every supervised token (the `ar` mode's);
    appended slot t sees the clean tokens before k and the slots before it, as llada2 sees a block's
    masks, and slot t-1's logit predicts x[k+t] (t >= 1; t = 0 is the clean position k-1's, already an
    `ar` target). Terms `ar` and `lookahead`, `dllm_loss` the lookahead."""
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
            "lookahead": per_token_ce(logits[sel_ahead], targets[sel_ahead]).sum(),
        },
        dllm_terms=("lookahead",),
    )
