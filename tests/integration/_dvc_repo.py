"""Helpers of the DVC integration tests: run commands in a throwaway git + DVC repo, hash its files."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The test environment without settings overrides, with a git identity for commits."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "DLLM_"))}
    out.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return out


def run(*cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def init_repo(repo: Path) -> Path:
    """git init + dvc init + one commit of what is already in `repo`."""
    for cmd in (
        ["git", "init", "-q", "."],
        ["dvc", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "init"],
    ):
        run(*cmd, cwd=repo)
    return repo


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_prepare_stage(repo: Path) -> dict:
    """The checkout's `prepare` stage into `repo` (its dvc.yaml alone), with every dep, param file and the
    .gitignore it needs; -> the stage."""
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["prepare"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"prepare": stage}}, sort_keys=False))
    for rel in [".gitignore", *stage["deps"], *[next(iter(p)) for p in stage["params"]]]:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    return stage
