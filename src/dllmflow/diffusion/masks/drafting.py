"""The attention mask of the drafting adapter's slot forward (`dllm.mode: uno`, docs/strategies.md §2.9).

A row's clean tokens are already in the KV cache (one forward without gradients); then A groups of m
[MASK] slots are appended, group a standing for positions k_a..k_a+m-1 of the row. Additive
[B, 1, A*m, L + A*m] over the keys [cached clean row (L) | slots (A*m)]:

    slot (a, t) -> clean keys j < k_a that are valid     (the prefix a selfspec forward has committed)
                -> slots (a, t') with t' <= t            (its own group, causally, as selfspec feeds them)
    an unused group (k_a < 0) keeps only its diagonal    (softmax stays finite; its loss is not taken)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_causal import _additive


def drafting_slots_mask(valid: Tensor, anchors: Tensor, slots: int, dtype: torch.dtype) -> Tensor:
    """`valid` [B, L] the cached row's real keys, `anchors` [B, A] each group's first position (-1: unused),
    `slots` m per group -> additive float mask [B, 1, A*m, L + A*m]."""
    B, L = valid.shape
    A, dev = anchors.shape[1], valid.device
    k = anchors.repeat_interleave(slots, dim=1)  # [B, A*m] the anchor of each slot query
    group = torch.arange(A, device=dev).repeat_interleave(slots)  # [A*m]
    t = torch.arange(slots, device=dev).repeat(A)  # [A*m]
    clean = (torch.arange(L, device=dev)[None, None] < k[..., None]) & valid.bool()[:, None]  # [B, A*m, L]
    own = (group[:, None] == group[None]) & (t[None] <= t[:, None])  # [A*m, A*m]
    used = (k >= 0)[..., None]  # [B, A*m, 1]
    slot_keys = (own[None] & used) | torch.eye(A * slots, dtype=torch.bool, device=dev)[None]  # [B, A*m, A*m]
    return _additive(torch.cat([clean & used, slot_keys], dim=2), dtype)  # [B, 1, A*m, L + A*m]
