"""GRPOFlow end to end: a briefly supervised tiny model (trained in-process), then real Metaflow steps:
GRPO through torchx -> torchrun, evaluation, registration in a real SQLite MLflow store with the SFT
parent in its lineage, and the card with the reward curve. Everything under tmp; a few steps only (the
mechanics, not the gain: bench/grpo_addition.py measures that)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_RUN_INFO = """
import base64, json, re
from metaflow import Flow, namespace
from metaflow.cards import get_cards
namespace(None)
run = Flow("GRPOFlow").latest_run
html = get_cards(run["end"].task, id="report")[0].get()
m = re.search(r'__MF_DATA__\\["[^"]+"\\] = "([^"]+)"', html)
print("INFO=" + json.dumps({
    "successful": run.successful,
    "training": run["rl"].task.data.training,
    "registration": run["register"].task.data.registration,
    "evals": run["register"].task.data.evals,
    "card": base64.b64decode(m.group(1)).decode() if m else "",
}, default=str))
"""


def _env(proj: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "DLLM_"))}
    env.update(
        METAFLOW_DATASTORE_SYSROOT_LOCAL=str(proj), MLFLOW_TRACKING_URI=f"sqlite:///{proj / 'mlflow.db'}"
    )
    return env


def _sft_parent(proj: Path) -> tuple[Path, Path]:
    """tiny_addition prepared under `proj` and trained 20 steps in-process: (prepared dir, run dir)."""
    from dllmflow.data.prepare import prepare
    from dllmflow.training.trainer import run_training

    prepared, run = proj / "data" / "prepared", proj / "runs" / "sft"
    settings = load_settings(
        ROOT / "params" / "tiny_addition.yaml",
        dataset={"prepared_dir": str(prepared)},
        train={"max_steps": 20, "log_every": 10},
        checkpoint={"every_steps": 20},
    )
    prepare(settings)
    run_training(settings, run)
    return prepared, run


def test_grpo_flow_trains_evaluates_and_registers_with_its_parent(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "flows").mkdir(parents=True)
    (proj / "params").mkdir()
    shutil.copy(ROOT / "flows" / "grpo.py", proj / "flows" / "grpo.py")
    shutil.copy(ROOT / "params" / "tiny_addition_grpo.yaml", proj / "params" / "tiny_addition_grpo.yaml")
    monkeypatch.chdir(proj)
    prepared, parent = _sft_parent(proj)

    recipe = yaml.safe_load((ROOT / "params" / "tiny_addition_grpo.yaml").read_text())
    recipe["dataset"]["prepared_dir"] = str(prepared)
    recipe["train"].update(max_steps=3, log_every=1)
    recipe["checkpoint"] = {"every_steps": 3}
    recipe["rl"].update(num_generations=2, prompts_per_step=2, eval_every=0)
    recipe["eval"].update(limit=4, batch_size=4)
    recipe["eval"].pop("sweep", None)
    recipe["registry"] = {"model_name": "e2e-grpo", "gate": {"tolerance": 0.0, "min_accuracy": 0.0}}
    (proj / "params" / "grpo.yaml").write_text(yaml.safe_dump(recipe))

    cmd = [
        sys.executable,
        "flows/grpo.py",
        "--config",
        "recipe",
        "params/grpo.yaml",
        "run",
        "--init-from",
        str(parent),
    ]
    proc = subprocess.run(cmd, cwd=proj, env=_env(proj), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    info = subprocess.run([sys.executable, "-c", _RUN_INFO], cwd=proj, env=_env(proj), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert info.returncode == 0, info.stderr[-3000:]
    run = json.loads(next(x for x in info.stdout.splitlines() if x.startswith("INFO="))[5:])
    assert run["successful"]
    rows = [
        json.loads(x) for x in (Path(run["training"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the GRPO metrics of every step, finite
        assert {"reward_mean", "reward_std", "kl", "clip_frac", "entropy", "rollout_tok_s", "nfe"} <= set(r)
        assert 0.0 <= r["reward_mean"] <= 1.1 and r["kl"] >= 0.0
    assert rows[0]["kl"] == 0.0  # step 1: the policy is still the reference
    reg = run["registration"]
    assert reg["version"] == 1
    assert reg["parent"]["parent_init_from"] == str(parent)  # the SFT parent in the lineage
    assert set(run["evals"]) >= {"llada"}
    assert "Mean reward per step" in run["card"]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{proj / 'mlflow.db'}")
    version = client.get_model_version("e2e-grpo", "1")
    assert version.tags.get("parent_init_from") == str(parent)
