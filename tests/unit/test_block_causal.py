"""`block_causal` (diffusion/strategies/block_causal.py, docs/strategies.md §2.8): the one-block corruption
kernel, the loss against a per-row reference built with explicit loops (its own mask, its own forward,
the hand-shifted raw logits), the training view of a block against what llada2 computes for the same
block while decoding (cached), the causal-prompt flag through an export, and the settings' refusals.
Causal blocks, once `block_attention: causal` here, are `causal_blocks`: tests/unit/test_causal_blocks.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_mdlm import _tiny_qwen3

from dllmflow.diffusion.corruption import corrupt_one_block, per_sample
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.samplers.kv import BlockCausalCache
from dllmflow.diffusion.samplers.loop import build_left_padded_canvas
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.block_causal import BlockCausalStrategy, block_causal_logits
from dllmflow.models.causal_prompt import CAUSAL_PROMPT_ATTR, apply_causal_prompt, has_causal_prompt
from dllmflow.models.logit_shift import apply_logit_shift
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError

M = 47  # the mask id of the tiny vocabulary (48)


class _Tok(SimpleNamespace):
    """The tokenizer facts a tiny model and the samplers read: 48 ids, [MASK] = 47, no EOS."""

    mask_token_id, eos_token_id, pad_token_id, bos_token_id = M, None, 0, None

    def __len__(self) -> int:
        return M + 1


def _rows():
    """Three right-padded rows: prompts of 5, 3 and 6; answers of 11, 4 and 0 supervised tokens."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, M, (3, 18), generator=g)
    loss_mask, attn = torch.zeros(3, 18), torch.ones(3, 18, dtype=torch.long)
    loss_mask[0, 5:16], attn[0, 16:] = 1, 0
    loss_mask[1, 3:7], attn[1, 7:] = 1, 0
    attn[2, 6:] = 0  # nothing supervised
    return {"input_ids": x, "loss_mask": loss_mask, "attention_mask": attn}


def _draw(rows, seed, block_size, **kw):
    """The kernel over `_rows()`, each row its own seed."""
    seeds = [seed, seed + 1000, seed + 2000]
    return per_sample(
        corrupt_one_block,
        seeds,
        rows["input_ids"],
        rows["loss_mask"],
        mask_token_id=M,
        block_size=block_size,
        **kw,
    )


def test_the_kernel_masks_one_aligned_block_of_the_response_per_row():
    b, rows = 4, _rows()
    seen = set()
    for seed in range(120):
        z, noise, p, block, prefix = _draw(rows, seed, b, draw_length=24, eps=1e-3)
        assert prefix[:2].tolist() == [5, 3] and prefix[2] >= 18  # nothing supervised: all prompt
        assert not block[2].any() and not noise[2].any()
        for r, (start, last) in enumerate(((5, 15), (3, 6))):
            idx = block[r].nonzero().squeeze(1).tolist()
            lo = idx[0]
            assert (lo - start) % b == 0 and start <= lo <= last  # aligned to the prompt's end, in the answer
            assert idx == list(range(lo, min(lo + b, 18)))
            seen.add((r, lo))
            sup = rows["loss_mask"][r] != 0
            assert not (noise[r] & ~(block[r] & sup)).any()  # only the block's supervised positions
            assert torch.equal(z[r][noise[r]], torch.full_like(z[r][noise[r]], M))
            assert torch.equal(z[r][~noise[r]], rows["input_ids"][r][~noise[r]])
            assert 1e-3 <= p[r, 0] <= 1 and (p[r] == p[r, 0]).all()
    assert seen == {(0, 5), (0, 9), (0, 13), (1, 3)}  # every block of the response gets drawn


def test_the_suffix_pattern_masks_a_clean_prefix_of_the_block_and_every_supervised_position_after_it():
    b, rows = 4, _rows()
    starts = set()
    for seed in range(60):
        z, noise, p, block, prefix = _draw(rows, seed, b, suffix=True)
        assert torch.equal(p, torch.ones_like(p))  # weighted 1: no ELBO time
        for r in range(2):
            sup_in_block = (block[r] & (rows["loss_mask"][r] != 0)).nonzero().squeeze(1).tolist()
            masked = noise[r].nonzero().squeeze(1).tolist()
            assert masked and masked == sup_in_block[sup_in_block.index(masked[0]) :]  # a whole suffix
            starts.add((r, masked[0] - sup_in_block[0]))
    assert {k for r, k in starts if r == 1} == {0, 1, 2, 3}  # every suffix length gets drawn


def _reference_sum(model, batch, block_size, causal_prompt):
    """Σ CE/p over the noised supervised positions, one row at a time: the row's canvas up to its drawn
    block's end, the mask written out pair by pair, the raw HF logits read one position early by hand."""
    total = 0.0
    for r in range(batch["input_ids"].shape[0]):
        block = batch["block"][r]
        if not block.any():
            continue
        start, end = int(batch["prefix_len"][r]), int(block.nonzero()[-1]) + 1
        valid = batch["attention_mask"][r].bool() | block
        ids = torch.where(block & ~batch["attention_mask"][r].bool(), M, batch["noisy_input_ids"][r])[:end]
        keep = torch.zeros(end, end, dtype=torch.bool)
        for q in range(end):
            for k in range(end):
                if q < start:
                    rule = k <= q if causal_prompt else k < start
                else:
                    rule = k < start or (k - start) // block_size <= (q - start) // block_size
                keep[q, k] = (rule and bool(valid[k])) or q == k
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[None, None]
        with torch.no_grad():
            raw = model(
                input_ids=ids[None], attention_mask=mask, position_ids=torch.arange(end)[None]
            ).logits[0]
        for i in range(1, end):
            if batch["noise_mask"][r, i] and batch["loss_mask"][r, i]:
                ce = F.cross_entropy(raw[i - 1], batch["input_ids"][r, i]).item()
                total += ce / float(batch["p_mask"][r, i])
    return total


@pytest.mark.parametrize("causal_prompt, pattern", [(True, "random"), (False, "random"), (True, "suffix")])
def test_the_loss_matches_a_per_row_reference(causal_prompt, pattern):
    dllm = {"mode": "block_causal", "mask_token_id": M, "block_size": 4, "causal_prompt": causal_prompt,
            "mask_pattern": pattern}  # fmt: skip
    strategy = build_strategy(load_settings(dllm=dllm, eval={"block_size": 4}))
    assert isinstance(strategy, BlockCausalStrategy)
    model = apply_logit_shift(_tiny_qwen3())
    strategy.setup(model, SimpleNamespace(mask_token_id=M), torch.device("cpu"))
    batch = _rows()
    state = torch.get_rng_state()
    batch.update(strategy.corrupt(batch, seeds=[10, 11, 12]))
    assert torch.equal(state, torch.get_rng_state())
    assert batch["noise_mask"].any()
    assert strategy.token_counts(batch)["diffusion"] == (batch["block"] & (batch["loss_mask"] != 0)).sum()
    out = strategy.loss(model, batch)
    assert set(out.sums) == {"diffusion"}
    want = _reference_sum(model, batch, 4, causal_prompt)
    assert math.isclose(out.sums["diffusion"].item(), want, rel_tol=1e-5)
    out.sums["diffusion"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_block_is_seen_in_training_as_llada2_sees_it_while_decoding():
    """The logits training computes for a noisy block (earlier blocks clean, the prompt causal) equal the
    ones llada2's exact cache computes for that block at the same state: the model learns the view it is
    decoded with."""
    model = apply_causal_prompt(apply_logit_shift(_tiny_qwen3())).eval()
    prompt, answer = [5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27]
    noisy_block = [M, 25, M, M]  # block 1 mid-decoding: one token committed
    canvas = build_left_padded_canvas([prompt], 8, M, 0, torch.device("cpu"))
    source = BlockCausalCache(model, canvas, 4, shift=1, causal_prefix=True)
    with torch.no_grad():
        source(5, 9)  # block 0 ...
        canvas.x[0, 5:9] = torch.tensor(answer[:4])  # ... committed
        canvas.x[0, 9:13] = torch.tensor(noisy_block)
        decoded = source(9, 13)  # [1, 4, V]
    x = torch.tensor([prompt + answer])
    batch = {
        "input_ids": x,
        "noisy_input_ids": torch.tensor([prompt + answer[:4] + noisy_block]),
        "attention_mask": torch.ones_like(x),
        "block": torch.arange(13)[None].ge(9),
        "prefix_len": torch.tensor([5]),
    }
    with torch.no_grad():
        trained = block_causal_logits(model, batch, torch.arange(9, 13), 4, True, M)  # [1, 4, V]
        bidirectional_prompt = block_causal_logits(model, batch, torch.arange(9, 13), 4, False, M)
    torch.testing.assert_close(trained, decoded, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(bidirectional_prompt, decoded, atol=1e-4)  # the prompt rule is seen


def test_a_causal_prompt_model_decodes_as_without_a_cache_and_keeps_its_flag_through_an_export(tmp_path):
    model = apply_causal_prompt(apply_logit_shift(_tiny_qwen3())).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[CAUSAL_PROMPT_ATTR] is True
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert has_causal_prompt(loaded) and not has_causal_prompt(_tiny_qwen3())
    tok = SimpleNamespace(mask_token_id=M, eos_token_id=None, pad_token_id=0)

    def run(m, cache):
        over = {"max_new_tokens": 8, "steps": 3, "block_size": 4, "threshold": 0.5, "cache": cache}
        config = build_sampler_config("llada2", over)
        return (
            SAMPLERS["llada2"](m, tok, config, mask_id=M).generate([[5, 6, 7], [9, 10, 11, 12, 13]]).sequences
        )

    assert run(loaded, "exact") == run(loaded, "none") == run(model, "exact")


def test_settings_refuse_what_the_mode_cannot_do():
    with pytest.raises(SettingsError, match=r"dllm\.block_size"):
        load_settings(dllm={"mode": "block_causal", "block_size": 0})
    with pytest.raises(SettingsError, match="packing"):
        load_settings(dllm={"mode": "block_causal"}, dataset={"packing": True})
    ok = load_settings(dllm={"mode": "block_causal"}, eval={"ar_control": {"enabled": True}})
    assert ok.eval.ar_control.enabled


def test_llada2_must_decode_the_trained_block_size():
    from dllmflow.diffusion.samplers.configs import LLaDA2Config
    from dllmflow.settings.block_modes import LLADA2_PRESET_BLOCK_SIZE

    assert LLaDA2Config().block_size == LLADA2_PRESET_BLOCK_SIZE  # the settings' copy of the preset
    with pytest.raises(SettingsError, match=r"eval\.block_size.*dllm\.block_size=8.*blocks of 32"):
        load_settings(dllm={"mode": "block_causal", "block_size": 8})  # unset: llada2's preset 32
    with pytest.raises(SettingsError, match=r"eval\.block_size.*blocks of 16"):
        load_settings(dllm={"mode": "block_causal", "block_size": 8}, eval={"block_size": 16})
    assert (
        load_settings(dllm={"mode": "block_causal", "block_size": 8}, eval={"block_size": 8}).eval.block_size
        == 8
    )
    assert load_settings(dllm={"mode": "block_causal"}).dllm.block_size == 32  # preset against preset


def test_a_micro_batch_with_nothing_noised_gives_a_zero_loss_that_still_backpropagates():
    strategy = build_strategy(load_settings(dllm={"mode": "block_causal", "mask_token_id": M, "block_size": 4},
                                            eval={"block_size": 4}))  # fmt: skip
    model = apply_logit_shift(_tiny_qwen3())
    batch = _rows()
    batch.update(strategy.corrupt(batch, seeds=[10, 11, 12]))
    batch["noise_mask"][:] = False  # loss_columns then keeps the last column, past every drawn block
    batch["block"][:, 12:] = False
    out = strategy.loss(model, batch)
    assert out.sums["diffusion"].item() == 0.0
    out.sums["diffusion"].backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
