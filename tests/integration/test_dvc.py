"""The repo's `dvc.yaml` in a throwaway git repo: repro, push to a local remote, lose cache and
outputs, pull back byte-identical files; a changed param makes the stage stale."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OUT = Path("data/prepared/tiny")

pytestmark = pytest.mark.slow


def run(*cmd: str, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["prepare"]
    # Only the prepare stage: the dflash regenerate stages have their own test (test_regenerate_flow.py).
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"prepare": stage}}, sort_keys=False))
    needed = [".gitignore", *stage["deps"], *[next(iter(p)) for p in stage["params"]]]
    for rel in needed:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    run("git", "init", "-q", ".", cwd=repo)
    run("git", "config", "user.email", "tests@dllmflow", cwd=repo)
    run("git", "config", "user.name", "tests", cwd=repo)
    run("dvc", "init", "-q", cwd=repo)
    run("git", "add", "-A", cwd=repo)
    run("git", "commit", "-qm", "init", cwd=repo)
    return repo


def test_repro_push_pull_restores_identical_files(repo: Path, tmp_path: Path):
    run("dvc", "repro", cwd=repo)
    out = repo / OUT
    assert (out / "manifest.json").is_file() and (out / "tokenizer").is_dir()
    before = file_hashes(out)
    assert any(k.startswith("train/shard-") for k in before)
    assert "Stage 'prepare' didn't change" in run("dvc", "repro", cwd=repo)

    run("dvc", "remote", "add", "-d", "store", str(tmp_path / "remote"), cwd=repo)
    run("dvc", "push", cwd=repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(out)
    run("dvc", "pull", cwd=repo)
    assert file_hashes(out) == before
    assert "up to date" in run("dvc", "status", cwd=repo).lower()

    # a changed dataset param makes the stage stale
    params = repo / "params" / "tiny_mdlm.yaml"
    text = params.read_text()
    assert "seq_length: 384" in text
    params.write_text(text.replace("seq_length: 384", "seq_length: 200"))
    assert "modified" in run("dvc", "status", cwd=repo)
