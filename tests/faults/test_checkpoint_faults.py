"""Hostile and broken checkpoints on the tiny recipe (in-process `run_training`, 4 steps, a checkpoint
every step, keep_last 3): nothing read from a checkpoint runs code, corruption is named, a broken LATEST
or a corrupt newest checkpoint falls back to the previous complete one with a warning (never a silent
restart, never pruning), and a run never picks up another run's state.

Crash / kill / resume cases kept where they already run (not duplicated here):

    case                                                   test
    rank dies after a checkpoint (FSDP2, 2 procs), resume  integration/test_train.py::test_fsdp2_failing_rank_then_resume_matches_uninterrupted
    LoRA run stopped, resumed == uninterrupted             integration/test_lora_train.py (resume)
    export dies mid-save: LATEST stays on the previous     unit/test_checkpoint.py::test_failed_export_leaves_latest_on_previous_checkpoint
    save/load round trip (model, optimizer, scheduler)     unit/test_checkpoint.py::test_save_then_load_restores_model_optimizer_scheduler
    LATEST replaced atomically; LATEST.txt fallback        unit/test_checkpoint.py, unit/test_runs.py
    flow @retry / resume reuses the run dir and resumes    e2e/test_finetune_flow.py (resume=True when a checkpoint exists)
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dllmflow.errors import UserError
from dllmflow.runs import read_metrics
from dllmflow.settings import load_settings
from dllmflow.training import checkpoint as ckfiles
from dllmflow.training import checkpointer as ckpt
from dllmflow.training.distributed import DistInfo

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
STEPS = 4
INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)


class _Payload:
    """Unpickled by a plain pickle.load, it creates `marker` (stands for any code an attacker runs)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _poison(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(marker)))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from dllmflow.data.prepare import prepare

    out = tmp_path_factory.mktemp("ckpt-faults-prepared") / "tiny"
    prepare(load_settings(RECIPE, **_data(out)))
    return out


def _data(prepared: Path) -> dict:
    return {"dataset": {"limit": 16, "seq_length": 256, "prepared_dir": str(prepared)}}


def _settings(prepared: Path, **train):
    return load_settings(
        RECIPE,
        **_data(prepared),
        train={
            "max_steps": STEPS,
            "global_batch_size": 2,
            "local_batch_size": 2,
            "lr": 1e-2,
            "seed": 0,
            **train,
        },
        checkpoint={"every_steps": 1, "keep_last": 3, "save_consolidated": "false"},
    )


def _train(prepared: Path, run_dir: Path, resume: bool = False, overwrite: bool = False, **train):
    from dllmflow.training.trainer import run_training

    return run_training(_settings(prepared, **train), run_dir, resume=resume, overwrite=overwrite)


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> Path:
    """One uninterrupted run: checkpoints 2, 3, 4 (keep_last 3), LATEST -> step_000004."""
    run = tmp_path_factory.mktemp("ckpt-faults-ref") / "run"
    _train(prepared, run)
    return run


@pytest.fixture
def run(reference, tmp_path) -> Path:
    """A private copy of the reference run to break."""
    dst = tmp_path / "run"
    shutil.copytree(reference, dst, symlinks=True)
    return dst


def _ckpts(run: Path) -> Path:
    return run / "checkpoints"


def _losses(run: Path) -> list[float]:
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in _ckpts(run).glob("step_*"))


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


# ---- 1, 2) poisoned files run no code ---------------------------------------------------------------


def test_poisoned_rng_file_runs_no_code(run, prepared, tmp_path):
    marker = tmp_path / "pwned"
    step = _ckpts(run) / "step_000004"
    target = step / "rng" / "rank_00000.safetensors"
    _poison(target, marker)
    ckfiles.write_manifest(step)  # an attacker who can write the dir rewrites the manifest too
    with pytest.raises(UserError, match=rf"{target.name}: unreadable RNG state"):
        _train(prepared, run, resume=True, max_steps=5)
    assert not marker.exists()


def test_poisoned_dcp_metadata_runs_no_code(run, prepared, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "pwned"
    step = _ckpts(run) / "step_000004"
    metadata = step / "model" / ".metadata"
    _poison(metadata, marker)
    ckfiles.write_manifest(step)
    with pytest.raises(UserError, match=r"model/\.metadata: refused.*io\.open is not allowed"):
        _train(prepared, run, resume=True, max_steps=5)
    assert not marker.exists()
    # the poison is real: torch's own reader (plain pickle.load) runs it
    FileSystemReader(step / "model").read_metadata()
    assert marker.exists()


def test_metadata_allow_list_reads_a_real_checkpoint(reference):
    for part in ("model", "optim"):
        md = ckfiles.read_dcp_metadata(_ckpts(reference) / "step_000004" / part)
        assert md.state_dict_metadata


# ---- 3, 6) checksums: a flipped byte is named; a corrupt newest falls back ----------------------------


def test_flipped_byte_in_the_weights_is_named(run, prepared):
    for step in ("step_000002", "step_000003"):
        shutil.rmtree(_ckpts(run) / step)
    weights = next((_ckpts(run) / "step_000004" / "model").glob("*.distcp"))
    _flip_byte(weights)
    with pytest.raises(ckfiles.CheckpointError, match=rf"{weights.name}: checksum mismatch"):
        ckfiles.verify_checkpoint(weights.parent.parent)
    # the only checkpoint is corrupt: a clear error naming it, nothing deleted or restarted
    with pytest.raises(
        UserError, match=rf"LATEST \(step_000004\) is unusable.*{weights.name}: checksum mismatch"
    ):
        _train(prepared, run, resume=True)
    assert _steps(run) == ["step_000004"] and len(read_metrics(run)) == STEPS


def test_corrupt_newest_falls_back_to_the_previous(run, prepared, reference):
    _flip_byte(next((_ckpts(run) / "step_000004" / "optim").glob("*.distcp")))
    with pytest.warns(
        ckfiles.CheckpointWarning, match="LATEST .step_000004. is unusable.*resuming from step_000003"
    ):
        result = _train(prepared, run, resume=True)
    assert result.final_step == STEPS and result.losses == pytest.approx(_losses(reference)[3:], rel=1e-6)
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-6)
    assert _steps(run) == ["step_000002", "step_000003", "step_000004"]
    ckfiles.verify_checkpoint(_ckpts(run) / "step_000004")  # rewritten whole


# ---- 4) a dangling or garbage LATEST -------------------------------------------------------------------


def _dangling(ckpts: Path) -> None:
    (ckpts / "LATEST").unlink()
    os.symlink("step_000009", ckpts / "LATEST")


def _garbage_txt(ckpts: Path) -> None:
    (ckpts / "LATEST").unlink()
    (ckpts / "LATEST.txt").write_bytes(b"\xff\x00 not a step \n")


def _escaping(ckpts: Path) -> None:
    (ckpts / "LATEST").unlink()
    os.symlink("../../..", ckpts / "LATEST")


@pytest.mark.parametrize(
    "breaker", [_dangling, _garbage_txt, _escaping], ids=["dangling", "garbage", "escaping"]
)
def test_broken_latest_falls_back_to_newest_complete(run, prepared, reference, capsys, breaker):
    shutil.rmtree(_ckpts(run) / "step_000004")  # so the resume has a step left to train
    breaker(_ckpts(run))
    with pytest.warns(ckfiles.CheckpointWarning, match="LATEST.*resuming from step_000003"):
        result = _train(prepared, run, resume=True)
    out = capsys.readouterr().out
    assert "starting from step 0" not in out
    # The fallback reaches the terminal: one line on rank 0's stdout, the stream `dllmflow train` relays.
    assert any(
        ln.startswith("warning: LATEST") and "resuming from step_000003" in ln for ln in out.splitlines()
    )
    assert result.losses == pytest.approx(_losses(reference)[3:], rel=1e-6)
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-6)  # steps 1-3 kept, not rewritten
    assert _steps(run) == ["step_000002", "step_000003", "step_000004"]  # nothing pruned early


def test_resume_with_no_checkpoint_at_all_starts_from_zero(prepared, tmp_path, capsys):
    result = _train(prepared, tmp_path / "new", resume=True, max_steps=1)
    assert result.final_step == 1 and "no checkpoint under" in capsys.readouterr().out


def test_resume_with_only_incomplete_step_dirs_is_an_error(run, prepared):
    for step in _ckpts(run).glob("step_*"):
        (step / "manifest.json").unlink()
    (_ckpts(run) / "LATEST").unlink()
    with pytest.raises(UserError, match="no LATEST pointer.*no other complete checkpoint.*no manifest.json"):
        _train(prepared, run, resume=True)
    assert len(_steps(run)) == 3


# ---- 5) another run's state ---------------------------------------------------------------------------


def test_fresh_run_into_a_used_run_dir_is_refused(run, prepared):
    from dllmflow.training.launch import launch

    before = (run / "settings.json").read_text()
    with pytest.raises(UserError, match=rf"{run}.*already holds checkpoints.*--resume.*--overwrite"):
        _train(prepared, run)
    with pytest.raises(UserError, match="already holds checkpoints"):
        launch(_settings(prepared, lr=1e-3), run_dir=run, wait=False)
    assert (run / "settings.json").read_text() == before  # the old run's record is untouched
    assert _steps(run) == ["step_000002", "step_000003", "step_000004"] and len(read_metrics(run)) == STEPS


def test_overwrite_clears_the_old_run(run, prepared, reference):
    result = _train(prepared, run, overwrite=True, max_steps=2, lr=1e-3)
    assert result.final_step == 2 and _steps(run) == ["step_000001", "step_000002"]
    assert len(read_metrics(run)) == 2 and '"lr": 0.001' in (run / "settings.json").read_text()
    assert result.losses[0] == pytest.approx(_losses(reference)[0], rel=1e-6)  # same init and data


def test_resume_with_other_settings_names_the_fields(run, prepared):
    with pytest.raises(UserError, match=r"other settings \(train\.lr: 0\.01 -> 0\.02\)"):
        _train(prepared, run, resume=True, lr=2e-2)


def test_resume_may_extend_max_steps_and_a_finished_run_reports_its_checkpoint(run, prepared):
    done = _train(prepared, run, resume=True)  # nothing left to train
    assert done.final_step == STEPS and done.checkpoint_dir == _ckpts(run) / "step_000004"
    longer = _train(prepared, run, resume=True, max_steps=STEPS + 1)
    assert longer.final_step == STEPS + 1 and len(longer.losses) == 1


# ---- 7) fsync before the rename that publishes ------------------------------------------------------


def test_files_and_dirs_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, INFO, keep_last=2)
    tmp = str(tmp_path / ".step_000001.tmp")
    publish = events.index(("replace", tmp))
    synced = {path for kind, path in events[:publish] if kind == "fsync"}
    published = tmp_path / "step_000001"
    for p in [published, *published.rglob("*")]:
        was = tmp + str(p)[len(str(published)) :]
        assert was in synced or was + ".tmp" in synced, p  # JSON files: fsynced under their own tmp name


def test_fallback_warning_reaches_the_dllmflow_train_terminal(run, prepared, capsys):
    """Through the launcher (torchx local_cwd -> torchrun -> rank 0), not only in the per-rank log."""
    from dllmflow.training.launch import launch

    shutil.rmtree(_ckpts(run) / "step_000004")
    _dangling(_ckpts(run))
    result = launch(_settings(prepared), run_dir=run, resume=True)
    assert result.state == "SUCCEEDED"
    relayed = [ln for ln in capsys.readouterr().out.splitlines() if "warning: LATEST" in ln]
    assert relayed and "resuming from step_000003" in relayed[0], relayed
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
