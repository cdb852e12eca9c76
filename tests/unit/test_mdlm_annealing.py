"""mdlm's attention annealing (`dllm.attention_annealing_steps`, DiffuLLaMA-style A2D): step s < N sees
every past key and a drawn share s/N of the future keys, from N on every key. Checked against masks
built here by hand from the drawn keys (never the strategy's own mask code), the draws' seeding (per
sample, on a stream of their own, the noise untouched), an in-process run against the same run stopped
and resumed, and the settings' refusals."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_mdlm import _batch, _tiny_qwen3, ref_mdlm_sum

from dllmflow.diffusion.strategies import build_strategy
from dllmflow.diffusion.strategies.mdlm import future_keys
from dllmflow.errors import UserError
from dllmflow.settings import load_settings
from dllmflow.settings.loader import SettingsError

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [11, 12, 13, 14]


def _strategy(anneal: int):
    strategy = build_strategy(
        load_settings(dllm={"mode": "mdlm", "eps": 0.001, "attention_annealing_steps": anneal})
    )
    model = _tiny_qwen3()
    strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))
    return strategy, model


def _hand_logits(model, ids, attn, allowed):
    """The model's logits under an additive mask built here: key k for query q iff allowed[b, q, k]
    and k is not padding, or k == q."""
    B, L = ids.shape
    mask = torch.full((B, 1, L, L), torch.finfo(torch.float32).min)
    for b in range(B):
        for q in range(L):
            for k in range(L):
                if k == q or (allowed[b, q, k] and attn[b, k]):
                    mask[b, 0, q, k] = 0.0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, L, V]


def _keys(batch):
    """The keys no padding rule hides here: row 1's padding in `_batch()` is supervised, so the denoiser
    attends it like the content (docs/strategies.md §1.3): every key."""
    assert (batch["loss_mask"][batch["attention_mask"] == 0] != 0).all()
    return torch.ones_like(batch["attention_mask"])


def _loss_at(strategy, model, step):
    batch = _batch()
    strategy.begin_step(step)
    batch.update(strategy.corrupt(batch, SEEDS))
    return batch, strategy.loss(model, batch).sums["diffusion"].item()


def test_future_keys_are_drawn_per_sample_above_the_diagonal():
    L = 40
    keys = future_keys(SEEDS, L, 0.3)  # [B, L, L]
    assert keys.shape == (4, L, L) and keys.dtype == torch.bool
    assert not keys.tril().any()  # never a past key or the diagonal: those are always seen
    share = keys.sum().item() / (4 * L * (L - 1) / 2)
    assert 0.25 < share < 0.35
    assert torch.equal(keys, future_keys(SEEDS, L, 0.3))  # same seeds, same draws
    assert torch.equal(keys[1], future_keys(SEEDS[1:2], L, 0.3)[0])  # a sample's own, whatever its batch
    assert not torch.equal(keys[0], keys[1])
    assert not future_keys(SEEDS, L, 0.0).any()
    assert future_keys(SEEDS, L, 1.0).sum() == 4 * L * (L - 1) // 2


def test_step_zero_is_causal_and_step_n_is_bidirectional():
    strategy, model = _strategy(anneal=4)
    batch, first = _loss_at(strategy, model, 0)
    B, L = batch["input_ids"].shape
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)
    causal_logits = logits = _hand_logits(model, batch["noisy_input_ids"], _keys(batch), causal)
    args = (batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"])
    assert math.isclose(first, ref_mdlm_sum(logits, *args), rel_tol=1e-5)

    batch, last = _loss_at(strategy, model, 4)
    assert "future_keys" not in batch
    every = torch.ones(B, L, L, dtype=torch.bool)
    logits = _hand_logits(model, batch["noisy_input_ids"], _keys(batch), every)
    assert math.isclose(last, ref_mdlm_sum(logits, *args), rel_tol=1e-5)
    assert not torch.allclose(causal_logits, logits, atol=1e-3)  # the two masks differ on this batch


def test_midway_sees_the_past_and_the_drawn_future_keys():
    strategy, model = _strategy(anneal=4)
    batch, got = _loss_at(strategy, model, 2)
    L = batch["input_ids"].shape[1]
    drawn = future_keys(SEEDS, L, 2 / 4)
    assert torch.equal(batch["future_keys"], drawn)
    allowed = torch.ones(L, L, dtype=torch.bool).tril() | drawn  # [B, L, L]
    logits = _hand_logits(model, batch["noisy_input_ids"], _keys(batch), allowed)
    want = ref_mdlm_sum(logits, batch["input_ids"], batch["noise_mask"], batch["loss_mask"], batch["p_mask"])
    assert math.isclose(got, want, rel_tol=1e-5)


def test_annealing_leaves_the_noise_draws_alone():
    annealed, _ = _strategy(anneal=4)
    plain, _ = _strategy(anneal=0)
    for s in (annealed, plain):
        s.begin_step(1)
    a, b = annealed.corrupt(_batch(), SEEDS), plain.corrupt(_batch(), SEEDS)
    assert "future_keys" in a and "future_keys" not in b
    for k in ("noisy_input_ids", "noise_mask", "p_mask"):
        assert torch.equal(a[k], b[k])


def test_settings_and_models_that_cannot_anneal_are_refused():
    with pytest.raises(SettingsError, match="dllm.attention_annealing_steps"):
        load_settings(dllm={"mode": "mdlm", "attention_annealing_steps": -1})
    with pytest.raises(SettingsError, match="dllm.attention_annealing_steps: unknown field"):
        load_settings(dllm={"mode": "idlm", "mask_token_id": 3, "attention_annealing_steps": 5})
    strategy = build_strategy(load_settings(dllm={"mode": "mdlm", "attention_annealing_steps": 5}))
    model = _tiny_qwen3()
    model.config.model_type = "llada"  # natively bidirectional: takes no 4D mask
    with pytest.raises(UserError, match=r"dllm.attention_annealing_steps: the llada model .* set dllm"):
        strategy.setup(model, SimpleNamespace(mask_token_id=47), torch.device("cpu"))


def test_an_annealed_run_stopped_and_resumed_matches_the_uninterrupted_run(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.training.trainer import run_training

    recipe = ROOT / "params" / "tiny_mdlm.yaml"
    data = {"limit": 16, "seq_length": 128, "prepared_dir": str(tmp_path / "prepared")}
    prepare(load_settings(recipe, dataset=data))

    def settings(max_steps: int, anneal: int = 3):
        return load_settings(
            recipe, dataset=data, dllm={"attention_annealing_steps": anneal},
            train={"max_steps": max_steps, "global_batch_size": 2, "local_batch_size": 2, "lr": 1e-2,
                   "lr_schedule": "constant", "warmup_steps": 0},
            checkpoint={"every_steps": 1, "save_consolidated": "false"},
        )  # fmt: skip

    whole = run_training(settings(5), tmp_path / "whole").losses
    run_training(settings(2), tmp_path / "parts")
    rest = run_training(settings(5), tmp_path / "parts", resume=True).losses
    assert len(whole) == 5 and len(rest) == 3
    torch.testing.assert_close(torch.tensor(rest), torch.tensor(whole[2:]), rtol=1e-6, atol=0.0)
    plain = run_training(settings(5, anneal=0), tmp_path / "plain").losses
    assert plain[0] != whole[0]  # step 0 attends causally when annealing
