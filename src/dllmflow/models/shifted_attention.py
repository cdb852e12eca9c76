"""Block-shifted attention: the first half of I-DLM's `[x_t | x_0]` split without a mask tensor.

A first-half (noisy) query i with block length b, r = i mod b, sees the first-half keys of its own
block up to itself, [i - r, i], and the second-half (clean) keys before its block, [0, i - r). Cut
that set at the diagonal i - b instead of at the block start (i - b < i - r <= i):

    far   second-half keys [0, i - b]   -> plain causal SDPA of q[b:] over k2[:L-b] (`is_causal`,
                                           no mask tensor: the fast causal kernel, ~L^2/2 scores)
    near  the b positions p in (i - b, i]: second half where p < i - r, first half where p >= i - r
                                        -> b scores per query from shifted key rows, tiny

The two softmax pieces merge exactly with their log-sum-exps. The backward reuses the causal
kernel's own backward with the MERGED output and log-sum-exp (then its probabilities are the union
softmax's, and its rowsum(dO * O) term is the union's), and writes the near part's gradient out.
Needs `aten::_scaled_dot_product_flash_attention_for_cpu` (out + logsumexp), a private op looked up
on first use (`flash_ops`): CPU only (`SHIFTED_DEVICES`); without dropout. Where the op is missing
(another torch build), the call runs masked SDPA under `block_shifted_mask` (same result, ~4x the
scores) and warns once; importing this module never fails on it. Right padding needs no mask: a real
query never reaches a later (padded) key. Scores and softmax run in fp32 (bf16/fp16 inputs) or in
float64 (float64 inputs: the golden reference). Run: `pytest -q tests/unit/test_shifted_attention.py`.

    out = block_shifted_attention(q1, k1, v1, k2, v2, block_length=2, scale=None)  # [B, H, L, D]
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor
from torch.nn import functional as F

# Devices with the causal kernel that returns its logsumexp and takes one in its backward.
SHIFTED_DEVICES = frozenset({"cpu"})
_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


@functools.cache
def flash_ops() -> tuple | None:
    """The private CPU flash kernel and its backward, or None (with one warning) where this torch lacks them."""
    try:
        return getattr(torch.ops.aten, _FLASH), getattr(torch.ops.aten, _FLASH + "_backward")
    except (AttributeError, RuntimeError) as e:
        warnings.warn(
            f"torch {torch.__version__} has no aten::{_FLASH} ({e}): block-shifted attention runs as "
            "masked SDPA (same result, more work)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def block_shifted_attention(
    q: Tensor, k1: Tensor, v1: Tensor, k2: Tensor, v2: Tensor, block_length: int, scale: float | None = None
) -> Tensor:
    """First-half queries q [B, H, L, D] over first-half k1/v1 and second-half k2/v2 [B, Hkv, L, D].

    Hkv may divide H (grouped-query attention: query head h reads key head h // (H / Hkv)).
    Returns [B, H, L, D] in q's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    device = q.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast casts sdpa's inputs (the kernel takes one dtype)
        dtype = torch.get_autocast_dtype(device)
        q, k1, v1, k2, v2 = (x.to(dtype) for x in (q, k1, v1, k2, v2))
    if flash_ops() is None:
        mask = block_shifted_mask(q.shape[2], block_length, q.dtype, q.device)  # [L, 2L]
        k, v = torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)  # [B, Hkv, 2L, D]
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return _BlockShifted.apply(q, k1, v1, k2, v2, block_length, scale)


def block_shifted_mask(seq_len: int, block_length: int, dtype: torch.dtype, device=None) -> Tensor:
    """The same pattern as an additive [L, 2L] mask over keys first ++ second (short L, dropout, other devices)."""
    i = torch.arange(seq_len, device=device)[:, None]  # [L, 1]
    k = torch.arange(seq_len, device=device)[None, :]  # [1, L]
    start = i - i % block_length  # the query's block start
    keep = torch.cat([(k >= start) & (k <= i), k < start], dim=1)  # [L, 2L]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(keep, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device))


class _BlockShifted(torch.autograd.Function):
    # Few element-wise ops on purpose: the near part is O(b L D) work, but each op is a CPU kernel call
    # whose fixed cost shows at short L.
    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, b: int, scale: float):
        L, Hkv = q.shape[2], k1.shape[1]
        acc = _acc_dtype(q)
        flash = flash_ops()[0]
        with torch.autocast(q.device.type, enabled=False):
            # 1) near: b scores per query (offset d = i - p), fp32 (or f64); -inf before the sequence start
            qg = q.to(acc).unflatten(1, (Hkv, -1))  # [B, Hkv, G, L, D]
            first = _first_masks(L, b, q.device, acc)  # b x [L-d, 1]
            kd, vd = _near_rows(k1, k2, first, acc), _near_rows(v1, v2, first, acc)  # b x [B, Hkv, 1, L-d, D]
            s = qg.new_full((*qg.shape[:-1], b), float("-inf"))  # [B, Hkv, G, L, b]
            for d in range(len(kd)):
                s[..., d:, d] = (qg[..., d:, :] * kd[d]).sum(-1)
            s *= scale
            lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, L]
            p = torch.exp(s - lse[..., None])
            out = p[..., 0, None] * vd[0]  # [B, Hkv, G, L, D]
            for d in range(1, len(vd)):
                out[..., d:, :].addcmul_(p[..., d:, d, None], vd[d])
            out, lse = out.flatten(1, 2), lse.flatten(1, 2)  # [B, H, L, D], [B, H, L]
            # 2) far: causal over the second half shifted by b, merged by log-sum-exp
            if L > b:
                o_far, lse_far = flash(
                    q[:, :, b:], k2[:, :, : L - b], v2[:, :, : L - b], 0.0, True, scale=scale
                )
                lse_near = lse[..., b:]
                w_near = torch.sigmoid(lse_near - lse_far)[..., None]  # exp(lse_near - merged lse)
                out[:, :, b:] = torch.lerp(o_far.to(acc), out[:, :, b:], w_near)
                lse[..., b:] = torch.logaddexp(lse_near, lse_far)
        out = out.to(q.dtype)
        # the near scores and gathered rows are small ([B, H, L, b], b x [B, Hkv, L, D]): kept, not recomputed
        ctx.save_for_backward(q, k2, v2, out, lse, s, *kd, *vd)
        ctx.b, ctx.scale = b, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k2, v2, out, lse, s, *rows = ctx.saved_tensors
        b, scale, n = ctx.b, ctx.scale, len(rows) // 2
        kd, vd = rows[:n], rows[n:]
        L, Hkv = q.shape[2], k2.shape[1]
        acc = _acc_dtype(q)
        first = _first_masks(L, b, q.device, acc)
        # 1) near: dS = P (dP - rowsum(dO * O)), P from the MERGED log-sum-exp
        qg = q.to(acc).unflatten(1, (Hkv, -1))  # [B, Hkv, G, L, D]
        g = grad.to(acc).unflatten(1, (Hkv, -1))
        p = torch.exp(s - lse.unflatten(1, (Hkv, -1))[..., None])  # [B, Hkv, G, L, b]
        delta = (g * out.to(acc).unflatten(1, (Hkv, -1))).sum(-1, keepdim=True)  # [B, Hkv, G, L, 1]
        dk2, dv2 = torch.zeros_like(k2, dtype=acc), torch.zeros_like(v2, dtype=acc)
        for d in range(n):  # queries i >= d read key row i - d
            g_d, p_d = g[..., d:, :], p[..., d:, d, None]  # [B, Hkv, G, L-d, D], [..., 1]
            ds = p_d * ((g_d * vd[d]).sum(-1, keepdim=True) - delta[..., d:, :]) * scale  # [..., L-d, 1]
            dk = (ds * qg[..., d:, :]).sum(2)  # [B, Hkv, L-d, D]
            dv = (p_d * g_d).sum(2)
            if d == 0:  # the query's own position: always the first half
                dq, dk1, dv1 = ds * kd[0], dk, dv  # dq [B, Hkv, G, L, D]
            else:
                dq[..., d:, :].addcmul_(ds, kd[d])
                _scatter(dk, dk1, dk2, first[d])
                _scatter(dv, dv1, dv2, first[d])
        dq = dq.flatten(1, 2)  # [B, H, L, D]
        # 2) far: the kernel's backward, given the merged output and log-sum-exp
        if L > b:
            far = (
                grad[:, :, b:],
                q[:, :, b:],
                k2[:, :, : L - b],
                v2[:, :, : L - b],
                out[:, :, b:],
                lse[..., b:],
            )
            dq_f, dk_f, dv_f = flash_ops()[1](*far, 0.0, True, scale=scale)
            dq[:, :, b:] += dq_f
            dk2[:, :, : L - b] += dk_f
            dv2[:, :, : L - b] += dv_f
        grads = (dq, dk1, dv1, dk2, dv2)
        return *(x.to(q.dtype) for x in grads), None, None


def _acc_dtype(q: Tensor) -> torch.dtype:
    """Where the near scores and softmax are computed: fp32 for bf16/fp16/fp32 inputs, float64 for float64."""
    return torch.promote_types(q.dtype, torch.float32)


def _first_masks(L: int, b: int, device, dtype: torch.dtype) -> list[Tensor]:
    """Offset d = 0..min(b, L)-1: [L-d, 1] float, 1 where query i = p + d reads key row p from the
    first half (p inside the query's block: i mod b >= d), 0 where from the second half."""
    i = torch.arange(L, device=device)
    return [(i[d:] % b >= d)[:, None].to(dtype) for d in range(min(b, L))]


def _near_rows(x1: Tensor, x2: Tensor, first: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Rows at offset d for queries i >= d (row i - d of its half), each [B, Hkv, 1, L-d, D] in `dtype`."""
    L = x1.shape[2]
    x1, x2 = x1.to(dtype), x2.to(dtype)
    rows = [x1[:, :, None]]  # d = 0: the query's own position, always in its block
    for d in range(1, len(first)):
        rows.append(torch.where(first[d] > 0, x1[:, :, : L - d], x2[:, :, : L - d])[:, :, None])
    return rows


def _scatter(dx: Tensor, d1: Tensor, d2: Tensor, first: Tensor) -> None:
    """Add the offset-d row gradients [B, Hkv, L-d, D] to the half each row was read from."""
    n = dx.shape[2]
    d1[:, :, :n].addcmul_(dx, first)
    d2[:, :, :n].addcmul_(dx, 1.0 - first)
