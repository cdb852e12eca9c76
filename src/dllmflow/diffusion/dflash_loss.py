"""DFlash draft loss as plain functions (docs/strategies.md §2.5): decay-weighted CE (paper Eq. 4), draft accuracy.

The CE is a SUM over the micro-batch (the trainer divides by the global number of predicted tokens);
accuracy is summed per offset k = 1..bs-1 and turned into rates from the global sums.

    w = decay_weights(bs, resolve_gamma(gamma, bs))                                 # [bs-1]
    loss_sum, correct = decay_ce_dense(hidden, head, targets, mask, weights)         # or decay_ce_fused
    metric_sums = accuracy_sums(correct, mask, bs); draft_accuracy(global_metric_sums)

Draft accuracy is logged for every N (docs/strategies.md §7 caveat 7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def resolve_gamma(gamma: float, block_size: int) -> float:
    """Paper defaults when gamma <= 0: 7/5/4 for bs 16/10/8, else max(2, bs/2)."""
    if gamma > 0:
        return float(gamma)
    return PAPER_GAMMA.get(block_size, max(2.0, block_size / 2))


def decay_weights(block_size: int, gamma: float | None) -> Tensor:
    """w_k = exp(-(k-1)/gamma) for offsets k = 1..bs-1 (all ones when gamma is None). [bs-1]"""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.ones_like(k) if gamma is None else torch.exp(-(k - 1) / gamma)


def decay_ce_dense(
    hidden: Tensor, head: nn.Module, targets: Tensor, mask: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Σ w·mask·CE over all positions, and `correct` = (argmax == target)·mask. hidden [B, P, d],
    targets/mask/weights [B, P] (weights broadcastable). Returns (loss_sum, correct [B, P] float)."""
    logits = head(hidden.to(_head_dtype(head))).float()  # [B, P, V]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, P]
    correct = (logits.argmax(-1) == targets).float() * mask
    return (weights * mask * ce).sum(), correct


def _chunk_ce(h: Tensor, weight: Tensor, bias: Tensor | None, t: Tensor) -> tuple[Tensor, Tensor]:
    logits = F.linear(h.to(weight.dtype), weight, bias)  # [c, V]
    # at least fp32; float64 stays (this runs again in backward, outside the trainer's float64 context)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, t, reduction="none"), logits.argmax(-1)


def decay_ce_fused(
    hidden: Tensor, head: nn.Module, targets: Tensor, mask: Tensor, weights: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Same result as `decay_ce_dense`, never holding more than `chunk_size` rows of logits: only
    supervised positions are scored, chunk by chunk under activation checkpointing (the [c, V]
    logits are recomputed in backward instead of stored)."""
    bsz, p, d = hidden.shape
    w_full = torch.broadcast_to(weights, mask.shape).reshape(-1)
    sel = mask.reshape(-1).nonzero().squeeze(1)  # [M]
    h, t = hidden.reshape(-1, d)[sel], targets.reshape(-1)[sel]  # [M, d], [M]
    wm = (w_full * mask.reshape(-1))[sel]  # [M]
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    hit = torch.zeros(sel.shape[0], device=hidden.device)
    for s in range(0, sel.shape[0], chunk_size):
        ce, pred = checkpoint(
            _chunk_ce,
            h[s : s + chunk_size],
            head.weight,
            head.bias,
            t[s : s + chunk_size],
            use_reentrant=False,
        )
        loss_sum = loss_sum + (wm[s : s + chunk_size] * ce).sum()
        hit[s : s + chunk_size] = (pred == t[s : s + chunk_size]).float()
    correct = torch.zeros(bsz * p, device=hidden.device).index_put((sel,), hit * mask.reshape(-1)[sel])
    return loss_sum, correct.view(bsz, p)


def _head_dtype(head: nn.Module) -> torch.dtype:
    return head.weight.dtype


def accuracy_sums(correct: Tensor, mask: Tensor, block_size: int) -> dict[str, Tensor]:
    """Per-offset `draft_correct_k{k}` / `draft_count_k{k}` (k = 1..bs-1), summed over batch and blocks."""
    c = correct.detach().reshape(correct.shape[0], -1, block_size - 1).sum((0, 1))  # [bs-1]
    n = mask.detach().reshape(mask.shape[0], -1, block_size - 1).sum((0, 1))  # [bs-1]
    out = {}
    for k in range(1, block_size):
        out[f"draft_correct_k{k}"] = c[k - 1].float()
        out[f"draft_count_k{k}"] = n[k - 1].float()
    return out


def draft_accuracy(metric_sums: dict[str, float]) -> dict[str, float]:
    """From GLOBAL sums: draft_acc = Σcorrect/Σcount, draft_acc_k{k} = correct_k / max(count_k, 1)."""
    ks = sorted(int(key[len("draft_count_k") :]) for key in metric_sums if key.startswith("draft_count_k"))
    if not ks:
        return {}
    correct = {k: float(metric_sums.get(f"draft_correct_k{k}", 0.0)) for k in ks}
    count = {k: float(metric_sums[f"draft_count_k{k}"]) for k in ks}
    out = {"draft_acc": sum(correct.values()) / max(sum(count.values()), 1.0)}
    out.update({f"draft_acc_k{k}": correct[k] / max(count[k], 1.0) for k in ks})
    return out


__all__ = [
    "PAPER_GAMMA",
    "accuracy_sums",
    "decay_ce_dense",
    "decay_ce_fused",
    "decay_weights",
    "draft_accuracy",
    "resolve_gamma",
]
