"""kill -9 mid-epoch, then --resume: training continues on exactly the next sample (the checkpoint
records the data position, `training/data.py`), so the resumed run's losses are the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from _tiny_run import RECIPE, tiny_run_settings

from _plugins.fault_hooks import with_fault_env
from dllmflow.runs import read_metrics

pytestmark = pytest.mark.slow


def test_kill_9_mid_epoch_resumes_on_the_next_sample(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.training.trainer import run_training

    data = {"dataset": {"limit": 8, "seq_length": 384, "prepared_dir": str(tmp_path / "prep")}}
    settings = tiny_run_settings(tmp_path / "prep", max_steps=6, **data)
    prepare(settings)  # 8 training rows, 2 per step: step 3 ends mid-epoch
    reference = run_training(settings, tmp_path / "ref")
    params = tmp_path / "run.yaml"
    data = settings.to_dict()
    params.write_text(
        yaml.safe_dump(
            {k: data[k] for k in ("dataset", "train", "checkpoint")} | {"run_dir": str(tmp_path / "run")}
        )
    )
    cmd = [sys.executable, "-m", "dllmflow.cli", "train", "--params", str(RECIPE), str(params)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        cmd, capture_output=True, text=True, env=with_fault_env(env, fail_at=3, kill=True)
    )
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]  # via torchrun
    state = json.loads((tmp_path / "run" / "checkpoints" / "LATEST" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["consumed_samples"] == 6 and state["data"]["num_rows"] == 8
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=with_fault_env(env))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-5)
