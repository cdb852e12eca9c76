"""The DFlash anchor-block attention mask (docs/strategies.md §2.5, forward step 4).

Queries are the N·bs block tokens of the draft; keys are `[context (S) | block_0 | ... | block_{N-1}]`.
A query in block n (anchor a_n, keep flag keep_n) may attend:

    context key kv      iff keep_n and kv < a_n      # strictly before its anchor: no target leakage
    block key (m, j)    iff m == n                   # its own block, bidirectionally
    nothing else                                      # never another block

A padded (keep=False) block still sees its own block, so no row is fully masked (no NaN rows).
The mask is always built, whatever N and the backend (docs/strategies.md §7 caveat 1: skipping it for N=1 lets
the block read target states at and after its anchor). One predicate (`dflash_keep`) feeds both
backends, so they cannot drift apart:

    from dllmflow.diffusion.masks.dflash import dflash_dense_mask, dflash_block_mask
    mask = dflash_dense_mask(anchors, keep, ctx_len=S, block_size=bs, dtype=torch.float32)  # sdpa
    bm = dflash_block_mask(anchors, keep, ctx_len=S, block_size=bs)                         # flex (GPU)
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def dflash_keep(
    q: Tensor, kv: Tensor, anchor_q: Tensor, keep_q: Tensor, ctx_len: int, block_size: int
) -> Tensor:
    """Bool: may block-query index `q` (in [0, N·bs)) attend key index `kv` (in [0, S + N·bs))?

    `anchor_q` / `keep_q` are the anchor and keep flag of q's block, already gathered. Element-wise
    ops only, so flex_attention's vmapped `mask_mod` can call it too.
    """
    in_ctx = kv < ctx_len
    sees_ctx = in_ctx & keep_q & (kv < anchor_q)
    same_block = ~in_ctx & ((kv - ctx_len) // block_size == q // block_size)
    return sees_ctx | same_block


def dflash_keep_matrix(anchors: Tensor, keep: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """The boolean keep matrix [B, N·bs, S + N·bs] from anchors [B, N] (long) and keep [B, N] (bool)."""
    bsz, num_blocks = anchors.shape
    dev = anchors.device
    q = torch.arange(num_blocks * block_size, device=dev)  # [Q]
    kv = torch.arange(ctx_len + num_blocks * block_size, device=dev)  # [K]
    anchor_q = anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # [B, Q, 1]
    keep_q = keep.bool().repeat_interleave(block_size, dim=1)[:, :, None]  # [B, Q, 1]
    return dflash_keep(
        q[None, :, None], kv[None, None, :], anchor_q, keep_q, ctx_len, block_size
    )  # [B, Q, K]


def dflash_dense_mask(
    anchors: Tensor, keep: Tensor, ctx_len: int, block_size: int, dtype: torch.dtype
) -> Tensor:
    """Additive [B, 1, N·bs, S + N·bs] mask (0 keep / finfo(dtype).min drop) for sdpa and eager.

    finfo.min rather than -inf keeps softmax finite even if a caller builds a degenerate row; float
    rather than bool because eager attention misreads bool masks.
    """
    allowed = dflash_keep_matrix(anchors, keep, ctx_len, block_size)  # [B, Q, K]
    zero = torch.zeros((), dtype=dtype, device=anchors.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=anchors.device)
    return torch.where(allowed, zero, neg)[:, None]  # [B, 1, Q, K]


@functools.cache
def _compiled_create_block_mask():
    # Compiled once per process: building a 512-anchor mask eagerly materialises [Q, K] per batch row.
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=True)


def dflash_block_mask(
    anchors: Tensor, keep: Tensor, ctx_len: int, block_size: int, compile: bool | None = None
):
    """A flex_attention `BlockMask` with the same predicate (default 128 tiles). `compile=None`
    compiles on CUDA only (CPU has no flex backward anyway; eager is fine for forward checks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, num_blocks = anchors.shape
    anchors = anchors.long()
    keep = keep.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // block_size
        return dflash_keep(q_idx, kv_idx, anchors[b, n], keep[b, n], ctx_len, block_size)

    if compile is None:
        compile = anchors.is_cuda
    build = _compiled_create_block_mask() if compile else create_block_mask
    q_len, kv_len = num_blocks * block_size, ctx_len + num_blocks * block_size
    return build(mask_mod, bsz, None, q_len, kv_len, device=anchors.device)
