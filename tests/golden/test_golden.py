"""Golden-loss guard: the first optimizer steps of every tiny recipe reproduce recorded numbers.

Each `tests/golden/<mode>.json` holds the per-step loss and grad norm of 10 optimizer steps of
`params/tiny_<mode>.yaml` (16 GSM8K rows, seq 256, global batch 4 = 2 micro-batches of 2, seed 0),
recorded from the code at the time. A refactor must reproduce them to 1e-6 relative on CPU; a change
that moves the numbers on purpose regenerates them in the same commit and says why:

    pytest tests/golden --update-golden          # rewrite the files from the current code
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
MODES = ("mdlm", "scdd", "hybrid", "block_diffusion", "dflash", "idlm")
STEPS = 10
REL = 1e-6


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One prepared dataset (the tiny recipes share the embedded GSM8K and the trained BPE)."""
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("golden-prepared") / "tiny"
    prepare(load_settings(ROOT / "params" / "tiny_mdlm.yaml", **_data(out)))
    return out


def _data(prepared: Path) -> dict:
    return {"dataset": {"limit": 16, "seq_length": 256, "prepared_dir": str(prepared)}}


def _trajectory(mode: str, prepared: Path, tmp: Path) -> dict[str, list[float]]:
    from dllmflow.runs import read_metrics
    from dllmflow.training.trainer import run_training

    overrides = {
        **_data(prepared),
        "train": {
            "max_steps": STEPS,
            "global_batch_size": 4,
            "local_batch_size": 2,
            "lr": 1e-2,
            "warmup_steps": 2,
            "seed": 0,
        },
        "checkpoint": {"every_steps": STEPS, "keep_last": 1, "save_consolidated": "false"},
    }
    if mode == "dflash":
        overrides["dflash"] = {"target_model_id": f"tiny:{tmp / 'target'}"}
    settings = load_settings(ROOT / "params" / f"tiny_{mode}.yaml", **overrides)
    torch.manual_seed(1234)  # the trainer must not depend on the caller's global RNG
    result = run_training(settings, tmp / "run")
    records = read_metrics(result.metrics_path)
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


@pytest.mark.parametrize("mode", MODES)
def test_golden_losses(mode, prepared, tmp_path, request):
    got = _trajectory(mode, prepared, tmp_path)
    path = GOLDEN / f"{mode}.json"
    if request.config.getoption("--update-golden"):
        path.write_text(json.dumps({"mode": mode, "steps": STEPS, **got}, indent=1) + "\n")
    want = json.loads(path.read_text())
    assert len(got["loss"]) == STEPS == len(want["loss"])
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=REL), (
            f"{mode} {key} moved from tests/golden/{path.name}"
        )
