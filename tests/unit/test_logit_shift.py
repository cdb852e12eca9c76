"""`dllm.logit_shift` (models/logit_shift.py): an mdlm model converted from a causal LM reads position i's
logit from position i-1. Checked against the raw HF forward shifted by hand, the MDLM loss against the
reference formula on those hand-shifted logits, the flag's round trip through an export, Fast-dLLM's caches and llada2's
block-causal sources (cached and not) reading the position before each block."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from test_mdlm import _batch, _tiny_qwen3, ref_mdlm_sum
from transformers import AutoModelForCausalLM

from dllmflow.diffusion.masks.block_causal import block_causal_mask
from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.samplers.kv import BlockCausalCache, FastDLLMCache
from dllmflow.diffusion.samplers.llada2 import CanvasBlockCausal
from dllmflow.diffusion.samplers.loop import build_left_padded_canvas
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.models.attention import bidirectional_mask, forward_bidirectional
from dllmflow.models.logit_shift import SHIFT_ATTR, apply_logit_shift, is_logit_shifted
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError


def _raw_bidirectional(model, ids, attn):
    """The model's own logits under the same bidirectional mask, no shift: model(...).logits directly."""
    mask = bidirectional_mask(attn, torch.float32, batch=ids.shape[0], length=ids.shape[1], device=ids.device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]


def test_shifted_logits_are_the_previous_positions():
    model = apply_logit_shift(_tiny_qwen3())
    batch = _batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    raw = _raw_bidirectional(model, ids, attn)
    with torch.no_grad():
        got = forward_bidirectional(model, ids, attn)
        last3 = forward_bidirectional(model, ids, attn, logits_to_keep=3)
        whole = forward_bidirectional(model, ids, attn, logits_to_keep=ids.shape[1])
    L = ids.shape[1]
    for i in range(1, L):
        torch.testing.assert_close(got[:, i], raw[:, i - 1])
    torch.testing.assert_close(got[:, 0], raw[:, 0])
    assert not torch.allclose(got[:, 1:], raw[:, 1:])  # the shift is not a no-op
    torch.testing.assert_close(last3, raw[:, L - 4 : L - 1])
    torch.testing.assert_close(whole, got)


class _NoKeepForward(torch.nn.Module):
    """A model whose forward takes no `logits_to_keep` (as some remote code): sliced after its forward."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("takes_keep", [True, False])
def test_logits_at_chosen_positions(shifted, takes_keep):
    """A LongTensor `logits_to_keep` gives exactly those positions' logits of the whole forward, in
    order, repeats allowed (the mdlm loss runs the head on its noised supervised columns only)."""
    model = _tiny_qwen3()
    if shifted:
        model = apply_logit_shift(model)
    batch = _batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    cols = torch.tensor([0, 1, 7, 7, 19])
    runner = model if takes_keep else _NoKeepForward(model)
    with torch.no_grad():
        whole = forward_bidirectional(runner, ids, attn)  # [B, L, V]
        picked = forward_bidirectional(runner, ids, attn, logits_to_keep=cols)  # [B, 5, V]
    raw = _raw_bidirectional(model, ids, attn)
    assert picked.shape == (ids.shape[0], 5, raw.shape[-1])
    torch.testing.assert_close(picked, whole[:, cols])
    want = raw[:, [0, 0, 6, 6, 18]] if shifted else raw[:, cols]
    torch.testing.assert_close(picked, want)


def test_unflagged_model_is_unchanged():
    model = _tiny_qwen3()
    batch = _batch()
    raw = _raw_bidirectional(model, batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        torch.testing.assert_close(
            forward_bidirectional(model, batch["input_ids"], batch["attention_mask"]), raw
        )
    assert not is_logit_shifted(model)


def test_mdlm_loss_reads_the_previous_position():
    settings = load_settings(dllm={"mode": "mdlm", "mask_token_id": 47, "logit_shift": True})
    strategy = build_strategy(settings)
    model = apply_logit_shift(_tiny_qwen3())
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    batch = _batch()
    batch.update(strategy.corrupt(batch, seeds=[1, 2, 3, 4]))
    got = strategy.loss(model, batch).sums["diffusion"].item()
    keys = torch.ones_like(batch["attention_mask"])  # row 1's padding is supervised: attended
    raw = _raw_bidirectional(model, batch["noisy_input_ids"], keys)
    shifted = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)  # position i scored with raw[i - 1]
    want = ref_mdlm_sum(shifted, batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"])
    unshifted = ref_mdlm_sum(
        raw, batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"]
    )
    assert math.isclose(got, want, rel_tol=1e-5)
    assert not math.isclose(got, unshifted, rel_tol=1e-3)


def test_builder_flags_the_model_and_the_export_keeps_it(tmp_path):
    tok = SimpleNamespace()
    tiny = {"architecture": "qwen3", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip

    class Tok(list):
        pad_token_id, eos_token_id, bos_token_id, mask_token_id = 0, 1, None, 2

    tok = Tok(range(40))
    shifted = build_mode_model(
        load_settings(model={"tiny": tiny}, dllm={"mode": "mdlm", "logit_shift": True}), tok
    )
    plain = build_mode_model(load_settings(model={"tiny": tiny}, dllm={"mode": "mdlm"}), tok)
    assert is_logit_shifted(shifted) and not is_logit_shifted(plain)
    shifted.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[SHIFT_ATTR] is True
    assert is_logit_shifted(AutoModelForCausalLM.from_pretrained(tmp_path))


def test_only_mdlm_takes_the_field():
    with pytest.raises(SettingsError, match="dllm.logit_shift: unknown field"):
        load_settings(dllm={"mode": "idlm", "mask_token_id": 3, "logit_shift": True})


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_cache_reads_the_position_before_the_block(cache):
    """With the canvas unchanged since the refresh, the cached keys are the ones a full forward computes,
    so a cached call must give exactly the shifted full-forward logits of the block, whose first comes
    from the position before it (a span starting at the block would miss it)."""
    model = apply_logit_shift(_tiny_qwen3()).eval()
    canvas = build_left_padded_canvas([[5, 6, 7, 8, 9]], 8, 47, 0, torch.device("cpu"))
    with torch.no_grad():
        want = forward_bidirectional(model, canvas.x)  # [1, 13, V], shifted
        source = FastDLLMCache(model, canvas, cache)
        for lo, hi in ((5, 9), (9, 13)):
            torch.testing.assert_close(source(lo, hi), want[:, lo:hi])  # the refresh
            torch.testing.assert_close(source(lo, hi), want[:, lo:hi], rtol=1e-5, atol=1e-5)  # cached
    assert source.calls == 4


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_step_blocks_decode_as_without_a_cache(cache):
    """One step per block: every cached call is a refresh, so the tokens equal the uncached ones."""
    model = apply_logit_shift(_tiny_qwen3()).eval()
    tok = SimpleNamespace(mask_token_id=47, eos_token_id=None, pad_token_id=0)

    def run(c):
        over = {"max_new_tokens": 8, "steps": 2, "block_size": 4, "cache": c}
        return SAMPLERS["llada"](model, tok, build_sampler_config("llada", over), mask_id=47).generate(
            [[5, 6, 7], [9, 10, 11, 12, 13]]
        )

    assert run(cache).sequences == run("none").sequences


def _raw_block_causal(model, canvas, block_size):
    """Raw (unshifted) logits of the whole canvas under the block-causal mask: model(...).logits directly."""
    mask = block_causal_mask(canvas.valid, canvas.prefix_len, block_size, False, torch.float32)
    with torch.no_grad():
        return model(input_ids=canvas.x, attention_mask=mask, position_ids=canvas.position_ids).logits


@pytest.mark.parametrize("cached", [True, False])
def test_llada2_reads_the_position_before_the_block(cached):
    """A shifted model's block [lo, hi) is filled from the raw logits of [lo-1, hi-1) of the block-causal
    canvas forward, on every step of a block (the re-fed last committed position included) and in the
    next block once the previous one is committed."""
    model = apply_logit_shift(_tiny_qwen3()).eval()
    canvas = build_left_padded_canvas([[5, 6, 7], [8, 9, 10, 11, 12]], 8, 47, 0, torch.device("cpu"))
    fwd = SAMPLERS["llada2"].model_forward.__get__(SimpleNamespace(model=model, _keeps_logits=True))
    source = (
        BlockCausalCache(model, canvas, 4, 1)
        if cached
        else CanvasBlockCausal(fwd, canvas, 4, torch.float32, 1)
    )
    with torch.no_grad():
        want = _raw_block_causal(model, canvas, 4)  # [2, 13, V]
        torch.testing.assert_close(source(5, 9), want[:, 4:8])
        canvas.x[:, 5:7] = torch.tensor([20, 21])  # two commits: the second step sees them
        want = _raw_block_causal(model, canvas, 4)
        torch.testing.assert_close(source(5, 9), want[:, 4:8], rtol=1e-5, atol=1e-5)
        canvas.x[:, 7:9] = torch.tensor([22, 23])  # the block is full: the next block reads position 8
        want = _raw_block_causal(model, canvas, 4)
        torch.testing.assert_close(source(9, 13), want[:, 8:12], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[:, 8:12], want[:, 9:13])  # the shift is not a no-op
    assert source.calls == 3


def test_llada2_decodes_a_shifted_model_as_without_a_cache():
    model = apply_logit_shift(_tiny_qwen3()).eval()
    tok = SimpleNamespace(mask_token_id=47, eos_token_id=None, pad_token_id=0)

    def run(cache):
        over = {
            "max_new_tokens": 8,
            "steps": 3,
            "block_size": 4,
            "threshold": 0.5,
            "cache": cache,
        }
        config = build_sampler_config("llada2", over)
        return SAMPLERS["llada2"](model, tok, config, mask_id=47).generate([[5, 6, 7], [9, 10, 11, 12, 13]])

    assert run("exact").sequences == run("none").sequences
