"""The scdd, hybrid and I-DLM recipes train end to end (tiny Qwen3, embedded GSM8K, the real trainer).

* `params/tiny_hybrid.yaml` and `params/tiny_idlm.yaml` train in-process with finite, falling loss,
  and export a plain HF causal LM;
* 2 processes (torchrun through torchx) give the same per-step losses as 1 process on the same
  global batch (hybrid under FSDP2, which runs the adapter's two forwards through sharded blocks;
  I-DLM and SCDD under DDP);
* an I-DLM `block_length` curriculum runs as successive fine-tunes, each stage starting from the
  previous stage's consolidated checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _prepared import prepare_tiny

from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
HYBRID = ROOT / "params" / "tiny_hybrid.yaml"
IDLM = ROOT / "params" / "tiny_idlm.yaml"
SCDD = ROOT / "params" / "tiny_scdd.yaml"
pytestmark = pytest.mark.slow


def overrides(prep: Path, **sections) -> dict:
    base = {
        "dataset": {"limit": 32, "seq_length": 256, "prepared_dir": str(prep)},
        "train": {
            "max_steps": 6,
            "global_batch_size": 8,
            "local_batch_size": 4,
            "lr": 1e-2,
            "warmup_steps": 1,
        },
        "checkpoint": {"every_steps": 6, "keep_last": 1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, HYBRID, limit=32, seq_length=256)


def _train(recipe: Path, prep: Path, run_dir: Path, **sections):
    from dllmflow.training.trainer import run_training

    return run_training(load_settings(recipe, **overrides(prep, **sections)), run_dir)


def _assert_learns(result) -> None:
    losses = result.losses
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert min(losses[-2:]) < losses[0] - 0.5, losses


def _assert_plain_export(consolidated: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(consolidated)
    assert type(model).__name__ == "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def hybrid_reference(prep, tmp_path_factory):
    return _train(HYBRID, prep, tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def idlm_reference(prep, tmp_path_factory):
    return _train(IDLM, prep, tmp_path_factory.mktemp("idlm"))


@pytest.fixture(scope="module")
def scdd_reference(prep, tmp_path_factory):
    return _train(SCDD, prep, tmp_path_factory.mktemp("scdd"))


def test_tiny_scdd_trains(scdd_reference):
    _assert_learns(scdd_reference)
    _assert_plain_export(scdd_reference.consolidated_dir)


def test_tiny_hybrid_trains_and_exports_the_plain_model(hybrid_reference):
    _assert_learns(hybrid_reference)
    rec = read_metrics(hybrid_reference.metrics_path)[-1]
    assert 0 < rec["dllm_loss"] < rec["loss"]  # dllm_loss = alpha * diffusion; the AR term adds to it
    _assert_plain_export(hybrid_reference.consolidated_dir)


def test_tiny_idlm_trains_and_exports_the_plain_model(idlm_reference):
    _assert_learns(idlm_reference)
    rec = read_metrics(idlm_reference.metrics_path)[-1]
    assert 0 < rec["dllm_loss"] < rec["loss"]  # dllm_loss = CE_noisy; alpha CE_clean adds to it
    _assert_plain_export(idlm_reference.consolidated_dir)


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [(HYBRID, "fsdp2"), (IDLM, "ddp"), (SCDD, "ddp")],
    ids=["hybrid-fsdp2", "idlm-ddp", "scdd-ddp"],
)
def test_two_processes_match_one(recipe, strategy, prep, tmp_path, request):
    from dllmflow.training.launch import launch

    reference = request.getfixturevalue(f"{recipe.stem.removeprefix('tiny_')}_reference")
    s = load_settings(
        recipe, **overrides(prep, distributed={"strategy": strategy}, launch={"nproc_per_node": 2})
    )
    result = launch(s, run_dir=tmp_path / "run")
    assert result.state == "SUCCEEDED"
    got = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference.losses), rtol=1e-5, atol=1e-5)


def test_idlm_curriculum_runs_successive_fine_tunes(prep, tmp_path):
    from dllmflow.diffusion.strategies.idlm import curriculum_stages
    from dllmflow.training.trainer import run_training

    cfg = overrides(prep, train={"max_steps": 2}, checkpoint={"every_steps": 2})
    s = load_settings(IDLM, **cfg, dllm={"mask_token_id": 2, "block_length": [1, 2]}, run_dir=str(tmp_path))
    stages = curriculum_stages(s)
    results = [run_training(stage) for stage in stages]
    assert [r.run_dir for r in results] == [tmp_path / "stage_0", tmp_path / "stage_1"]
    assert stages[1].model.pretrained_model_name_or_path == str(
        tmp_path / "stage_0" / "checkpoints" / "LATEST" / "model" / "consolidated"
    )
    # Stage 1 starts from stage 0's weights (not a fresh init): its first loss continues the descent.
    assert results[1].losses[0] < results[0].losses[0]
    assert all(math.isfinite(x) for r in results for x in r.losses)
