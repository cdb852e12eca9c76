"""A `--run-dir` that is a symlink is refused in one line, whatever it points to (README: output paths):
written through, its target (an empty dir, another run) would take a run it was not named for."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllmflow.common.outputs import OutputPathError
from dllmflow.runs import RunLayout
from dllmflow.settings import load_settings
from dllmflow.training.run_dir import check_fresh_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", ["empty dir", "one of our run dirs", "nothing yet"])
def test_a_symlinked_run_dir_is_refused_and_left_untouched(tmp_path, target, capsys, monkeypatch):
    from dllmflow.cli import main

    real = tmp_path / "real"
    if target != "nothing yet":
        real.mkdir()
    if target == "one of our run dirs":
        load_settings(run_dir=str(real)).write_json(real / "settings.json")
    link = tmp_path / "link"
    link.symlink_to(real)
    before = sorted(p.name for p in real.iterdir()) if real.exists() else None
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(
            OutputPathError, match=rf"run_dir \(--run-dir\) = {link} is a symlink \(to {real}\)"
        ):
            check_fresh_run(RunLayout(link), resume, overwrite)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    code = main(["train", "--params", str(ROOT / "params" / "tiny_mdlm.yaml"), "--run-dir", str(link)])
    err = capsys.readouterr().err
    assert (
        code == 2 and "is a symlink" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    )
    assert (sorted(p.name for p in real.iterdir()) if real.exists() else None) == before
