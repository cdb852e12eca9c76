"""Training at scale on 2 CPU processes (gloo): FSDP2 over a meta-device build, bf16 mixed precision
and activation checkpointing train the tiny recipe, and a run killed after a checkpoint resumes exactly.

An uninterrupted 2-rank run is the reference (bf16 compute differs from the 1-process fp32 reference);
the killed-then-resumed run must reproduce it step for step. A 2-rank FSDP2 run from a pretrained dir
(rank 0 reads it, the shards are filled by broadcast) starts from the same loss as one process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _prepared import prepare_tiny

from _plugins.fault_hooks import with_fault_env
from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=64)


def _params(prep: Path, run_dir: Path, tmp: Path, **extra) -> Path:
    cfg = {
        "dataset": {"limit": 64, "prepared_dir": str(prep)},
        "train": {
            "max_steps": 4,
            "global_batch_size": 8,
            "local_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 1,
            "dtype": "bfloat16",
            "activation_checkpointing": "full",
        },
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "distributed": {"strategy": "fsdp2"},
        "launch": {"nproc_per_node": 2},
        "run_dir": str(run_dir),
    }
    for name, values in extra.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(
    params: Path, *flags: str, fail_at: int | None = None, rank: int | None = None
) -> subprocess.CompletedProcess:
    e = with_fault_env(dict(os.environ), fail_at, rank)  # fault injection only from the test side
    e.update(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dllmflow.cli", "train", "--params", str(RECIPE), str(params), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=e)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_fsdp2_meta_bf16_ac_trains_and_resumes_exactly(prep, tmp_path):
    ref = _train(_params(prep, tmp_path / "ref", tmp_path))
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _losses(tmp_path / "ref")
    assert len(want) == 4 and all(math.isfinite(x) for x in want) and want[-1] < want[0]

    params = _params(prep, tmp_path / "cut", tmp_path)
    failing = _train(params, fail_at=3, rank=1)
    assert failing.returncode != 0
    resumed = _train(params, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "cut")), torch.tensor(want), rtol=1e-6, atol=0)
    assert (
        tmp_path / "cut" / "checkpoints" / "LATEST" / "model" / "consolidated" / "model.safetensors"
    ).is_file()


def test_fsdp2_from_pretrained_broadcast_matches_one_process(prep, tmp_path):
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.training.trainer import run_training

    torch.manual_seed(5)
    build_model(load_settings(RECIPE), load_tokenizer(prep)).save_pretrained(tmp_path / "base")
    model = {"tiny": None, "pretrained_model_name_or_path": str(tmp_path / "base")}
    train = {"dtype": "float32", "activation_checkpointing": "none", "max_steps": 2}
    res = _train(_params(prep, tmp_path / "pre", tmp_path, model=model, train=train))
    assert res.returncode == 0, res.stderr[-3000:]
    one = load_settings(
        RECIPE,
        dataset={"limit": 64, "prepared_dir": str(prep)},
        model=model,
        train={"max_steps": 2, "global_batch_size": 8, "local_batch_size": 4, "lr": 1e-2, "warmup_steps": 1},
        checkpoint={"every_steps": 2, "save_consolidated": "false"},
    )
    want = run_training(one, tmp_path / "one").losses
    torch.testing.assert_close(
        torch.tensor(_losses(tmp_path / "pre")), torch.tensor(want), rtol=1e-5, atol=1e-5
    )
