"""DFlash against a REAL pretrained target: SmolLM2-135M-Instruct from PyPI (GGUF, no hub), exported
to an HF dir, tokenises GSM8K, frozen while a 1-layer draft trains two steps; speculative decoding
with the trained draft reproduces the target's own greedy text (lossless)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _acceptance import assert_acceptance_consistent

from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_draft_trains_on_smollm2_and_decodes_losslessly(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.evaluation.acceptance import evaluate_dflash
    from dllmflow.models.offline import export_smollm2
    from dllmflow.training.trainer import run_training

    target = export_smollm2(tmp_path / "smollm2")
    assert (export_smollm2(target) / "config.json").is_file()  # a second call reuses the export
    settings = load_settings(
        ROOT / "params" / "smollm2_dflash.yaml",
        tokenizer={"name_or_path": str(target)},
        dataset={"prepared_dir": str(tmp_path / "prepared"), "limit": 8, "seq_length": 192},
        dflash={"target_model_id": str(target)},
        train={"max_steps": 2, "warmup_steps": 0},
        checkpoint={"every_steps": 2},
        run_dir=str(tmp_path / "run"),
    )
    manifest = prepare(settings)
    assert manifest["tokenizer"]["vocab_size"] == 49152 + 1  # SmolLM2's vocabulary + the added <mask>
    result = run_training(settings)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    report = evaluate_dflash(result.consolidated_dir, settings=settings, limit=1, max_new_tokens=8)
    assert report["metrics"]["lossless"] == 1.0
    assert_acceptance_consistent(report, block_size=int(report["protocol"]["block_size"]))
