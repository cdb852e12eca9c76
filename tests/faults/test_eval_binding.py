"""`dllmflow register --eval FILE --run-dir RUN` binds an evaluation to its checkpoint
(tracking/register_cli.py): an evaluation records the export it ran and its weights' hash
(evaluation/protocol.py `checkpoint_record`), and one of another checkpoint is refused in one line
naming both, before anything is logged to MLflow."""

from __future__ import annotations

import json
import os
import shutil
from argparse import Namespace
from pathlib import Path

import pytest

from dllmflow.errors import UserError
from dllmflow.evaluation.protocol import checkpoint_record
from dllmflow.inference.resolved import weights_sha256
from dllmflow.settings import load_settings
from dllmflow.tracking import register_cli


def _run(root: Path, weights: bytes) -> Path:
    """A finished run dir: settings.json and checkpoints/LATEST -> step_000002 holding an export."""
    export = root / "checkpoints" / "step_000002" / "model" / "consolidated"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(weights)
    os.symlink("step_000002", root / "checkpoints" / "LATEST")
    load_settings(run_dir=str(root)).write_json(root / "settings.json")
    return root


def _eval(path: Path, protocol: dict) -> Path:
    path.write_text(
        json.dumps({"metrics": {"exact_match": 0.5}, "protocol": {"sampler": "llada", **protocol}})
    )
    return path


def test_an_evaluation_records_the_export_and_its_weights_hash(tmp_path):
    run = _run(tmp_path / "a", b"weights of a")
    rec = checkpoint_record(run)  # a run dir resolves to its export
    export = (run / "checkpoints" / "step_000002" / "model" / "consolidated").resolve()
    assert rec == {
        "checkpoint": str(run),
        "checkpoint_dir": str(export),
        "checkpoint_sha256": weights_sha256(export),
    }
    assert weights_sha256(_run(tmp_path / "b", b"weights of b")) != rec["checkpoint_sha256"]


def test_register_refuses_an_evaluation_of_another_run_naming_both(tmp_path, monkeypatch):
    a, b = _run(tmp_path / "a", b"weights of a"), _run(tmp_path / "b", b"weights of b")
    ev = _eval(tmp_path / "eval_b.json", checkpoint_record(b))
    logged = []
    monkeypatch.setattr(register_cli, "log_run", lambda *a, **k: logged.append(1))
    monkeypatch.setattr("dllmflow.tracking.model_env.prefetch_wheel", lambda: None)
    args = Namespace(run_dir=str(a), eval_files=[str(ev)], sampler=None)
    with pytest.raises(UserError) as err:
        register_cli.cli_main(args)
    msg = str(err.value)
    assert "\n" not in msg and not logged
    ours, theirs = checkpoint_record(a), checkpoint_record(b)
    assert (
        f"--eval {ev}: it evaluated {theirs['checkpoint_dir']} (weights sha256 {theirs['checkpoint_sha256']})"
        in msg
    )
    assert f"{ours['checkpoint_dir']} (weights sha256 {ours['checkpoint_sha256']})" in msg


def test_the_hash_decides_a_moved_run_registers_its_own_evaluation(tmp_path):
    a = _run(tmp_path / "a", b"weights of a")
    ev = json.loads(_eval(tmp_path / "eval_a.json", checkpoint_record(a)).read_text())
    register_cli.check_eval_binding("eval_a.json", ev, a)  # bound: no error
    moved = tmp_path / "moved"
    shutil.copytree(a, moved, symlinks=True)
    register_cli.check_eval_binding("eval_a.json", ev, moved)  # same weights elsewhere
    (moved / "checkpoints" / "step_000002" / "model" / "consolidated" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="not the export of --run-dir"):
        register_cli.check_eval_binding("eval_a.json", ev, moved)  # same path layout, other weights


def test_an_evaluation_without_a_hash_is_bound_by_its_path(tmp_path):
    a, b = _run(tmp_path / "a", b"weights of a"), _run(tmp_path / "b", b"weights of b")
    register_cli.check_eval_binding("old.json", {"protocol": {"sampler": "llada", "checkpoint": str(a)}}, a)
    with pytest.raises(UserError, match=r"it evaluated .*/b \(weights sha256 None\)"):
        register_cli.check_eval_binding(
            "old.json", {"protocol": {"sampler": "llada", "checkpoint": str(b)}}, a
        )
    with pytest.raises(UserError, match="it evaluated None"):
        register_cli.check_eval_binding("old.json", {"protocol": {"sampler": "llada"}}, a)


def test_an_unreadable_eval_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--eval .*missing.json: cannot read an evaluation"):
        register_cli.read_eval(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="no protocol.sampler"):
        register_cli.read_eval(tmp_path / "x.json")
