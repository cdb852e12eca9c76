"""Fault-injection hooks exist only in code (issue #20): no environment variable, setting or checkpoint
file can make the trainer fail on purpose, and nothing under src reads a fault-injection variable.

The tests' own way in (`tests/_plugins`, put on a child's PYTHONPATH) is shown to work by the kill and
resume tests; here the same variables, set without the plugin, change nothing, and a hook passed in
code does stop the run where asked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _tiny_run import prepare_tiny, tiny_run_settings

from dllmflow.runs import read_metrics
from dllmflow.settings import SettingsError

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("hooks-prepared") / "tiny")


def _settings(prepared: Path, **extra):
    return tiny_run_settings(prepared, 3, keep_last=1, **extra)


class StopAt:
    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"stopped by a hook after step {step}")


def test_fault_variables_do_nothing_without_the_test_plugin(prepared, tmp_path, monkeypatch):
    from dllmflow.training.trainer import run_training

    for name in ("DLLM_FAIL_AT_STEP", "DLLM_TEST_FAIL_AT_STEP", "DLLM_FAIL_RANK", "DLLM_TEST_FAIL_RANK"):
        monkeypatch.setenv(name, "1" if "STEP" in name else "0")
    result = run_training(_settings(prepared), tmp_path / "run")
    assert result.final_step == 3 and [r["step"] for r in read_metrics(result.metrics_path)] == [1, 2, 3]


def test_a_hook_passed_in_code_stops_the_run(prepared, tmp_path):
    from dllmflow.training.trainer import run_training

    with pytest.raises(RuntimeError, match="after step 2"):
        run_training(_settings(prepared), tmp_path / "run", hooks=[StopAt(2)])
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("section", [{"hooks": ["x"]}, {"train": {"fail_at_step": 1}}])
def test_no_setting_takes_a_hook(prepared, section):
    with pytest.raises(SettingsError):
        _settings(prepared, **section)


def test_nothing_under_src_reads_a_fault_variable():
    env_read = re.compile(r"environ(\.get)?[\[(]\s*['\"][A-Z_]*FAIL|getenv\(\s*['\"][A-Z_]*FAIL")
    readers = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "src").rglob("*.py")
        if env_read.search(p.read_text()) or "DLLM_FAIL" in p.read_text() or "DLLM_TEST_FAIL" in p.read_text()
    ]
    assert readers == []
