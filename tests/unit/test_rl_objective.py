"""GRPO objective (docs/strategies.md §8.2) against per-token loops written out by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from dllmflow.errors import UserError
from dllmflow.rl.objective import group_advantages, grpo_loss


def test_group_advantages_match_the_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 3.0])
    got = group_advantages(rewards, group_size=3)
    want = []
    for g in range(3):
        grp = rewards[3 * g : 3 * g + 3].tolist()
        mean, std = sum(grp) / 3, statistics.pstdev(grp)
        want += [(r - mean) / (std + 1e-4) for r in grp]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)
    centred = group_advantages(rewards, group_size=3, scale="none")
    torch.testing.assert_close(centred, torch.tensor([r - sum(rewards[3 * (i // 3) : 3 * (i // 3) + 3].tolist()) / 3
                                                      for i, r in enumerate(rewards.tolist())]))  # fmt: skip


def test_an_all_equal_group_gets_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.0])
    got = group_advantages(rewards, group_size=4)
    assert torch.equal(got[:4], torch.zeros(4)) and not torch.isnan(got).any()
    assert (got[4:] != 0).all()
    assert torch.equal(group_advantages(torch.tensor([2.0, 5.0]), group_size=1), torch.zeros(2))
    with pytest.raises(UserError, match="rl.advantage_scale"):
        group_advantages(rewards, 4, scale="rank")


def _problem():
    g = torch.Generator().manual_seed(0)
    B, C = 4, 5
    old = -torch.rand(B, C, generator=g) * 3
    logp = old + torch.randn(B, C, generator=g) * 0.4  # ratios on both sides of [0.8, 1.2]
    ref = old + torch.randn(B, C, generator=g) * 0.3
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0])
    mask = torch.ones(B, C)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    return logp, old, ref, adv, mask


def test_grpo_loss_matches_a_per_token_loop():
    logp, old, ref, adv, mask = _problem()
    eps, beta = 0.2, 0.05
    out = grpo_loss(logp, old, ref, adv, mask, clip_eps=eps, kl_beta=beta)
    total = kl = ratios = 0.0
    clipped = n = 0
    for b in range(4):
        a = adv[b].item()
        for i in range(5):
            if not mask[b, i]:
                continue
            r = math.exp(logp[b, i].item() - old[b, i].item())
            rc = min(max(r, 1 - eps), 1 + eps)
            d = ref[b, i].item() - logp[b, i].item()
            k3 = math.exp(d) - d - 1
            total += -min(r * a, rc * a) + beta * k3
            kl += k3
            ratios += r
            n += 1
            clipped += rc * a < r * a
    assert clipped > 0 and out.clipped_tokens.item() == clipped
    assert out.num_tokens.item() == n == 14
    assert math.isclose(out.loss_sum.item(), total, rel_tol=1e-5)
    assert math.isclose(out.kl_sum.item(), kl, rel_tol=1e-5)
    assert math.isclose(out.ratio_mean.item(), ratios / n, rel_tol=1e-5)
    # both sides clip: an upper clip with A > 0 and a lower clip with A < 0 happen in this problem
    r = torch.exp(logp - old)
    assert ((r > 1 + eps) & (adv[:, None] > 0) & (mask > 0)).any()
    assert ((r < 1 - eps) & (adv[:, None] < 0) & (mask > 0)).any()


def test_gradient_at_the_old_policy_is_minus_advantage_plus_kl():
    _, old, ref, adv, mask = _problem()
    beta = 0.1
    logp = old.clone().requires_grad_(True)
    grpo_loss(logp, old, ref, adv, mask, clip_eps=0.2, kl_beta=beta).loss_sum.backward()
    # d/dlogp [-r A] = -A at r = 1; d/dlogp k3 = 1 - exp(ref - logp)
    want = (-adv[:, None] + beta * (1 - torch.exp(ref - old))) * mask
    torch.testing.assert_close(logp.grad, want, rtol=1e-5, atol=1e-6)


def test_kl_log_ratio_clip_extends_k3_by_its_tangent():
    # d = ref - logp on both sides of c = 2, one far past it (exp(50) would dominate any gradient)
    d = torch.tensor([[-3.0, 0.5, 1.9, 2.5, 50.0]])
    logp = torch.full_like(d, -1.0).requires_grad_(True)
    ref, old, adv, mask, c, beta = (
        logp.detach() + d,
        logp.detach(),
        torch.zeros(1),
        torch.ones_like(d),
        2.0,
        0.5,
    )
    out = grpo_loss(logp, old, ref, adv, mask, clip_eps=0.2, kl_beta=beta, kl_log_ratio_clip=c)
    out.loss_sum.backward()
    k3 = [math.exp(x) - x - 1 if x <= c else math.exp(c) * (1 + x - c) - x - 1 for x in d[0].tolist()]
    # d k3 / d logp = -(d k3 / d d): 1 - exp(d) below c, 1 - exp(c) above (bounded)
    grad = [beta * (1 - math.exp(min(x, c))) for x in d[0].tolist()]
    assert math.isclose(out.kl_sum.item(), sum(k3), rel_tol=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([grad]), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().max() < beta * math.exp(c)
    # unclipped, the same tokens give exp(50)-sized terms
    assert grpo_loss(logp, old, ref, adv, mask, 0.2, beta).kl_sum.item() > 1e20
