"""`dllmflow regenerate` writes only into its own output: an `--output-dir` that exists and is not a
regeneration output (a file, a non-empty dir without a manifest, a dir whose manifest.json another tool
wrote, e.g. a prepared dataset) is refused with one line naming the path, before any request, and
nothing in it changes. Its own output (the manifest it wrote) is accepted. No server is needed: the
check comes first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.cli import main
from dllmflow.data.regen_client import regenerate
from dllmflow.data.regen_shards import build_manifest, prepare_output_dir, write_shard
from dllmflow.settings import RegenerateConfig

U = {"role": "user", "content": "q"}


def snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def refuse(capsys, tmp_path: Path, out: Path, *extra: str) -> str:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [U]}) + "\n")
    before = snapshot(out)
    argv = ["regenerate", "--input-data", str(inp), "--output-dir", str(out), "--model", "m"]
    rc = main(
        [*argv, *extra, "--target-server", "http://127.0.0.1:9/v1", "--no-progress", "--log-level", "WARNING"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert snapshot(out) == before  # nothing written, replaced or deleted
    return err


def test_an_existing_file_is_refused(capsys, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    err = refuse(capsys, tmp_path, out)
    assert f"--output-dir = {out} is an existing file" in err


@pytest.mark.parametrize("resume", [False, True])
def test_a_foreign_non_empty_dir_is_refused(capsys, tmp_path, resume):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    err = refuse(capsys, tmp_path, out, *(["--resume"] if resume else []))
    assert f"--output-dir = {out} is a non-empty directory that is not a regeneration output" in err
    assert "no manifest.json" in err and not (out / "manifest.json").exists()


def test_another_tools_manifest_is_refused(capsys, tmp_path):
    """A prepared dataset dir also holds a manifest.json: the name of the marker is not enough."""
    out = tmp_path / "prepared"
    (out / "train").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"source": {"sha256": "abc"}, "num_rows": 3}))
    (out / "train" / "shard-00000.parquet").write_text("tokens")
    err = refuse(capsys, tmp_path, out)
    assert f"--output-dir = {out}: its manifest.json is not a regeneration manifest" in err


def test_its_own_output_is_accepted(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [U]}) + "\n")
    cfg = RegenerateConfig(
        input_data=str(inp),
        output_dir=str(tmp_path / "out"),
        target_server="http://127.0.0.1:9/v1",
        model="m",
    )
    prepare_output_dir(cfg.output_dir, build_manifest(cfg), resume=False)
    write_shard(cfg.output_dir, 0, [{"messages": [U, U], "original_messages": [U]}], False)
    summary = regenerate(cfg, resume=True, progress=False)  # every shard there: nothing requested
    assert (summary["rows_resumed"], summary["requests"], summary["aborted"]) == (1, 0, False)
