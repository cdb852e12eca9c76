"""The I-DLM 2L x 2L block-diffusion attention mask over `[x_t | x_0]` (docs/strategies.md §2.6).

Query/key indices run over [0, 2L): [0, L) is the noisy copy x_t, [L, 2L) the clean copy x_0. With
block ids taken within each copy, `blk(i) = (i mod L) // b`:

    M_BD  = blk_q == blk_k  and q, k noisy and q >= k   # causal inside the noisy block
    M_OBC = blk_q >  blk_k  and q noisy, k clean        # noisy sees the clean copy of earlier blocks
    M_BC  = q >= k          and q, k clean              # the clean copy is strictly causal
    keep  = (M_BD or M_OBC or M_BC) and valid[k mod L]  # padded keys blocked in both copies

One predicate (`idlm_keep`) feeds every backend, so they cannot drift apart:

    from dllmflow.diffusion.masks.idlm import idlm_block_mask, idlm_dense_mask, idlm_split_attention
    mask = idlm_dense_mask(attention_mask, block_length=2, dtype=torch.bfloat16)  # eager (dense 2L x 2L)
    split = idlm_split_attention(attention_mask, 2, torch.float32)                # sdpa, split halves (CPU)
    bm = idlm_block_mask(attention_mask, block_length=2)                          # flex_attention (GPU)
"""

from __future__ import annotations

import torch
from torch import Tensor

from dllmflow.models.shifted_attention import SHIFTED_DEVICES
from dllmflow.models.split_attention import SplitAttention

# Noisy queries per split-attention chunk (rounded down to a multiple of block_length). A chunk of c
# queries at offset a scores c x (2c + a) pairs: smaller chunks waste less, larger ones call SDPA less
# often. L <= NOISY_CHUNK is one chunk over the full 2L keys (the dense mask's first L rows).
NOISY_CHUNK = 128


def idlm_keep(q: Tensor, k: Tensor, valid_k: Tensor, seq_len: int, block_length: int) -> Tensor:
    """Bool: may query index `q` attend key index `k` (both in [0, 2L), broadcastable)?

    `valid_k` is the key's attention-mask value (bool), already gathered at `k mod L`. Written with
    element-wise tensor ops only, so flex_attention's vmapped `mask_mod` can call it too.
    """
    q_clean, k_clean = q >= seq_len, k >= seq_len
    q_blk, k_blk = (q % seq_len) // block_length, (k % seq_len) // block_length
    same_block_causal = (q_blk == k_blk) & ~q_clean & ~k_clean & (q >= k)  # M_BD
    earlier_clean = (q_blk > k_blk) & ~q_clean & k_clean  # M_OBC
    clean_causal = (q >= k) & q_clean & k_clean  # M_BC
    return (same_block_causal | earlier_clean | clean_causal) & valid_k


def idlm_keep_matrix(attention_mask: Tensor | None, seq_len: int, block_length: int, device=None) -> Tensor:
    """The boolean keep matrix [B, 2L, 2L] (B = 1 when `attention_mask` is None: no padding)."""
    valid = _valid(attention_mask, seq_len, device)  # [B, L]
    dev = valid.device
    idx = torch.arange(2 * seq_len, device=dev)
    valid_k = valid.repeat(1, 2)[:, None, :]  # [B, 1, 2L]: key k reads valid[k mod L]
    return idlm_keep(idx[None, :, None], idx[None, None, :], valid_k, seq_len, block_length)  # [B, 2L, 2L]


def idlm_dense_mask(
    attention_mask: Tensor | None,
    block_length: int,
    dtype: torch.dtype,
    seq_len: int | None = None,
    device=None,
) -> Tensor:
    """Additive [B, 1, 2L, 2L] mask (0 keep / finfo(dtype).min drop) for sdpa and eager.

    finfo.min rather than -inf: a fully blocked row (an all-padding sample) then softmaxes to a
    uniform row instead of NaN; bool masks are avoided because eager attention misreads them.
    """
    if seq_len is None:
        if attention_mask is None:
            raise ValueError("idlm_dense_mask: pass seq_len when attention_mask is None")
        seq_len = attention_mask.shape[1]
    keep = idlm_keep_matrix(attention_mask, seq_len, block_length, device)  # [B, 2L, 2L]
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=keep.device)
    return torch.where(keep, zero, low)[:, None]  # [B, 1, 2L, 2L]


def idlm_block_mask(attention_mask: Tensor, block_length: int, *, block_size: int = 128):
    """A flex_attention `BlockMask` for the same predicate (B x 1 head x 2L x 2L).

    Used when the model runs `attn_implementation: flex_attention` (GPU; flex has no CPU backward).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq_len = attention_mask.shape
    valid = attention_mask != 0  # [B, L]

    def mask_mod(b, h, q_idx, kv_idx):
        return idlm_keep(q_idx, kv_idx, valid[b, kv_idx % seq_len], seq_len, block_length)

    return create_block_mask(
        mask_mod, batch, None, 2 * seq_len, 2 * seq_len, device=attention_mask.device, BLOCK_SIZE=block_size
    )


def idlm_split_attention(
    attention_mask: Tensor | None,
    block_length: int,
    dtype: torch.dtype,
    seq_len: int | None = None,
    device=None,
    chunk: int | None = None,
) -> SplitAttention:
    """The same mask as `SplitAttention` for `dllmflow.models.split_attention` (sdpa without 4L^2 work).

    Right padding only (`right_padded`; the collator's): callers use the dense mask otherwise. Clean
    queries: causal over the clean copy, no mask. Noisy queries: a noisy query sees noisy keys of its
    own block up to itself and clean keys before its block (M_BD, M_OBC). On `SHIFTED_DEVICES` (CPU),
    unless `chunk` is given, that is the block form (`block_length` only: no mask tensor is built,
    see `dllmflow.models.shifted_attention`). Otherwise by chunks [a, e) with a a multiple of
    `block_length`: keys noisy[a:e] ++ clean[0:e] hold every key a query of the chunk may see.

    Right padding needs no clean mask: a real clean query never reaches a later (padded) key, and the
    padded query rows, which then differ from the dense mask's, are read by nobody (their keys are
    blocked for every real query and their logits are not scored). Under left padding a padded query
    row is fully blocked yet scored (it predicts the first real token), and a fully blocked row
    averages whatever keys it is given: only the dense mask gives it the same ones.
    """
    if seq_len is None:
        if attention_mask is None:
            raise ValueError("idlm_split_attention: pass seq_len when attention_mask is None")
        seq_len = attention_mask.shape[1]
    L = seq_len
    valid = _valid(attention_mask, L, device)  # [B, L]
    dev = valid.device
    if chunk is None and dev.type in SHIFTED_DEVICES:
        return SplitAttention(seq_len=L, block_length=block_length)
    zero = torch.zeros((), dtype=dtype, device=dev)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dev)
    chunk = NOISY_CHUNK if chunk is None else chunk  # read at call time: tests shrink it
    step = max(block_length, chunk // block_length * block_length)
    B = valid.shape[0]
    prefix = torch.where(valid, zero, low)  # [B, L]: clean keys before a chunk, visible iff valid
    chunks = []
    for a in range(0, L, step):
        e = min(a + step, L)
        # Only keys in [a, e) of either copy need the predicate; clean keys before the chunk precede
        # every query's block (a is a block boundary), so they are visible iff valid.
        q = torch.arange(a, e, device=dev)[None, :, None]  # noisy query indices
        k = torch.arange(a, e, device=dev)
        keys = torch.cat([k, L + k])[None, None, :]  # noisy[a:e] ++ clean[a:e]
        valid_k = torch.cat([valid[:, a:e], valid[:, a:e]], dim=1)[:, None, :]  # [B, 1, 2(e-a)]
        near = torch.where(idlm_keep(q, keys, valid_k, L, block_length), zero, low)  # [B, e-a, 2(e-a)]
        mask = torch.empty(B, 1, e - a, (e - a) + e, dtype=dtype, device=dev)  # noisy[a:e] ++ clean[0:e]
        mask[:, 0, :, : e - a] = near[..., : e - a]
        mask[:, 0, :, e - a : e] = prefix[:, None, :a]  # broadcast over the chunk's queries
        mask[:, 0, :, e:] = near[..., e - a :]
        chunks.append((a, e, mask))  # [B, 1, e-a, (e-a)+e]
    return SplitAttention(seq_len=L, chunks=tuple(chunks))


def right_padded(attention_mask: Tensor | None) -> bool:
    """True when every row's valid positions are a prefix (no padding, or right padding only)."""
    if attention_mask is None:
        return True
    valid = attention_mask != 0  # [B, L]
    prefix = torch.arange(valid.shape[1], device=valid.device) < valid.sum(1, keepdim=True)  # [B, L]
    return bool((valid == prefix).all())


def _valid(attention_mask: Tensor | None, seq_len: int, device) -> Tensor:
    if attention_mask is None:
        return torch.ones(1, seq_len, dtype=torch.bool, device=device)
    return attention_mask != 0
