"""The evaluation path stays short (issue #51): following the run dir from the flow's evaluation
(`finetune.evaluate_sampler`, `grpo.evaluate`) through the calls that pass it on (scripts/call_path.py,
static), it goes back into a module it had already left at most CEILING times. Before the checkpoint
was resolved once into `inference.resolved.ResolvedCheckpoint` it went back 32 times (17 modules);
the issue's goal is 13, reached once the run's export, settings and training were read in one look
(`resolve_run`), the loaders checked weights around one load (`integrity.load_checked`) and the
evaluations took the resolved export instead of the run dir. A ratchet: lower it, never raise it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "call_path.py"
CEILING = 13


def _call_path():
    spec = importlib.util.spec_from_file_location("call_path", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "entry", ["dllmflow.workflow.finetune:evaluate_sampler", "dllmflow.workflow.grpo:evaluate"]
)
def test_the_evaluation_path_goes_back_into_a_module_at_most_the_ceiling(entry):
    walk = _call_path().measure(entry, "run_dir")
    backs = [f"{a}.{b}:{line} -> {c}.{d}" for a, b, c, d, line in walk.back_edges]
    assert len(backs) <= CEILING, "\n".join(backs)
    # the checkpoint is resolved in one place (inference/resolved.py), not again further down
    resolutions = [
        s
        for s in walk.steps
        if s[3] in ("resolve_checkpoint", "find_consolidated") and s[0] != "dllmflow.runs"
    ]
    assert len(resolutions) <= 1, resolutions


def test_the_measure_follows_what_carries_the_checkpoint(tmp_path):
    """A value built from the checkpoint is followed; one that only names it in a message is not."""
    pkg = tmp_path / "dllmflow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from dllmflow import b\n\n"
        "def entry(run_dir):\n"
        "    export = b.find(run_dir)\n"
        "    b.use(export)\n"
        "    label = b.describe(run_dir)\n"
        "    b.use(label)\n"
        "    b.use(export)\n"
    )
    (pkg / "b.py").write_text(
        "from pathlib import Path\n\n"
        "def find(p):\n    return Path(p) / 'export'\n\n"
        "def describe(p):\n    return 'a label'\n\n"
        "def use(x):\n    return None\n"
    )
    call_path = _call_path()
    call_path.SRC = tmp_path
    walk = call_path.measure("dllmflow.a:entry", "run_dir")
    assert [s[3] for s in walk.steps] == ["find", "use", "describe", "use"]
    assert walk.modules == ["dllmflow.a", "dllmflow.b"] and len(walk.back_edges) == 3
