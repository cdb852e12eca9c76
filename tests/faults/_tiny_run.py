"""The tiny training run the fault tests share: 8 embedded GSM8K rows of `params/tiny_mdlm.yaml` at seq
128, a global batch of 2 on one rank, a checkpoint every step, no consolidated export (seconds a run)."""

from __future__ import annotations

from pathlib import Path

from dllmflow.settings import deep_merge, load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
DATA = {"limit": 8, "seq_length": 128}


def prepare_tiny(out: Path) -> Path:
    from dllmflow.data.prepare import prepare

    prepare(load_settings(RECIPE, dataset={**DATA, "prepared_dir": str(out)}))
    return out


def tiny_run_settings(prepared: Path, max_steps: int, keep_last: int = 2, **extra):
    overrides = {
        "dataset": {**DATA, "prepared_dir": str(prepared)},
        "train": {"max_steps": max_steps, "global_batch_size": 2, "local_batch_size": 2, "seed": 0},
        "checkpoint": {"every_steps": 1, "keep_last": keep_last, "save_consolidated": "false"},
    }
    return load_settings(RECIPE, **deep_merge(overrides, extra))
