"""`dllmflow prepare` streams an s3:// source (moto S3, through fsspec/s3fs): the same shards as the
same files read locally, and an object that disappears mid-prepare is a clear error naming it, with
nothing written to `dataset.prepared_dir`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.data.prepare import prepare
from dllmflow.data.prepare_units import plan_prepare, run_unit
from dllmflow.data.stream import SourceReadError
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"


def _lines(first: int, n: int) -> bytes:
    rows = [
        {"prompt": f"What is {i} + {i % 7}?", "completion": f"#### {i + i % 7}"}
        for i in range(first, first + n)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b"{broken\n"


def _settings(source: str, out: Path, **dataset):
    data = {
        "path_or_dataset_id": source,
        "seq_length": 48,
        "shard_size": 40,
        "prepared_dir": str(out),
        **dataset,
    }
    return load_settings(RECIPE, dataset=data)


def test_s3_source_streams_like_local_files_and_a_vanished_object_is_named(s3, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    for name, (first, n) in {"part-a.jsonl": (0, 120), "part-b.jsonl": (120, 90)}.items():
        (local / name).write_bytes(_lines(first, n))
        s3.client().put_object(Bucket=s3.bucket, Key=f"chats/{name}", Body=(local / name).read_bytes())
    url = f"s3://{s3.bucket}/chats"
    from_s3 = prepare(_settings(url, tmp_path / "s3", task_rows=100))
    from_disk = prepare(_settings(str(local), tmp_path / "disk", task_rows=100))
    assert from_s3["units"] == 3 and from_s3["content_hash"] == from_disk["content_hash"]
    assert from_s3["source"]["sha256"] == from_disk["source"]["sha256"]
    assert (
        from_s3["dropped_reasons"]
        == from_disk["dropped_reasons"]
        == {"malformed: line is not a JSON object": 2}
    )
    assert any(e.startswith(f"{url}/part-a.jsonl:line 121") for e in from_s3["dropped_examples"])

    # the object goes away after the plan read it: its unit fails naming it; prepared_dir untouched
    out = tmp_path / "vanish"
    s = _settings(url, out, task_rows=100)
    plan = plan_prepare(s)
    run_unit(s, plan, 0)
    s3.client().delete_object(Bucket=s3.bucket, Key="chats/part-b.jsonl")
    with pytest.raises(SourceReadError, match=rf"{url}/part-b\.jsonl: cannot read .*disappeared"):
        run_unit(s, plan, 2)
    assert sorted(p.name for p in out.iterdir()) == [".dllmflow.lock"]  # no manifest, no shard
