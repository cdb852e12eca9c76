"""GRPO end to end on the bundled addition task: a briefly supervised tiny model, then a few GRPO steps.

* 3 steps in-process (2 prompts x G=4, mu=2 updates a step): the mechanics (rewards finite and
  varied, advantages centred per group, KL >= 0 and exactly 0 at step 1 where the policy is the
  reference, the step metrics, the consolidated export);
* the same run through `dllmflow rl` -> torchx -> torchrun, killed by SIGKILL (kill -9) after step 2's
  checkpoint, then `--resume`: every per-step metric equals the in-process run's, bit for bit, and
  the resumed run logs live into MLflow with its SFT parent as a tag;
* 2 CPU ranks (torchrun, gloo, FSDP2), 2 steps, uninterrupted vs killed by SIGKILL after step 1 and
  resumed: the same step metrics and the same final weights, bit for bit (three 2-process launches);
* a reward returning NaN (passed in code): the step is skipped and counted, then the run stops naming
  the prompt and the error, and nothing is exported (in-process, one rank).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _plugins.fault_hooks import with_fault_env
from dllmflow.common.net import free_port
from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
SFT_RECIPE = ROOT / "params" / "tiny_addition.yaml"
RECIPE = ROOT / "params" / "tiny_addition_grpo.yaml"
HERE = Path(__file__).resolve().parent
# what must be identical between the uninterrupted and the resumed run (not timings, memory)
EXACT = ("reward_mean", "reward_std", "loss", "kl", "clip_frac", "ratio_mean", "entropy", "grad_norm",
         "nfe", "tokens_per_step", "advantage_abs_mean", "heldout_em", "lr")  # fmt: skip


def rl_overrides(prep: Path, **rl) -> dict:
    return {
        "dataset": {"limit": 256, "prepared_dir": str(prep)},
        "train": {"max_steps": 3, "log_every": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 3},
        "rl": {
            "prompts_per_step": 2,
            "num_generations": 4,
            "num_iterations": 2,
            "kl_beta": 0.05,
            "rewards": ["exact_match", "format", "_rl_rewards:digits"],
            "reward_weights": [1.0, 0.1, 0.5],
            "eval_every": 3,
            "eval_limit": 8,
            **rl,
        },
    }


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple[Path, Path]:
    """(prepared dir, SFT run dir): 30 supervised steps in-process (a few seconds)."""
    from dllmflow.data.prepare import prepare
    from dllmflow.training.trainer import run_training

    tmp = tmp_path_factory.mktemp("grpo")
    data = {"dataset": {"limit": 256, "prepared_dir": str(tmp / "prep")}}
    prepare(load_settings(SFT_RECIPE, **data))
    s = load_settings(
        SFT_RECIPE,
        **data,
        train={"max_steps": 30, "log_every": 10, "global_batch_size": 32, "local_batch_size": 32},
        checkpoint={"every_steps": 30},
    )
    run_training(s, tmp / "sft")
    return tmp / "prep", tmp / "sft"


def env(tmp: Path) -> dict[str, str]:
    e = with_fault_env(dict(os.environ))
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), e["PYTHONPATH"]])  # the user rewards' module
    e["OMP_NUM_THREADS"] = "1"
    e["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
    return e


def rl_cmd(recipe: Path, sft_dir: Path) -> list[str]:
    return [sys.executable, "-m", "dllmflow.cli", "rl", "--params", str(RECIPE), str(recipe),
            "--init-from", str(sft_dir)]  # fmt: skip


@pytest.mark.slow
def test_grpo_mechanics_and_kill9_resume_is_exact(sft, tmp_path, monkeypatch):
    from dllmflow.rl.grpo_trainer import run_grpo
    from dllmflow.workflow.grpo import starting_settings

    prep, sft_dir = sft
    # 1) the reference: uninterrupted, in-process (one rank)
    monkeypatch.syspath_prepend(str(HERE))
    s, parent = starting_settings(load_settings(RECIPE, **rl_overrides(prep)), str(sft_dir))
    assert parent["parent_export"].endswith("consolidated")
    run_grpo(s, tmp_path / "full")
    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert all(math.isfinite(r[k]) for k in EXACT if k in r), r
        assert r["kl"] >= 0.0 and r["advantage_group_mean_max"] < 1e-5
        assert r["nfe"] == 8 and r["stage"] == "grpo"
    assert records[0]["kl"] == 0.0  # the rollout policy of step 1 is the reference itself
    assert records[-1]["kl"] > 0.0  # ... and no longer after 4 updates
    assert any(r["reward_std"] > 0 and r["advantage_abs_mean"] > 0 for r in records)
    assert 0.0 <= records[-1]["heldout_em"] <= 1.0 and "heldout_em" not in records[0]
    assert (tmp_path / "full" / "checkpoints" / "LATEST" / "model" / "consolidated" / "config.json").is_file()

    # 2) `dllmflow rl` (torchx -> torchrun) killed by SIGKILL after step 2 (checkpointed), then --resume,
    #    live-tracked: the same metrics, bit for bit
    recipe = tmp_path / "killed.yaml"
    recipe.write_text(yaml.safe_dump({**rl_overrides(prep), "run_dir": str(tmp_path / "killed")}))
    cmd = rl_cmd(recipe, sft_dir)
    killed = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=with_fault_env(env(tmp_path), fail_at=2, kill=True),
    )
    assert killed.returncode != 0
    ckpts = tmp_path / "killed" / "checkpoints"
    assert os.readlink(ckpts / "LATEST") == "step_000002"
    assert not (ckpts / "step_000002" / "model" / "consolidated").exists()
    resumed = subprocess.run(
        cmd + ["--resume"], capture_output=True, text=True, env=env(tmp_path), cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3]
    for a, b in zip(records, again):
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}
    from mlflow import MlflowClient

    client = MlflowClient(env(tmp_path)["MLFLOW_TRACKING_URI"])
    run = client.search_runs(
        [client.get_experiment_by_name("dllmflow").experiment_id], order_by=["start_time DESC"]
    )[0]
    assert run.data.tags["dllmflow.parent_init_from"] == str(sft_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/kl")] == [3]  # logged live


def test_failing_reward_skips_then_stops_naming_the_prompt(sft, tmp_path):
    """The failing reward is passed in code (`rewards=[...]`, next to a built-in named), not by recipe."""
    from _rl_rewards import not_a_number

    from dllmflow.rl.grpo_trainer import RewardFailureError, run_grpo
    from dllmflow.workflow.grpo import starting_settings

    prep, sft_dir = sft
    s = load_settings(RECIPE, **rl_overrides(prep, rewards=["exact_match"], reward_weights=None,
                                             max_reward_failures=1, eval_every=0))  # fmt: skip
    s, _ = starting_settings(s, str(sft_dir))
    with pytest.raises(RewardFailureError) as err:
        run_grpo(s, tmp_path / "run", rewards=["exact_match", not_a_number])
    message = str(err.value)
    assert "step 2: reward 'not_a_number' failed on prompt 'What is" in message
    assert "not a finite number" in message and "rl.max_reward_failures=1" in message
    (first,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert first["skipped"] is True and first["reward_failures"] == 1
    assert not list((tmp_path / "run" / "checkpoints").rglob("consolidated"))  # nothing exported


def _two_ranks(run: Path, *extra: str, fail_at: int | None = None) -> subprocess.CompletedProcess:
    """torchrun with 2 CPU ranks (gloo) on `run`/settings.json; `fail_at`: both ranks die by SIGKILL
    right after that step's checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "dllmflow.rl", "--settings", str(run / "settings.json"), *extra]  # fmt: skip
    fault = with_fault_env(env(run), fail_at=fail_at, kill=True) if fail_at else env(run)
    return subprocess.run(cmd, capture_output=True, text=True, env=fault, timeout=600)


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    (path,) = (run / "checkpoints" / "LATEST" / "model" / "consolidated").glob("*.safetensors")
    return load_file(path)


@pytest.mark.slow
def test_two_fsdp2_ranks_resume_after_kill9_with_the_same_metrics_and_weights(sft, tmp_path):
    """2 CPU ranks (gloo, FSDP2: policy and reference sharded, rollouts in lockstep), 2 steps: the run
    killed by SIGKILL after step 1's checkpoint and resumed logs the uninterrupted run's step metrics
    and ends with its weights, bit for bit."""
    import torch

    from dllmflow.workflow.grpo import starting_settings

    prep, sft_dir = sft
    over = rl_overrides(prep, eval_every=0)  # 1 prompt x G=4 per rank, mu=2 updates a step
    over["train"]["max_steps"] = 2
    s = load_settings(RECIPE, **over, launch={"nproc_per_node": 2},
                      distributed={"strategy": "fsdp2", "backend": "gloo"})  # fmt: skip
    s, _ = starting_settings(s, str(sft_dir))
    runs = {name: tmp_path / name for name in ("full", "killed")}
    for run in runs.values():
        run.mkdir()
        s.write_json(run / "settings.json")
    full = _two_ranks(runs["full"])
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _two_ranks(runs["killed"], fail_at=1)
    assert killed.returncode != 0
    assert os.readlink(runs["killed"] / "checkpoints" / "LATEST") == "step_000001"
    resumed = _two_ranks(runs["killed"], "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    want, got = (read_metrics(runs[k] / "metrics.jsonl") for k in ("full", "killed"))
    assert [r["step"] for r in want] == [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert {k: a.get(k) for k in EXACT} == {k: b.get(k) for k in EXACT}
    assert want[1]["kl"] > 0  # step 1's updates moved the policy off the reference
    a, b = _weights(runs["full"]), _weights(runs["killed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sft_weights = _weights(sft_dir)
    assert any(
        not torch.equal(a[k], sft_weights[k]) for k in a.keys() & sft_weights.keys()
    )  # GRPO moved them


@pytest.mark.slow
def test_ar_order_trains_on_left_to_right_rollouts(sft, tmp_path, monkeypatch):
    """JustGRPO's estimator in the runtime: rollouts decoded one token per step left to right (llada,
    block_size 1: 8 forwards for 8 new tokens), scored on their 8-position canvas, 2 steps."""
    from dllmflow.rl.grpo_trainer import run_grpo
    from dllmflow.workflow.grpo import check_rl_settings, starting_settings

    prep, sft_dir = sft
    ar = {"estimator": {"name": "ar_order"}, "sampler": "llada", "sampler_overrides": {"block_size": 1}}
    monkeypatch.syspath_prepend(str(HERE))  # the user reward `_rl_rewards:digits` (varied rewards)
    over = rl_overrides(prep, **ar, eval_every=0)
    over["train"]["max_steps"] = 2
    s, _ = starting_settings(load_settings(RECIPE, **over), str(sft_dir))
    check_rl_settings(s)
    run_grpo(s, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["nfe"] for r in records] == [8, 8]  # one forward per new token: the left-to-right policy
    assert records[0]["kl"] == 0.0 and records[1]["kl"] > 0.0
    assert all(math.isfinite(r[k]) for r in records for k in ("loss", "grad_norm", "ratio_mean"))
