"""Block-shifted attention (the mask-free first half of the I-DLM split) == SDPA under the same mask.

The mask itself is checked against the I-DLM dense mask in tests/unit/test_idlm.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dllmflow.models import split_attention as split_module
from dllmflow.models.shifted_attention import block_shifted_attention, block_shifted_mask
from dllmflow.models.split_attention import SplitAttention, split_attention_forward


def _qkv(L, H=4, Hkv=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, D, generator=g, dtype=dtype).requires_grad_()
    halves = [torch.randn(2, Hkv, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(4)]
    return q, *halves


def _reference(q, k1, v1, k2, v2, b, scale):
    """SDPA over keys first ++ second with the [L, 2L] mask, key heads repeated for the query heads."""
    groups = q.shape[1] // k1.shape[1]
    k = torch.cat([k1, k2], dim=2).repeat_interleave(groups, dim=1)  # [B, H, 2L, D]
    v = torch.cat([v1, v2], dim=2).repeat_interleave(groups, dim=1)
    mask = block_shifted_mask(q.shape[2], b, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("L", [1, 2, 5, 11, 40])
@pytest.mark.parametrize("b", [1, 2, 3, 5])
def test_output_and_grads_equal_sdpa_under_the_mask(b, L, heads):
    inputs = _qkv(L, *heads)
    out = block_shifted_attention(*inputs, b, scale=0.4)  # [B, H, L, D]
    ref = _reference(*inputs, b, 0.4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    for name, a, w in zip(["q", "k1", "v1", "k2", "v2"], got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=name)


def test_default_scale_is_inverse_sqrt_head_dim():
    inputs = _qkv(9)
    torch.testing.assert_close(
        block_shifted_attention(*inputs, 2), _reference(*inputs, 2, 8**-0.5), rtol=1e-5, atol=1e-5
    )


def test_bf16_autocast_casts_mixed_inputs_like_sdpa():
    """Under CPU autocast a HF decoder hands over fp32 q/k (after rotary) and bf16 v: cast as sdpa does."""
    q, k1, v1, k2, v2 = _qkv(17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_shifted_attention(q, k1, v1.bfloat16(), k2, v2.bfloat16(), 2)
        ref = _reference(q, k1, v1.bfloat16(), k2, v2.bfloat16(), 2, None)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.02, atol=0.02)
    out.float().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k1, v1, k2, v2))


def _split_inputs(L, dtype=torch.float32):
    module = nn.Module()
    module.num_key_value_groups = 2
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 2 * L, 8, generator=g)
    k, v = torch.randn(1, 2, 2 * L, 8, generator=g), torch.randn(1, 2, 2 * L, 8, generator=g)
    return module, q, k, v.to(dtype)


@pytest.mark.parametrize("fallback", ["short", "device"])
def test_split_forward_mask_fallback_equals_the_kernel_path(fallback, monkeypatch):
    """The block form at short L or on a device without the kernel (or with dropout) is one masked SDPA."""
    module, q, k, v = _split_inputs(7)
    split = SplitAttention(7, block_length=3)
    monkeypatch.setattr(split_module, "MASKED_MAX_LEN", 0)
    fast, _ = split_attention_forward(module, q, k, v, None, scaling=0.3, split_attention=split)
    if fallback == "short":
        monkeypatch.setattr(split_module, "MASKED_MAX_LEN", 7)
    else:
        monkeypatch.setattr(split_module, "SHIFTED_DEVICES", frozenset())
    masked, _ = split_attention_forward(module, q, k, v, None, scaling=0.3, split_attention=split)
    torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_len", [0, 7])
def test_split_forward_block_form_under_bf16_autocast(max_len, monkeypatch):
    """fp32 q/k and bf16 v, as a HF decoder hands them over under autocast, on both block-form paths."""
    monkeypatch.setattr(split_module, "MASKED_MAX_LEN", max_len)
    module, q, k, v = _split_inputs(7, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = split_attention_forward(
            module, q, k, v, None, split_attention=SplitAttention(7, block_length=2)
        )
    assert out.shape == (1, 14, 4, 8) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
