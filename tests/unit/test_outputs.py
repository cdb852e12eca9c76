"""`dllmflow.common.outputs`: output dirs proved ours by their marker, and one writer per dir (a real
second process holds the lock; a killed holder leaves a stale record that is reported and taken over)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dllmflow.common.outputs import (
    LOCK_FILE,
    DirLockedError,
    OutputPathError,
    check_output_dir,
    hold_dir_lock,
)


def test_absent_and_empty_dirs_are_free(tmp_path):
    assert check_output_dir(tmp_path / "new", marker="manifest.json", kind="prepared dataset") is False
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", marker="manifest.json", kind="prepared dataset") is False


def test_our_dir_may_be_replaced(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert check_output_dir(tmp_path, marker="manifest.json", kind="prepared dataset") is True


def test_unrelated_dir_and_file_are_refused_naming_the_path(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="dataset.prepared_dir = .*no manifest.json"):
        check_output_dir(
            tmp_path, marker="manifest.json", kind="prepared dataset", field="dataset.prepared_dir"
        )
    f = tmp_path / "hosts"
    f.write_text("x")
    with pytest.raises(OutputPathError, match="is an existing file"):
        check_output_dir(f, marker="manifest.json", kind="prepared dataset")
    assert f.read_text() == "x" and (tmp_path / "notes.txt").read_text() == "mine"


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from dllmflow.common.outputs import hold_dir_lock
    with hold_dir_lock(sys.argv[1], "train"):
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_second_writer_is_refused_naming_the_pid_then_stale_lock_is_reported(tmp_path, capfd):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirLockedError, match=rf"pid {holder.pid} \(train\)"):
            with hold_dir_lock(tmp_path, "resume"):
                pass
    finally:
        holder.kill()  # SIGKILL: the record stays, the kernel frees the lock
        holder.wait()
    with hold_dir_lock(tmp_path, "resume") as path:
        assert path == tmp_path / LOCK_FILE
    assert f"stale lock of pid {holder.pid}" in capfd.readouterr().err
    with hold_dir_lock(tmp_path, "again"):  # released cleanly: no stale warning the second time
        pass
    assert "stale" not in capfd.readouterr().err
