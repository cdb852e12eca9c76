"""Every README command works: the README's runnable shell blocks run as written, in order, in a fresh
clone of the committed HEAD, as a newcomer would paste them into one shell.

    pytest -q tests/e2e/test_readme.py                 # ~3 min on 2 busy CPU cores (slow)
    pytest -q tests/e2e/test_readme.py -m "not slow"   # only the flag check of every `dllmflow` line

The marker: a fenced block whose info string is `bash runnable`, i.e. opened by the line
```` ```bash runnable ````. Plain ```` ```bash ```` blocks (cluster commands, real models, servers left
running) are documentation only; their `dllmflow ...` lines are still parsed by the real CLI parser,
so a renamed subcommand or flag fails here too.

How the blocks run: `git clone` of the worktree's committed HEAD (commit README edits first) into tmp,
with `.venv` linked to the running interpreter's venv and PYTHONPATH on the clone's `src`; Metaflow's
datastore, MLflow's SQLite store, DVC's remote (`$TMPDIR`) all live under tmp. Each block runs with
`bash -xeuo pipefail` from the clone root (xtrace shows each command before its output), and the
environment it exports carries over to the next block, as in one shell. The first failing block fails
the test with the tail of its output; anything it left running (a background server) is killed with
its process group.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "bash runnable"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
BLOCK_TIMEOUT_S = 900


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(text)]


def runnable_blocks(text: str) -> list[str]:
    return [body for info, body in readme_blocks(text) if info == MARKER]


def dllmflow_lines(text: str) -> list[list[str]]:
    """argv (after `dllmflow`) of each `dllmflow ...` command in the README's bash blocks."""
    found = []
    for info, body in readme_blocks(text):
        if info.split()[:1] != ["bash"]:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                words = words[1:]
            if words[:1] == ["dllmflow"]:
                found.append([w for w in words[1:] if w != "&"])
    return found


def test_every_dllmflow_line_parses():
    """Subcommands and flags of every documented `dllmflow` line exist (parse only, nothing runs)."""
    from dllmflow.cli import build_parser

    lines = dllmflow_lines(README.read_text())
    assert len(lines) >= 8, lines
    for argv in lines:
        parser, module = build_parser(argv)
        assert module is not None, f"not a dllmflow subcommand: dllmflow {shlex.join(argv)}"
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"README line does not parse: dllmflow {shlex.join(argv)}")


def _clone_env(clone: Path, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "DLLM_", "MLFLOW_"))}
    env.update(
        PYTHONPATH=str(clone / "src"),  # the venv's editable install points at another checkout
        TMPDIR=str(tmp),  # the README's DVC remote: ${TMPDIR:-/tmp}/dllmflow-dvc-store
        METAFLOW_DEFAULT_DATASTORE="local",
        METAFLOW_DEFAULT_METADATA="local",
        METAFLOW_DATASTORE_SYSROOT_LOCAL=str(clone),
        MLFLOW_TRACKING_URI=f"sqlite:///{clone / 'mlflow.db'}",
        MLFLOW_DISABLE_TELEMETRY="true",
        DLLMFLOW_QUIET="1",  # plain progress lines, as in CI
        USERNAME="readme",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
    )
    return env


def _run_block(body: str, clone: Path, env: dict[str, str], env_file: Path) -> tuple[int, str]:
    """Run one block in a new session; return (exit code, output). The exported environment is saved
    to `env_file` on success so the next block starts where this one left off."""
    script = f"{body}\nenv -0 > {shlex.quote(str(env_file))}\n"
    log = env_file.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-xeuo", "pipefail", "-c", script],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: background jobs die with it below
        )
        try:
            rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, log.read_text(errors="replace")


def _read_env(env_file: Path) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in env_file.read_bytes().decode().split("\0") if "=" in item)
    env = dict(pairs)
    for k in ("SHLVL", "_", "PWD", "OLDPWD"):  # the shell's own bookkeeping
        env.pop(k, None)
    return env


@pytest.mark.slow
def test_readme_runnable_blocks(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    blocks = runnable_blocks(README.read_text())
    assert len(blocks) >= 4, f"expected the README's ```{MARKER} blocks, found {len(blocks)}"
    clone = tmp_path / "dllmflow"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    # The committed README is what runs: say so when it differs from the working tree's.
    committed = (clone / "README.md").read_text()
    assert runnable_blocks(committed) == blocks, "commit README.md first: the clone runs the committed one"
    (clone / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    env = _clone_env(clone, tmp_path)
    for i, body in enumerate(blocks, 1):
        env_file = tmp_path / f"block{i}.env"
        rc, output = _run_block(body, clone, env, env_file)
        if rc != 0:
            pytest.fail(
                f"README runnable block {i}/{len(blocks)} failed (exit {rc}):\n{body}\n"
                f"--- output (last 8000 chars) ---\n{output[-8000:]}",
                pytrace=False,
            )
        env = _read_env(env_file)
    # A newcomer's commands leave the checkout as they found it (dvc.lock current, outputs ignored).
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert not dirty.strip(), f"the README's commands changed the checkout:\n{dirty}"
