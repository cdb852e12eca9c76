"""The package's shape: declared import layers with no cycles (import-linter), and only the CLI,
errors and the run-layout owner at the top of `src/dllmflow/` beside the stage packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "dllmflow"
TOP_MODULES = {"__init__.py", "cli.py", "errors.py", "runs.py", "py.typed"}


def test_import_layers_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_top_of_package_holds_only_cli_errors_runs_and_packages():
    loose = {p.name for p in PKG.iterdir() if p.is_file()} - TOP_MODULES
    assert not loose, f"modules at the top of src/dllmflow/ belong in a stage package: {sorted(loose)}"


# One file per mode / sampler is the house rule, so those folders reuse the mode names on purpose.
PER_MODE_DIRS = {"strategies", "samplers", "masks"}


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.name != "__init__.py" and p.parent.name not in PER_MODE_DIRS:
            names.setdefault(p.stem, []).append(str(p.relative_to(PKG)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}
