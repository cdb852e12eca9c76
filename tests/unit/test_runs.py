"""`dllmflow.runs`: the run layout's paths, the LATEST pointer, and checkpoint resolution in every
layout (consolidated dir, step dir, checkpoint root, run dir, curriculum run, recipe dir of flow runs),
built in tmp_path with fake HF dirs (a config.json)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dllmflow import runs
from dllmflow.errors import UserError
from dllmflow.runs import RunLayout, find_export, resolve_checkpoint


def _hf_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def _finished_run(run_dir, step=4, mtime=None):
    """A run dir whose LATEST step holds a consolidated export; returns the export."""
    layout = RunLayout(run_dir)
    _hf_dir(runs.export_dir(layout.step_dir(step)))
    runs.write_latest(layout.checkpoints, runs.step_dir_name(step))
    if mtime is not None:
        os.utime(layout.step_dir(step), (mtime, mtime))
    return layout.checkpoints / "LATEST" / "model" / "consolidated"


def test_import_needs_no_torch():
    code = "import sys, dllmflow.runs; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layout_paths(tmp_path):
    run = RunLayout(tmp_path / "r")
    assert run.settings_json == tmp_path / "r" / "settings.json"
    assert run.metrics_jsonl == tmp_path / "r" / "metrics.jsonl"
    assert run.eval_file("llada") == tmp_path / "r" / "eval" / "llada.json"
    assert run.logs_dir == tmp_path / "r" / "logs"
    assert run.step_dir(20) == tmp_path / "r" / "checkpoints" / "step_000020"
    assert run.stage(1).root == tmp_path / "r" / "stage_1"
    assert run.latest_export == tmp_path / "r" / "checkpoints" / "LATEST" / "model" / "consolidated"
    assert runs.flow_run_dir(tmp_path / "r", "17") == tmp_path / "r" / "flow-17"
    assert run.latest_step() is None and run.export() is None and not run.is_finished(4)


def test_latest_symlink_and_txt_fallback(tmp_path, monkeypatch):
    run = RunLayout(tmp_path)
    run.step_dir(2).mkdir(parents=True)
    runs.write_latest(run.checkpoints, "step_000002")
    assert os.readlink(run.checkpoints / "LATEST") == "step_000002"  # relative: the run dir can move
    assert run.latest_step() == run.step_dir(2)
    assert runs.read_latest(run.checkpoints) == run.checkpoints / "LATEST"

    def no_symlinks(*args, **kwargs):
        raise OSError("symlinks not supported")

    monkeypatch.setattr(runs.os, "symlink", no_symlinks)
    run.step_dir(4).mkdir()
    runs.write_latest(run.checkpoints, "step_000004")
    assert (run.checkpoints / "LATEST.txt").read_text() == "step_000004\n"
    assert not list(run.checkpoints.glob("*.tmp"))


def test_is_finished_needs_the_final_step_and_its_export(tmp_path):
    run = RunLayout(tmp_path)
    run.step_dir(4).mkdir(parents=True)
    runs.write_latest(run.checkpoints, "step_000004")
    assert not run.is_finished(4)  # no export yet
    _finished_run(tmp_path, 4)
    assert run.is_finished(4) and not run.is_finished(6)
    assert run.export() == run.latest_export


def test_read_metrics_from_a_run_dir_or_file(tmp_path):
    run = RunLayout(tmp_path)
    assert runs.read_metrics(tmp_path) == []  # before the first step
    run.metrics_jsonl.write_text('{"step": 1}\n{"step": 2}\n{"st')  # a torn last line
    assert runs.read_metrics(tmp_path) == runs.read_metrics(run.metrics_jsonl) == [{"step": 1}, {"step": 2}]


# ---- resolution ------------------------------------------------------------------------------------


def test_consolidated_dir_and_step_dir(tmp_path):
    export = _hf_dir(tmp_path / "step_000004" / "model" / "consolidated")
    assert resolve_checkpoint(export) == export  # as is
    assert resolve_checkpoint(tmp_path / "step_000004") == export  # a step dir
    assert resolve_checkpoint(tmp_path / "step_000004" / "model") == export


def test_checkpoint_root_and_run_dir_via_latest(tmp_path):
    want = _finished_run(tmp_path / "run")
    assert resolve_checkpoint(tmp_path / "run") == want  # run dir: checkpoints/LATEST
    root = tmp_path / "run" / "checkpoints"
    assert resolve_checkpoint(root) == root / "LATEST" / "model" / "consolidated"
    assert runs.find_consolidated(tmp_path / "run") == root / "LATEST" / "model" / "consolidated"


def test_recipe_dir_picks_the_newest_flow_run_with_an_export(tmp_path):
    recipe = tmp_path / "runs" / "tiny_mdlm"
    old = _finished_run(runs.flow_run_dir(recipe, "1"), mtime=1_000)
    new = _finished_run(runs.flow_run_dir(recipe, "2"), mtime=2_000)
    RunLayout(runs.flow_run_dir(recipe, "3")).step_dir(2).mkdir(parents=True)  # newest, but unfinished
    assert resolve_checkpoint(recipe) == new
    os.utime(RunLayout(runs.flow_run_dir(recipe, "1")).step_dir(4), (3_000, 3_000))
    assert resolve_checkpoint(recipe) == old  # by the time of LATEST's target, not by name


def test_curriculum_run_resolves_to_its_last_stage(tmp_path):
    run = RunLayout(tmp_path / "flow-9")
    _finished_run(run.stage(0).root)
    assert resolve_checkpoint(run.root) == run.stage(0).latest_export  # stage 1 not exported yet
    _finished_run(run.stage(1).root)
    assert resolve_checkpoint(run.root) == run.stage(1).latest_export
    # ... and a recipe dir whose flow run is a curriculum
    assert resolve_checkpoint(tmp_path) == run.stage(1).latest_export


def test_nothing_found_is_a_user_error_naming_the_path(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path / 'nope'} does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    empty = tmp_path / "runs" / "tiny"
    runs.flow_run_dir(empty, "1").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"checkpoint {empty} holds no HF model \(config.json\)"):
        resolve_checkpoint(empty)
    assert find_export(empty) is None
