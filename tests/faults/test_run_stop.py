"""Stopping `dllmflow train` stops the training. torchx starts a local replica in a session of its own,
so a `kill -9` of the CLI's process group left torchrun and its rank training to the end, holding the
run dir's lock: the replica is now tethered to the CLI (`training/tether.py`: SIGTERM on the CLI's
death) and the rank is gone within seconds, its lock free. A SIGTERM of the CLI ends it with one line
naming the signal and --resume (was: a traceback), and the rank stops too. A real tiny run (1 rank,
torchrun under torchx local_cwd) with more steps than it could finish in the test's time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _tiny_run import prepare_tiny, tiny_run_settings

from dllmflow.common.outputs import LOCK_FILE, hold_dir_lock

pytestmark = pytest.mark.slow  # torchrun in a subprocess, twice


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("run-stop-prepared") / "tiny")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):  # gone, also between the signal and the read
        return False
    return not stat.split(") ")[-1].startswith("Z")  # a zombie is dead


def _start(prepared: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, int, Path]:
    """`dllmflow train` in a process group of its own, until its rank holds the run dir: (proc, run
    dir, the rank's pid, the CLI's stderr file)."""
    settings = tiny_run_settings(prepared, 100_000).to_dict()  # hours of steps: only a stop ends it
    settings["checkpoint"]["every_steps"] = 1000
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(settings))
    run_dir, err = tmp_path / "run", tmp_path / "cli.err"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dllmflow.cli", "train", "--params", str(params), "--run-dir", str(run_dir)]
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, err.read_text()[-3000:]
        try:
            holder = json.loads((run_dir / LOCK_FILE).read_text() or "{}")
        except (OSError, ValueError):
            holder = {}
        if holder.get("purpose") == "train" and (run_dir / "metrics.jsonl").is_file():
            return proc, run_dir, int(holder["pid"]), err
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the rank never started training: {err.read_text()[-3000:]}")


def _lock_free(run_dir: Path, within_s: float) -> bool:
    from dllmflow.common.outputs import DirLockedError

    deadline = time.monotonic() + within_s
    while True:
        try:
            with hold_dir_lock(run_dir, "test"):
                return True
        except DirLockedError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def _holders(run_dir: Path) -> list[str]:
    """The processes with the run dir's lock file open (what keeps it held)."""
    lock, out = str(run_dir / LOCK_FILE), []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == lock:
                pid = fd.parts[2]
                out.append(
                    f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:200]!r}"
                )
        except OSError:
            continue
    return out


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid)


def test_kill_9_of_the_cli_group_stops_the_rank_and_frees_the_lock(prepared, tmp_path):
    proc, run_dir, rank, _ = _start(prepared, tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone(rank, 30), f"rank {rank} still trains after its CLI was killed"
        assert _lock_free(run_dir, 30), _holders(run_dir)
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_sigterm_of_the_cli_is_one_line_and_stops_the_rank(prepared, tmp_path):
    proc, run_dir, rank, err = _start(prepared, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        text = err.read_text()
        assert code == 128 + signal.SIGTERM and "Traceback" not in text, text[-3000:]
        last = text.strip().splitlines()[-1]
        assert (
            last.startswith("dllmflow train: stopped by SIGTERM: the run was cancelled")
            and "--resume" in last
        )
        assert _gone(rank, 30), f"rank {rank} still trains after its CLI stopped"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
