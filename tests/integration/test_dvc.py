"""The repo's `dvc.yaml` in a throwaway git repo: repro, push to a local remote, lose cache and
outputs, pull back byte-identical files; a changed param makes the stage stale."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from _dvc_repo import file_hashes, init_repo, run

ROOT = Path(__file__).resolve().parents[2]
OUT = Path("data/prepared/tiny")

pytestmark = pytest.mark.slow


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
    return init_repo(repo)


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
