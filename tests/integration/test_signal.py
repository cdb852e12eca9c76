"""The evaluation signal is real: a tiny mdlm model overfit (in-process trainer) on 16 short GSM-style
chats answers them with clearly higher exact match than the same untrained model. No claim about
held-out accuracy (a CPU-sized model trained from scratch scores ~0 there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllmflow.data.prepare import prepare
from dllmflow.data.tokenizer import load_tokenizer
from dllmflow.data.toy import overfit_settings
from dllmflow.evaluation.accuracy import evaluate
from dllmflow.models.build import build_model
from dllmflow.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[2]


def subset_settings(root: Path, steps: int):
    return overfit_settings(root, steps, ROOT / "params" / "tiny_mdlm.yaml", max_new_tokens=16, steps=16)


@pytest.mark.slow
def test_overfit_subset_beats_untrained(tmp_path):
    settings = subset_settings(tmp_path, steps=300)
    prepare(settings)

    # the untrained baseline: the same architecture and init seed, saved as a consolidated dir
    untrained = tmp_path / "untrained"
    torch.manual_seed(settings.train.seed)
    tok = load_tokenizer(settings.dataset.prepared_dir)
    build_model(settings, tok).save_pretrained(untrained)
    tok.save_pretrained(untrained)
    settings.write_json(untrained / "settings.json")

    run_training(settings, settings.run_dir)
    before = evaluate(untrained, split="train")["metrics"]
    after = evaluate(Path(settings.run_dir) / "checkpoints", split="train")
    assert before["num_examples"] == after["metrics"]["num_examples"] == 16
    assert before["exact_match_strict"] <= 0.125
    assert after["metrics"]["exact_match_strict"] >= 0.75, after["predictions"][:4]
    assert after["metrics"]["exact_match_strict"] >= before["exact_match_strict"] + 0.5
