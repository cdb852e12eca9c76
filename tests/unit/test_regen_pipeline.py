"""`dllmflow.workflow.regenerate` without a server: source export, settings checks, the external-server path,
hashes against the chat loader's own hash, and the resume rules (no model runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.data.chat import load_chat_rows
from dllmflow.data.gsm8k import load_gsm8k_rows
from dllmflow.data.regen_shards import build_manifest, prepare_output_dir, write_shard
from dllmflow.errors import UserError
from dllmflow.settings import Settings
from dllmflow.workflow.regenerate import (
    _bootstrap_settings,
    check_settings,
    content_hash,
    export_source,
    regenerate_config,
    regenerate_data,
    serve_target,
    shards_sha256,
)


def settings(tmp_path: Path, **regen) -> Settings:
    data = {
        "dllm": {"mode": "dflash"},
        "dflash": {"target_model_id": f"tiny:{tmp_path}/target"},
        "tokenizer": {"name_or_path": f"{tmp_path}/target"},
        "regenerate": {"input_data": "embedded:gsm8k", "output_dir": str(tmp_path / "out"), **regen},
    }
    return Settings.model_validate(data)


def test_export_embedded_writes_every_row_once(tmp_path):
    s = settings(tmp_path)
    path = Path(export_source(s))
    assert path == tmp_path / "out.source" / "gsm8k.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == load_gsm8k_rows()
    mtime = path.stat().st_mtime_ns
    assert export_source(s) == str(path) and path.stat().st_mtime_ns == mtime  # unchanged: not rewritten
    other = settings(tmp_path, input_data="data/chat.jsonl")
    assert export_source(other) == "data/chat.jsonl"


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(UserError, match="regenerate.input_data"):
        check_settings(settings(tmp_path, input_data=None))
    no_target = Settings.model_validate({"regenerate": {"input_data": "x.jsonl"}})
    with pytest.raises(UserError, match="regenerate.target_server"):
        check_settings(no_target)
    with pytest.raises(UserError, match="unknown embedded dataset"):
        export_source(settings(tmp_path, input_data="embedded:nope"))


def test_external_server_is_used_as_is(tmp_path):
    s = settings(tmp_path, target_server="http://gpu-box:30000/v1/", model="qwen")
    with serve_target(s) as url:
        assert url == "http://gpu-box:30000/v1"
    assert not (tmp_path / "target").exists()  # nothing built, nothing started
    assert regenerate_config(s, "x.jsonl").model == "qwen"
    local = regenerate_config(settings(tmp_path), "x.jsonl")
    assert (local.model, local.target_server, local.input_data) == ("dflash-target", None, "x.jsonl")


def test_bootstrap_trains_its_own_tokenizer_for_the_target(tmp_path):
    s = settings(tmp_path)
    boot = _bootstrap_settings(s, "src.jsonl", f"{tmp_path}/target/")
    assert boot.tokenizer.name_or_path is None  # the target's tokenizer does not exist yet: train one
    assert boot.dataset.path_or_dataset_id == "src.jsonl"
    assert boot.dataset.prepared_dir == str(tmp_path / "out.source" / "prepared")
    kept = _bootstrap_settings(s, "src.jsonl", f"{tmp_path}/elsewhere")
    assert kept.tokenizer.name_or_path == f"{tmp_path}/target"


def _fake_run(s: Settings, n_shards: int, source: str) -> Path:
    """Shards + manifest as `regenerate` writes them (hand-made answers)."""
    cfg = regenerate_config(s, source)
    prepare_output_dir(cfg.output_dir, build_manifest(cfg), resume=False)
    for i in range(n_shards):
        msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        write_shard(cfg.output_dir, i, [{"messages": msgs, "original_messages": msgs}], False)
    return Path(cfg.output_dir)


def test_hashes_match_what_prepare_records(tmp_path):
    s = settings(tmp_path, target_server="http://x/v1", model="m")
    out = _fake_run(s, 2, "in.jsonl")
    assert shards_sha256(out) == load_chat_rows(str(out)).sha256  # prepare's manifest source.sha256
    before = content_hash(out)
    manifest = out / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"m"', '"other"'))
    assert content_hash(out) != before  # the manifest counts; the shards-only hash does not move
    assert shards_sha256(out) == load_chat_rows(str(out)).sha256


def test_rerun_with_changed_settings_refuses_naming_the_key(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(2))
    )
    s = settings(
        tmp_path, input_data=str(src), target_server="http://unreachable.invalid/v1", model="m", shard_size=1
    )
    _fake_run(s, 2, str(src))
    done = regenerate_data(s)  # every shard is there: resumed, nothing requested
    assert (done["requests"], done["rows_resumed"], done["local_server_started"]) == (0, 2, False)
    changed = settings(tmp_path, input_data=str(src), target_server="http://unreachable.invalid/v1", model="m",
                       shard_size=1, max_new_tokens=7)  # fmt: skip
    with pytest.raises(UserError, match="max_new_tokens"):
        regenerate_data(changed)
