"""One writer per run dir, and `--overwrite` never deletes a dir that is not a run dir (issue #21).

In-process `run_training` and the `dllmflow train` launcher on the tiny recipe (2 steps, a checkpoint
every step): while another process holds the run dir (a training, a resume), a second `--resume` is
refused with one line naming the holder's pid and leaves metrics.jsonl as it was (no duplicated
steps); an existing dir without the run marker (settings.json) given as the run dir with
`--overwrite` is refused and left byte for byte untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _tiny_run import prepare_tiny, tiny_run_settings

from dllmflow.common.outputs import LOCK_FILE, DirLockedError, OutputPathError
from dllmflow.runs import read_metrics

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)

_HOLD = """
import sys, time
from dllmflow.common.outputs import hold_dir_lock
with hold_dir_lock(sys.argv[1], "train"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("run-lock-prepared") / "tiny")


def _settings(prepared: Path, max_steps: int):
    return tiny_run_settings(prepared, max_steps)


def _train(prepared: Path, run_dir: Path, max_steps: int, **flags):
    from dllmflow.training.trainer import run_training

    return run_training(_settings(prepared, max_steps), run_dir, **flags)


@pytest.fixture
def holder(tmp_path):
    """Another process holding a run dir's lock, as a running training's rank 0 does."""
    procs = []

    def hold(run_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_second_resume_is_refused_naming_the_holder(prepared, tmp_path, holder):
    from dllmflow.training.launch import launch

    run = tmp_path / "run"
    _train(prepared, run, 2)
    metrics = run / "metrics.jsonl"
    before = metrics.read_bytes()
    proc = holder(run)
    with pytest.raises(DirLockedError, match=rf"{run} is in use by pid {proc.pid} \(train\)"):
        _train(prepared, run, 4, resume=True)
    with pytest.raises(DirLockedError, match=rf"in use by pid {proc.pid}"):
        launch(_settings(prepared, 4), run_dir=run, resume=True, wait=False)
    assert metrics.read_bytes() == before  # the refused writer truncated and appended nothing
    assert os.readlink(run / "checkpoints" / "LATEST") == "step_000002"

    # The holder gone (however it exited), the resume goes on: every step once.
    proc.kill()
    proc.wait()
    time.sleep(0.1)
    result = _train(prepared, run, 4, resume=True)
    assert result.final_step == 4
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]


def test_overwrite_of_a_dir_that_is_not_a_run_dir_is_refused_untouched(prepared, tmp_path):
    from dllmflow.training.launch import launch

    other = tmp_path / "thesis"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "step_000001").mkdir()
    (other / "checkpoints" / "step_000001" / "notes.txt").write_text("mine")
    (other / "metrics.jsonl").write_text("my own measurements\n")

    def snapshot() -> dict[str, bytes]:
        return {
            p.relative_to(other).as_posix(): p.read_bytes() if p.is_file() else b"" for p in other.rglob("*")
        }

    before = snapshot()
    with pytest.raises(
        OutputPathError,
        match=rf"run_dir \(--run-dir\) = {other} .*not a dllmflow run dir \(no settings.json\)",
    ):
        _train(prepared, other, 1, overwrite=True)
    with pytest.raises(OutputPathError, match="not a dllmflow run dir"):
        launch(_settings(prepared, 1), run_dir=other, overwrite=True, wait=False)
    assert snapshot() == before and not (other / LOCK_FILE).exists()


def _foreign(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(the run dir given, what must stay byte for byte) for each kind of path that is not ours."""
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "metrics.jsonl").write_text("my own measurements\n")
    if kind == "file":
        (tmp_path / "notes.txt").write_text("not a dir\n")
        return tmp_path / "notes.txt", tmp_path
    if kind == "settings.json not ours":
        (other / "settings.json").write_text('{"theme": "dark"}\n')
    if kind == "symlink to a foreign dir":
        (tmp_path / "link").symlink_to(other)
        return tmp_path / "link", tmp_path
    return other, tmp_path


@pytest.mark.parametrize(
    "kind", ["file", "foreign dir", "symlink to a foreign dir", "settings.json not ours"]
)
def test_a_fresh_run_never_writes_into_what_is_not_a_run_dir(prepared, tmp_path, kind, capsys, monkeypatch):
    """Without --resume or --overwrite too: a file is not a run dir (was a traceback), a non-empty dir
    (or a link to one) without dllmflow's settings.json is refused (was: written into, the user's
    metrics.jsonl and settings.json replaced), in one line naming it, nothing touched."""
    from dllmflow.cli import main
    from dllmflow.training.launch import launch

    run_dir, root = _foreign(tmp_path, kind)

    def snapshot() -> dict[str, bytes]:
        return {
            p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else b"" for p in root.rglob("*")
        }

    before = snapshot()
    with pytest.raises(OutputPathError, match=rf"run_dir \(--run-dir\) = {run_dir}"):
        launch(_settings(prepared, 1), run_dir=run_dir, wait=False)
    with pytest.raises(OutputPathError, match=rf"{run_dir}"):
        _train(prepared, run_dir, 1)
    store = (
        tmp_path.parent / f"{tmp_path.name}-mlflow.db"
    )  # outside the snapshot: refused before it is opened
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    for cmd, recipe in (("train", "tiny_mdlm.yaml"), ("rl", "tiny_addition_grpo.yaml")):
        code = main([cmd, "--params", str(ROOT / "params" / recipe), "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2 and f"run_dir (--run-dir) = {run_dir}" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert snapshot() == before and not store.exists()
