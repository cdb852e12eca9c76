"""`params/tiny_dflash.yaml` trains end to end (frozen tiny Qwen3 target, embedded GSM8K, the real
trainer): finite falling loss, draft accuracy logged every step, an export holding only the draft,
and speculative decoding from that export is lossless against the target's greedy decoding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _acceptance import assert_acceptance_consistent

from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_dflash.yaml"
pytestmark = pytest.mark.slow


def test_tiny_dflash_trains_exports_the_draft_and_decodes_losslessly(tmp_path):
    from safetensors import safe_open

    from dllmflow.data.prepare import prepare
    from dllmflow.evaluation.acceptance import evaluate_dflash
    from dllmflow.training.trainer import run_training

    prep, target = tmp_path / "prepared", tmp_path / "target"
    settings = load_settings(
        RECIPE,
        dataset={"limit": 32, "seq_length": 256, "prepared_dir": str(prep)},
        dflash={"target_model_id": f"tiny:{target}"},
        train={"max_steps": 6, "global_batch_size": 8, "local_batch_size": 4, "lr": 1e-2, "warmup_steps": 1},
        checkpoint={"every_steps": 6, "keep_last": 1},
    )
    prepare(settings)
    result = run_training(settings, tmp_path / "run")

    losses = result.losses
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert min(losses[-2:]) < losses[0], losses
    for rec in read_metrics(result.metrics_path):
        assert 0.0 <= rec["draft_acc"] <= 1.0 and all(f"draft_acc_k{k}" in rec for k in range(1, 8))

    export = result.consolidated_dir
    with safe_open(export / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(not k.startswith(("model.", "lm_head")) for k in keys)  # no target weights
    report = evaluate_dflash(export, settings, limit=2, max_new_tokens=16)
    m = report["metrics"]
    assert m["lossless"] == 1.0 and m["num_examples"] == 2
    assert_acceptance_consistent(report, block_size=int(report["protocol"]["block_size"]))
