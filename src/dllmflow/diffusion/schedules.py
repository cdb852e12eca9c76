"""Noise schedules as plain functions of the diffusion time t in [0, 1].

SCDD (self-correcting discrete diffusion, docs/strategies.md §2.2) splits the marginal of a clean token x at time t
into three masses: still x (`clean`), a uniform non-mask token (`uniform`) and [MASK] (`absorbed`):

    a = g τ, b = g (1-τ), c(t) = (r/(1-r)) / (τ^a (1-τ)^b) · t^a (1-t)^b
    clean = (1-t)/(1+c),  uniform = c/(1+c),  absorbed = t/(1+c)
    γ = clean + uniform (not masked),  ρ = clean / γ (share of x among the visible mass)

so uniform(τ) = r exactly, r = 0 is plain absorbing masking, and γ never increases with t (so [MASK]
is absorbing). ρ = 1/(1 + c/(1-t)) never increases either when b = g(1-τ) <= 1 (the defaults and the
released settings); with b > 1 it rises again close to t = 1.

    from dllmflow.diffusion.schedules import scdd_schedule
    s = scdd_schedule(torch.tensor([0.25, 0.5]), uniform_ratio=0.1); s.uniform, s.rho
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TINY = 1e-30  # floor of every denominator / log argument in the SCDD math


@dataclass(frozen=True)
class SCDDSchedule:
    """Schedule values at a tensor of times (all the shape of `t`)."""

    clean: Tensor
    uniform: Tensor
    absorbed: Tensor
    gamma: Tensor
    rho: Tensor


def validate_scdd_params(uniform_ratio: float, schedule_shape: float, schedule_peak: float) -> None:
    """Raise ValueError naming the `dllm.*` field when a schedule parameter is out of range."""
    if not 0.0 <= uniform_ratio < 1.0:
        raise ValueError(f"dllm.uniform_ratio must satisfy 0 <= r < 1, got {uniform_ratio}")
    if not 0.0 < schedule_peak < 1.0:
        raise ValueError(f"dllm.schedule_peak must satisfy 0 < tau < 1, got {schedule_peak}")
    if not schedule_shape > 0.0:
        raise ValueError(f"dllm.schedule_shape must be > 0, got {schedule_shape}")


def scdd_schedule(
    t: Tensor | float, uniform_ratio: float, schedule_shape: float = 1.0, schedule_peak: float = 0.5
) -> SCDDSchedule:
    """Clean / uniform / absorbed masses, γ and ρ at time(s) `t` (clamped to [0, 1])."""
    validate_scdd_params(uniform_ratio, schedule_shape, schedule_peak)
    t = torch.as_tensor(t)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    t = t.clamp(0.0, 1.0)
    r, g, tau = float(uniform_ratio), float(schedule_shape), float(schedule_peak)
    a, b = g * tau, g * (1.0 - tau)
    scale = (r / (1.0 - r)) / (tau**a * (1.0 - tau) ** b)  # makes uniform(τ) = r
    c = scale * t.pow(a) * (1.0 - t).pow(b)
    clean = (1.0 - t) / (1.0 + c)
    uniform = c / (1.0 + c)
    absorbed = t / (1.0 + c)
    gamma = clean + uniform
    rho = clean / gamma.clamp_min(TINY)
    return SCDDSchedule(clean=clean, uniform=uniform, absorbed=absorbed, gamma=gamma, rho=rho)
