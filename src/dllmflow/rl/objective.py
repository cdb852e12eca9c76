"""The GRPO objective (docs/strategies.md §8.2): group-normalised advantages and the clipped policy-ratio
loss with a k3 KL penalty to the frozen reference, per completion token.

    adv = group_advantages(rewards, group_size=G)                          # [N*G], rows grouped by prompt
    out = grpo_loss(logp, old_logp, ref_logp, adv, mask, clip_eps=0.2, kl_beta=0.04)
    (out.loss_sum / global_token_count).backward()                         # the trainer normalises (§1.2)

Like every loss here it returns a SUM over tokens and their count; the trainer divides by the count
summed over ranks and micro-batches, so the loss does not depend on how the batch was split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dllmflow.errors import UserError

ADVANTAGE_SCALES = ("std", "none")


def group_advantages(rewards: Tensor, group_size: int, scale: str = "std", eps: float = 1e-4) -> Tensor:
    """A_i = r_i - mean(group), divided by (std(group) + eps) when `scale == "std"` (rows i*G..i*G+G-1 are
    one prompt's rollouts). A group whose rewards are all equal has A = 0 exactly, never NaN."""
    if scale not in ADVANTAGE_SCALES:
        raise UserError(
            f"rl.advantage_scale: unknown {scale!r}; choose one of: {', '.join(ADVANTAGE_SCALES)}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: {rewards.numel()} rewards do not split into groups of {group_size}"
        )
    r = rewards.double().view(-1, group_size)  # [N, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [N, G]
    # an all-equal group: the mean of equal values can differ from them by rounding; force exact zeros
    centred = torch.where((r == r[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(r), centred)
    if scale == "std":
        std = r.std(dim=1, unbiased=False, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    return centred.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@dataclass
class GRPOLoss:
    loss_sum: Tensor  # scalar, differentiable: Σ over scored tokens of (surrogate + kl_beta · k3)
    num_tokens: Tensor  # scalar long: scored tokens (mask != 0)
    kl_sum: Tensor  # scalar, detached: Σ k3 over scored tokens
    clipped_tokens: Tensor  # scalar long, detached: tokens where the clipped branch was the minimum
    ratio_mean: Tensor  # scalar, detached: mean policy ratio over scored tokens


def grpo_loss(
    logp: Tensor,  # [B, C] under the policy being trained (differentiable)
    old_logp: Tensor,  # [B, C] under the policy that sampled the rollouts (same draws)
    ref_logp: Tensor,  # [B, C] under the frozen reference (same draws)
    advantages: Tensor,  # [B]
    mask: Tensor,  # [B, C] 1 = a completion token
    clip_eps: float,
    kl_beta: float,
    kl_log_ratio_clip: float | None = None,
) -> GRPOLoss:
    """Per token: r = exp(logp - old), surrogate = -min(r A, clip(r, 1-ε, 1+ε) A),
    k3 = exp(d) - d - 1 with d = ref - logp (≥ 0, unbiased for KL(π_θ || π_ref)); loss = surrogate + β k3.
    `kl_log_ratio_clip` c: above d = c, exp(d) is replaced by its tangent exp(c)(1 + d - c), so k3 and its
    gradient stay finite and continuous (|∂k3/∂d| ≤ exp(c) - 1) when the policy drops a token the
    reference likes (docs/strategies.md §8.2); None = the unbounded k3."""
    m = mask.to(logp.dtype)  # [B, C]
    a = advantages.to(logp.dtype)[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp.detach())  # [B, C]
    unclipped = ratio * a
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * a
    surrogate = -torch.minimum(unclipped, clipped)  # [B, C]
    delta = ref_logp.detach() - logp  # [B, C]
    if kl_log_ratio_clip is None:
        e = torch.exp(delta)  # [B, C]
    else:
        c = float(kl_log_ratio_clip)
        # exp of the clamped value first: no inf (and no inf * 0 = NaN gradient) from the unused branch
        e = torch.where(delta > c, math.exp(c) * (1.0 + delta - c), torch.exp(delta.clamp(max=c)))  # [B, C]
    k3 = e - delta - 1.0  # [B, C]
    per_token = surrogate + kl_beta * k3 if kl_beta else surrogate
    n = (mask != 0).sum()
    return GRPOLoss(
        loss_sum=(per_token * m).sum(),
        num_tokens=n,
        kl_sum=(k3 * m).sum().detach(),
        clipped_tokens=((clipped < unclipped) & (mask != 0)).sum().detach(),
        ratio_mean=((ratio * m).sum() / n.clamp_min(1)).detach(),
    )
