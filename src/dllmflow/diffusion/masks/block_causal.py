"""The block-causal attention pattern of KV-cached block decoding (nemotron, llada2 samplers).

A canvas is a prefix (the prompt, left-padded to a common length S) followed by generation blocks
of `block_size` tokens. With `blk(i) = (i - S) // block_size` for generated positions:

    prefix query  -> prefix keys, causally (k <= q) when `causal_prefix`, else all of them
    block query   -> every prefix key, and every generated key with blk_k <= blk_q
                     (earlier blocks and its own block, bidirectionally inside the block)
    keep = rule and valid[k], or q == k (a padded query keeps its diagonal: no all-blocked row)

Because a block never sees later positions, the logits of block j are the same whether the model
runs over the whole canvas with this mask or over block j alone on a KV cache holding the prefix
and blocks < j computed under the same mask -- which is what makes cached and uncached decoding
give identical greedy output. The `block_causal` training mode (diffusion/strategies/block_causal.py)
builds the same mask over right-padded rows, each with its own prefix length S_b (a [B] tensor).

    from dllmflow.diffusion.masks.block_causal import block_causal_mask
    mask = block_causal_mask(valid, prefix_len=S, block_size=32, causal_prefix=True, dtype=torch.float32)
    logits = model(input_ids=x, attention_mask=mask, position_ids=pos).logits
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_causal_keep(
    q: Tensor, k: Tensor, prefix_len: int | Tensor, block_size: int, causal_prefix: bool
) -> Tensor:
    """Bool: may query position `q` attend key position `k` (long tensors, broadcastable; `prefix_len`
    an int or a tensor broadcastable with them, e.g. [B, 1, 1] for one prefix per row)?"""
    q_gen, k_gen = q >= prefix_len, k >= prefix_len
    q_blk = torch.div(q - prefix_len, block_size, rounding_mode="floor")
    k_blk = torch.div(k - prefix_len, block_size, rounding_mode="floor")
    prefix_to_prefix = ~q_gen & ~k_gen & ((k <= q) if causal_prefix else torch.ones_like(q_gen))
    block_to_prefix = q_gen & ~k_gen
    block_to_block = q_gen & k_gen & (k_blk <= q_blk)
    return prefix_to_prefix | block_to_prefix | block_to_block


def block_causal_mask(
    valid: Tensor,
    prefix_len: int | Tensor,
    block_size: int,
    causal_prefix: bool,
    dtype: torch.dtype,
    q_start: int = 0,
    q_len: int | None = None,
) -> Tensor:
    """Float additive mask [B, 1, q_len, K] (0 keep / finfo(dtype).min drop).

    valid [B, K]: 1 for real key positions 0..K-1 (0 = padding); `prefix_len` an int (a left-padded
    canvas) or [B] (each row its own prefix: right-padded training rows). Queries are positions
    [q_start, q_start + q_len) (default: all K), so the KV-cache path asks for the rows of one block
    against every key up to the block's end.
    """
    num_keys = valid.shape[1]
    q_len = num_keys - q_start if q_len is None else q_len
    dev = valid.device
    q = torch.arange(q_start, q_start + q_len, device=dev)[:, None]  # [Q, 1]
    k = torch.arange(num_keys, device=dev)[None, :]  # [1, K]
    prefix = torch.as_tensor(prefix_len, device=dev).reshape(-1, 1, 1)  # [1 or B, 1, 1]
    keep = block_causal_keep(q[None], k[None], prefix, block_size, causal_prefix)  # [1 or B, Q, K]
    return _additive((keep & valid.bool()[:, None, :]) | (q == k)[None], dtype)  # [B, 1, Q, K]


def lookahead_mask(valid: Tensor, first_masked: Tensor, clean_len: int, dtype: torch.dtype) -> Tensor:
    """The causal-blocks training canvas (docs/strategies.md §2.8): a clean row of `clean_len` tokens, then
    W appended mask slots standing for positions k.. of that row (k = `first_masked` [B]). Additive
    [B, 1, T, T], T = clean_len + W, `valid` [B, T] (padding and unused slots 0):

        clean query q   -> clean keys <= q               (the row read causally)
        slot query      -> clean keys < k, slots <= it   (what llada2 shows a block's masks)
        keep = rule and valid[key], or q == key
    """
    T, dev = valid.shape[1], valid.device
    q, key = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None]  # [T, 1], [1, T]
    clean_q, clean_k = q < clean_len, key < clean_len
    before_k = clean_k & (key < first_masked[:, None, None])  # [B, 1, T]
    keep = (clean_q & clean_k & (key <= q))[None] | (~clean_q & (before_k | (~clean_k & (key <= q))))
    return _additive((keep & valid.bool()[:, None, :]) | (q == key)[None], dtype)  # [B, 1, T, T]


def _additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool [B, Q, K] -> float [B, 1, Q, K]: 0 keep, finfo(dtype).min drop."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=keep.device)
    return torch.where(keep, zero, low)[:, None]
