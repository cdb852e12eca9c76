"""The plain causal attention mask of a left-padded batch: what a causal LM decodes under (the `ar`
sampler, serving's `ChatEngine`, idlm's exact cache, selfspec's checks), named once instead of spelled
as `block_causal_mask` with every position "prompt".

    query q -> keys k <= q that are valid (padding blocked); keep = rule, or q == k
               (a padded query keeps its diagonal: no all-blocked row, which gives NaN in softmax)

    from dllmflow.diffusion.masks.causal import causal_mask
    mask = causal_mask(valid, torch.float32)                       # [B, 1, K, K] over the whole rows
    mask = causal_mask(valid[:, :hi], dtype, q_start=lo, q_len=hi - lo)   # the new queries of a KV step

Tested against `torch.tril` in tests/unit/test_causal_mask.py.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(valid: Tensor, dtype: torch.dtype, q_start: int = 0, q_len: int | None = None) -> Tensor:
    """Float additive mask [B, 1, q_len, K] (0 keep / finfo(dtype).min drop) of queries at positions
    [q_start, q_start + q_len) (default: all K) over keys 0..K-1, `valid` [B, K] (0 = padding). A KV
    step asks for its new positions only: the cached ones are keys, never queries again."""
    num_keys, dev = valid.shape[1], valid.device
    q_len = num_keys - q_start if q_len is None else q_len
    q = torch.arange(q_start, q_start + q_len, device=dev)[:, None]  # [Q, 1]
    k = torch.arange(num_keys, device=dev)[None, :]  # [1, K]
    keep = ((k <= q)[None] & valid.bool()[:, None, :]) | (q == k)[None]  # [B, Q, K]
    zero = torch.zeros((), dtype=dtype, device=dev)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dev)
    return torch.where(keep, zero, low)[:, None]  # [B, 1, Q, K]
