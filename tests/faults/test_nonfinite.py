"""Non-finite numbers stop a run: settings reject inf/NaN floats, and a NaN/inf loss or grad norm stops
training before the optimizer step (no checkpoint or export after it), unless `train.max_nonfinite_skips`
allows skipping that many steps."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from dllmflow.errors import UserError
from dllmflow.settings import SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"


# ---- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "NaN"])
def test_lr_inf_nan_rejected_naming_the_field(value):
    with pytest.raises(SettingsError, match=r"train\.lr: must be a finite number"):
        load_settings(RECIPE, **{"train.lr": value})


@pytest.mark.parametrize(
    "key,value",
    [
        ("dllm.eps", math.nan),
        ("train.betas", [math.nan, 0.999]),
        ("train.max_grad_norm", math.inf),
        ("eval.temperature", math.inf),
        ("registry.gate.tolerance", math.inf),
        ("dataset.eval_fraction", math.nan),
    ],
)
def test_every_float_section_rejects_non_finite(key, value):
    with pytest.raises(SettingsError, match=rf"{key.split('.')[0]}\.\w+.*finite"):
        load_settings(RECIPE, **{key: value})


def test_env_inf_rejected(monkeypatch):
    monkeypatch.setenv("DLLMFLOW_TRAIN__LR", "1e999")
    with pytest.raises(SettingsError, match=r"train\.lr: must be a finite number.*env"):
        load_settings(RECIPE)


# ---- training -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("nonfinite-prepared") / "tiny"
    prepare(load_settings(RECIPE, **_data(out)))
    return out


def _data(prepared: Path) -> dict:
    return {"dataset": {"limit": 16, "seq_length": 128, "prepared_dir": str(prepared)}}


def _settings(prepared: Path, **train):
    return load_settings(
        RECIPE,
        **_data(prepared),
        train={"max_steps": 3, "global_batch_size": 2, "local_batch_size": 2, "seed": 0, **train},
        checkpoint={"every_steps": 1, "keep_last": 5, "save_consolidated": "final"},
    )


@pytest.fixture
def nan_at(monkeypatch):
    """Make the loss of the given steps NaN (one micro-batch per step: loss call k is step k).
    Returns the parameter snapshots taken at each loss call."""
    import dllmflow.diffusion.strategies as strategies

    real_build = strategies.build_strategy
    snapshots: list[list[torch.Tensor]] = []

    def install(*steps: int):
        def build(settings):
            strategy = real_build(settings)
            real_loss = strategy.loss

            def loss(model, mb):
                snapshots.append([p.detach().clone() for p in model.parameters()])
                out = real_loss(model, mb)
                if len(snapshots) in steps:
                    out.sums = {k: v * math.nan for k, v in out.sums.items()}
                return out

            strategy.loss = loss
            return strategy

        monkeypatch.setattr(strategies, "build_strategy", build)
        return snapshots

    return install


def _checkpoint_steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def test_nan_loss_stops_before_the_update(prepared, tmp_path, nan_at):
    from dllmflow.runs import read_metrics
    from dllmflow.training.trainer import NonFiniteError, run_training

    nan_at(2)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"^step 2: non-finite loss nan") as e:
        run_training(_settings(prepared), run)
    assert isinstance(e.value, UserError) and "train.lr" in str(e.value)
    assert _checkpoint_steps(run) == ["step_000001"]  # the last complete checkpoint is from before
    assert os.readlink(run / "checkpoints" / "LATEST") == "step_000001"
    assert not list(run.rglob("consolidated"))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def test_skips_allowed_then_continues(prepared, tmp_path, nan_at):
    from dllmflow.runs import read_metrics
    from dllmflow.training.trainer import run_training

    snapshots = nan_at(2)
    result = run_training(_settings(prepared, max_nonfinite_skips=1), tmp_path / "run")
    assert result.final_step == 3 and result.consolidated_dir is not None
    records = read_metrics(result.metrics_path)
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    # the skipped step left the weights as they were; the others updated them
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1]))
    assert all(torch.isfinite(p).all() for p in snapshots[2])


def test_skip_budget_exhausted_fails(prepared, tmp_path, nan_at):
    from dllmflow.training.trainer import NonFiniteError, run_training

    nan_at(2, 3)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"step 3: .*after 1 skipped step\(s\)"):
        run_training(_settings(prepared, max_nonfinite_skips=1), run)
    assert _checkpoint_steps(run) == ["step_000001", "step_000002"]
    assert not list(run.rglob("consolidated"))


def test_huge_lr_fails_with_a_user_error(prepared, tmp_path):
    """lr=1e6 (no injection): the grad norm turns NaN within 3 steps; no export is written."""
    from dllmflow.training.trainer import NonFiniteError, run_training

    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"^step (\d+): non-finite") as e:
        run_training(_settings(prepared, lr=1e6), run)
    failed = int(str(e.value).split(":")[0].split()[1])
    assert _checkpoint_steps(run) == [f"step_{s:06d}" for s in range(1, failed)]
    assert not list(run.rglob("consolidated"))


def test_skip_budget_spans_a_resume(prepared, tmp_path, nan_at):
    """train.max_nonfinite_skips is a budget for the whole run: a run stopped in the middle of a skip
    streak and resumed has the skips it already took counted (trainer_state.json carries them)."""
    import json

    from dllmflow.training.trainer import NonFiniteError, TrainerHook, run_training

    class StopAt(TrainerHook):
        def after_step(self, trainer, step):
            if step == 2:
                raise KeyboardInterrupt  # stands for a killed process: the step-2 checkpoint is written

    nan_at(2, 3)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_training(_settings(prepared, max_nonfinite_skips=1), run, hooks=[StopAt()])
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["nonfinite_skips"] == 1 and state["samples_seen"] == 4
    with pytest.raises(NonFiniteError, match=r"step 3: .*after 1 skipped step\(s\)"):
        run_training(_settings(prepared, max_nonfinite_skips=1), run, resume=True)
    assert _checkpoint_steps(run) == ["step_000001", "step_000002"]
