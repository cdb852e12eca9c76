"""DFlash data regeneration as a DVC stage and a Metaflow flow, in a throwaway git + DVC repo: the real
tiny target is bootstrapped, served by a real `dllmflow serve` subprocess and answers every prompt.

`dvc repro regenerate` -> shards load back as chat rows; `dvc repro prepare_dflash` prepares them with
the target's tokenizer and records the shards' hash; `dvc push`, lose cache and outputs, `dvc pull`
-> identical files; RegenerateFlow after losing a shard requests only that shard's prompts; a rerun
requests nothing and starts no server.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from _dvc_repo import file_hashes, init_repo, run

ROOT = Path(__file__).resolve().parents[2]
PARAMS = "params/tiny_dflash_regen.yaml"
SHARDS = Path("data/regenerated/tiny_dflash_regen")
TARGET = Path("data/targets/tiny_qwen3_regen")
PREPARED = Path("data/prepared/tiny_dflash_regen")
STAGES = ("regenerate", "prepare_dflash")

pytestmark = pytest.mark.slow  # DVC, Metaflow and server subprocesses


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """The repo's two regeneration stages, a faster copy of the recipe, the flow and the stage deps."""
    repo = tmp_path / "repo"
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    deps = {d for name in STAGES for d in stages[name]["deps"] if d.startswith("src/")}
    for rel in sorted(deps) + ["flows/regenerate.py", ".gitignore"]:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {n: stages[n] for n in STAGES}}, sort_keys=False)
    )
    recipe = yaml.safe_load((ROOT / PARAMS).read_text())
    # 3 shards of 8 prompts, short answers
    recipe["regenerate"].update(split="train[:24]", shard_size=8, max_new_tokens=16)
    (repo / PARAMS).parent.mkdir(parents=True)
    (repo / PARAMS).write_text(yaml.safe_dump(recipe, sort_keys=False))
    init_repo(repo)
    return repo


def test_regenerate_stage_push_pull_flow_resume(repo: Path, tmp_path: Path, monkeypatch):
    from dllmflow.data.chat import load_chat_rows
    from dllmflow.workflow.regenerate import content_hash, shards_sha256

    # 1) the DVC stage: bootstrap the tiny target, serve it, regenerate 24 prompts into 3 shards
    stdout = run("dvc", "repro", "regenerate", cwd=repo)
    summary = json.loads(next(x for x in stdout.splitlines() if x.startswith('{"rows_total"')))
    assert (summary["rows_written"], summary["shards_written"], summary["requests"]) == (24, 3, 24)
    assert summary["local_server_started"] is True and summary["target_server"] is None
    out = repo / SHARDS
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_server"] is None and manifest["model"] == "tiny-target"
    assert manifest["input_data"] == f"{SHARDS}.source/gsm8k.jsonl"  # relative: the same on any machine
    assert (repo / TARGET / "config.json").is_file()

    # The shards load back as chat rows: the GSM8K prompt, then the target's new answer.
    source = [json.loads(x) for x in (repo / manifest["input_data"]).read_text().splitlines()][:24]
    loaded = load_chat_rows(str(out))
    assert len(loaded.rows) + sum(loaded.dropped.values()) == 24
    rows = [r for f in sorted(out.glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert [r["messages"][:-1] for r in rows] == [s["messages"][:-1] for s in source]
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert [r["original_messages"][-1]["content"] for r in rows] == [
        s["messages"][-1]["content"] for s in source
    ]
    assert any(r["messages"][-1]["content"] != s["messages"][-1]["content"] for r, s in zip(rows, source))

    # 2) prepare with the target's tokenizer; its manifest carries the shards' hash (the lineage key)
    run("dvc", "repro", "prepare_dflash", cwd=repo)
    prepared = json.loads((repo / PREPARED / "manifest.json").read_text())
    assert prepared["source"]["sha256"] == shards_sha256(out) == summary["shards_sha256"]
    target_vocab = json.loads((repo / TARGET / "config.json").read_text())["vocab_size"]
    assert prepared["tokenizer"]["vocab_size"] == target_vocab
    assert prepared["splits"]["train"]["rows"] > 0

    # 3) push, lose the cache and every output, pull: identical files
    outs = [SHARDS, TARGET, PREPARED]
    before = {o: file_hashes(repo / o) for o in outs}
    run("dvc", "remote", "add", "-d", "store", str(tmp_path / "remote"), cwd=repo)
    run("dvc", "push", cwd=repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    for o in outs:
        shutil.rmtree(repo / o)
    run("dvc", "pull", cwd=repo)
    assert {o: file_hashes(repo / o) for o in outs} == before
    assert content_hash(out) == summary["content_hash"]
    assert "up to date" in run("dvc", "status", cwd=repo).lower()

    # 4) the flow after losing the last shard: a new server on a new port, only 8 prompts requested
    kept = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.parquet"))[:2]}
    (out / "shard-000002.parquet").unlink()
    run(sys.executable, "flows/regenerate.py", "--config", "recipe", PARAMS, "run", cwd=repo)
    from metaflow import Flow, namespace

    namespace(None)
    flow_run = Flow("RegenerateFlow").latest_run
    assert flow_run.successful
    regen = flow_run["regenerate"].task.data.regeneration
    assert (regen["shards_resumed"], regen["shards_written"], regen["requests"]) == (2, 1, 8)
    assert regen["local_server_started"] is True
    assert {n: (out / n).read_bytes() for n in kept} == kept  # resumed shards untouched
    assert len(pq.read_table(out / "shard-000002.parquet")) == 8

    # 5) a rerun: every shard is there, nothing is requested and no server starts
    from dllmflow.settings import load_settings
    from dllmflow.workflow.regenerate import regenerate_data

    monkeypatch.chdir(repo)
    again = regenerate_data(load_settings(PARAMS))
    assert (again["requests"], again["rows_written"], again["rows_resumed"]) == (0, 0, 24)
    assert again["local_server_started"] is False
    assert again["content_hash"] == regen["content_hash"]
