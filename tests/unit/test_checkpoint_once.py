"""A checkpoint is resolved once per evaluation (issue #51): `runs.resolve_checkpoint` (where the export
is) and `runs.recorded_settings` (what was recorded beside it) each run once, at the entry (the flow's
evaluation, `dllmflow evaluate` and `generate`, the pyfunc's load, the gate's re-measure), and what they
resolved (`inference.resolved.ResolvedCheckpoint`) is handed on instead of the path. Calls are counted
by code object, so an import under another name is counted too."""

from __future__ import annotations

import json
import sys
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from _tiny_eval import tiny_eval_export

from dllmflow import runs
from dllmflow.cli import main
from dllmflow.settings import Settings

COUNTED = {
    runs.resolve_checkpoint.__code__: "resolve_checkpoint",
    runs.recorded_settings.__code__: "recorded_settings",
}


@contextmanager
def counted_resolutions():
    calls: Counter[str] = Counter()

    def spy(frame, event, arg):
        if event == "call" and frame.f_code in COUNTED:
            calls[COUNTED[frame.f_code]] += 1

    sys.setprofile(spy)
    try:
        yield calls
    finally:
        sys.setprofile(None)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run dir holding the tiny export (checkpoints/LATEST -> step dir -> model/consolidated)."""
    root = tmp_path_factory.mktemp("once")
    ckpt, settings = tiny_eval_export(root)
    run_dir = root / "run"
    (run_dir / "checkpoints" / "step_000004" / "model").mkdir(parents=True)
    ckpt.rename(run_dir / "checkpoints" / "step_000004" / "model" / "consolidated")
    (run_dir / "checkpoints" / "LATEST").symlink_to("step_000004")
    return run_dir, settings


ONCE = {"resolve_checkpoint": 1, "recorded_settings": 1}


@pytest.mark.parametrize("sweep", [None, {"steps": [2, 4]}], ids=["plain", "sweep"])
def test_the_flows_evaluation_resolves_once(run, sweep):
    from dllmflow.workflow.finetune import evaluate_sampler

    run_dir, settings = run
    s = Settings.coerce(settings.to_dict() | {"eval": {**settings.eval.model_dump(), "sweep": sweep}})
    with counted_resolutions() as calls:
        result = evaluate_sampler(s, str(run_dir), "llada")
    assert calls == ONCE, dict(calls)
    assert result["protocol"]["checkpoint"] == str(runs.find_consolidated(run_dir))  # as recorded before


@pytest.mark.parametrize("sampler", [[], ["--sampler", "llada"]], ids=["default-sampler", "asked-sampler"])
def test_dllmflow_evaluate_and_generate_resolve_once(run, sampler, capsys):
    run_dir, _ = run
    with counted_resolutions() as calls:
        assert main(["evaluate", "--checkpoint", str(run_dir), "--limit", "1", "--steps", "2", *sampler]) == 0
    assert calls == ONCE, dict(calls)
    with counted_resolutions() as calls:
        code = main(["generate", "--checkpoint", str(run_dir), "--prompt", "What is 2 + 3?",
                     "--max-new-tokens", "4", "--steps", "2", *sampler])  # fmt: skip
        assert code == 0, capsys.readouterr().err
    assert calls == ONCE, dict(calls)


def test_the_pyfunc_and_the_server_read_the_records_once(run, tmp_path):
    from dllmflow.inference.dllm_engine import DllmEngine, resolve_served
    from dllmflow.tracking.pyfunc import DllmGenerator

    run_dir, _ = run
    export = runs.find_consolidated(run_dir)
    generation = tmp_path / "generation.json"
    generation.write_text(json.dumps({"sampler": "llada", "sampler_settings": {"steps": 2}, "mode": "mdlm"}))
    with counted_resolutions() as calls:
        DllmGenerator().load_context(
            SimpleNamespace(artifacts={"checkpoint": str(export), "generation": str(generation)})
        )
    assert calls == ONCE, dict(calls)
    with counted_resolutions() as calls:  # serve finds the export with runs.find_export, once per start
        _, served = resolve_served(run_dir)
        DllmEngine(served)
    assert calls == {"recorded_settings": 1}, dict(calls)


def test_the_gates_remeasure_resolves_once(run, monkeypatch):
    from dllmflow.evaluation.accuracy import evaluate
    from dllmflow.tracking import champion

    run_dir, settings = run
    export = runs.find_consolidated(run_dir)
    protocol = evaluate(export, settings, sampler="llada", limit=1)["protocol"]
    monkeypatch.setattr(champion, "download_checkpoint", lambda name, version, dst=None: export)
    version = SimpleNamespace(name="tiny", version="1")
    with counted_resolutions() as calls:
        figure = champion.remeasure(settings, version, protocol, "exact_match_flexible")
    assert calls == ONCE and 0 <= figure <= 1, dict(calls)
