"""Block-shifted attention (the mask-free first half of the I-DLM split) == SDPA under the same mask.

fp32 and float64 to rounding; bf16 outputs and gradients against the float64 SDPA reference, to a bound
set from measured bf16 error (max |error| / max |reference|, L in {40, 300}, b in {2, 5}, 3 seeds, torch
2.13 CPU): the kernel up to 1.5e-2, bf16 masked SDPA itself up to 1.0e-2, i.e. bf16 input rounding
(eps 7.8e-3); a wrong mask or merge errs by O(1). Without the private CPU op the call falls back to
masked SDPA with one warning. The mask itself is checked against the I-DLM dense mask in
tests/unit/test_idlm.py.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dllmflow.models import shifted_attention
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


BF16_BOUND = 3e-2  # 2x the worst measured bf16 error of the kernel (module docstring)


def _rel_max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("L", [40, 300])
@pytest.mark.parametrize("b", [2, 5])
def test_bf16_output_and_grads_match_the_float64_reference(L, b):
    base = [x.detach().double() for x in _qkv(L, seed=L + b)]
    ref_in = [x.clone().requires_grad_() for x in base]
    ref = _reference(*ref_in, b, None)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = torch.autograd.grad(ref, ref_in, g)
    bf = [x.bfloat16().requires_grad_() for x in base]
    out = block_shifted_attention(*bf, b)
    assert out.dtype == torch.bfloat16
    assert _rel_max_err(out, ref) < BF16_BOUND
    got = torch.autograd.grad(out, bf, g.bfloat16())
    for name, a, w in zip(["q", "k1", "v1", "k2", "v2"], got, want):
        assert a.dtype == torch.bfloat16 and _rel_max_err(a, w) < BF16_BOUND, name


def test_float64_equals_sdpa_to_float64_rounding():
    """The golden idlm_shifted trajectory runs the kernel in float64: no fp32 step inside."""
    inputs = [x.detach().double().requires_grad_() for x in _qkv(33)]
    out = block_shifted_attention(*inputs, 3)
    ref = _reference(*inputs, 3, None)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    for a, w in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


@pytest.fixture
def no_flash_op(monkeypatch):
    """This torch as if it had no `aten::_scaled_dot_product_flash_attention_for_cpu` (the real lookup
    of a name it lacks raises AttributeError)."""
    monkeypatch.setattr(shifted_attention, "_FLASH", "_no_such_flash_attention_op")
    shifted_attention.flash_ops.cache_clear()
    yield
    shifted_attention.flash_ops.cache_clear()


def test_missing_private_op_falls_back_to_masked_sdpa_and_warns_once(no_flash_op):
    inputs = _qkv(11)
    with pytest.warns(RuntimeWarning, match="runs as masked SDPA"):
        out = block_shifted_attention(*inputs, 2, scale=0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call warns no more
        again = block_shifted_attention(*inputs, 2, scale=0.4)
    ref = _reference(*inputs, 2, 0.4)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, w in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def test_importing_dllmflow_does_not_need_the_private_op():
    """A torch without the op (every aten lookup of it fails): the imports work, the call falls back."""
    code = """
import warnings, torch, torch._ops
real = torch._ops._OpNamespace.__getattr__
def lookup(self, name):
    if "flash_attention_for_cpu" in name:
        raise AttributeError(name)
    return real(self, name)
torch._ops._OpNamespace.__getattr__ = lookup
for name in [n for n in vars(torch.ops.aten) if "flash_attention_for_cpu" in n]:  # cached lookups
    delattr(torch.ops.aten, name)
import dllmflow, dllmflow.models.shifted_attention as sa, dllmflow.models.split_attention
x = torch.randn(1, 2, 5, 4)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    sa.block_shifted_attention(x, x, x, x, x, 2); sa.block_shifted_attention(x, x, x, x, x, 2)
print("warnings", sum("masked SDPA" in str(m.message) for m in w))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "warnings 1" in done.stdout
