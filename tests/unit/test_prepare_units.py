"""Streaming, fanned-out `dllmflow prepare` (data/stream.py, data/prepare_units.py, data/shards.py): units
run in any order give the bytes and manifest of one process; drops are counted per reason; the join
refuses a missing or altered shard naming it; a retried unit rewrites only its own files; the prepared
split opens memory-mapped without reading rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dllmflow.common.outputs import DirLockedError, hold_dir_lock
from dllmflow.data.dataset import PreparedDataset
from dllmflow.data.prepare import prepare
from dllmflow.data.prepare_units import PrepareJoinError, join_prepare, plan_prepare, run_unit
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Two JSONL files (330 records with malformed JSON, bad UTF-8, an over-long line, blank lines)
    and an empty one."""
    d = tmp_path_factory.mktemp("src")
    lines = []
    for i in range(330):
        if i % 37 == 5:
            lines.append(b"{not json")
        elif i % 41 == 7:
            lines.append(b'{"prompt": "caf\xe9", "completion": "x"}')  # latin-1, not UTF-8
        elif i == 100:
            lines.append(json.dumps({"prompt": "long " * 400, "completion": "y"}).encode())
        else:
            words = " ".join(str((i * 7 + k) % 13) for k in range(3 + i % 11))
            lines.append(json.dumps({"prompt": f"q{i}: {words}?", "completion": f"a {words[::-1]}"}).encode())
        if i % 50 == 0:
            lines.append(b"")
    (d / "a.jsonl").write_bytes(b"\n".join(lines[:200]) + b"\n")
    (d / "b.jsonl").write_bytes(b"\n".join(lines[200:]) + b"\n")
    (d / "c.jsonl").write_bytes(b"")
    return d


def _settings(source: Path, out: Path, **dataset):
    data = {"path_or_dataset_id": str(source), "shard_size": 20, "seq_length": 64, "max_row_bytes": 1500,
            "prepared_dir": str(out), **dataset}  # fmt: skip
    return load_settings(RECIPE, dataset=data)


def _files(d: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".dllmflow.lock"
    }


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "prep"
    return out, prepare(_settings(source, out, task_rows=60))


def test_units_in_any_order_give_the_bytes_and_manifest_of_one_process(source, one_process, tmp_path):
    out1, manifest1 = one_process
    s = _settings(source, tmp_path / "fan", task_rows=60)
    plan = plan_prepare(s)
    n = len(plan["source"]["units"])
    assert n == 6  # 330 records, 60 per unit, cut across the two files
    for k in reversed(range(n)):  # tasks finish in any order
        run_unit(s, plan, k)
    manifest = join_prepare(s, plan)
    assert manifest == manifest1
    assert _files(tmp_path / "fan") == _files(out1)
    # the same rows as one unit over the whole source (the layout before units), in the same order
    whole = prepare(_settings(source, tmp_path / "whole"))
    assert whole["units"] == 1 and whole["content_hash"] != manifest["content_hash"]  # shard cut differs
    for split in ("train", "eval"):
        a, b = PreparedDataset(tmp_path / "fan", split), PreparedDataset(tmp_path / "whole", split)
        assert len(a) == len(b) > 0
        assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]


def test_drops_are_counted_per_reason(one_process):
    _, m = one_process
    reasons = m["dropped_reasons"]
    assert reasons["malformed: line is not UTF-8 text"] == len(
        [i for i in range(330) if i % 41 == 7 and i % 37 != 5]
    )
    assert reasons["malformed: line is not a JSON object"] == len([i for i in range(330) if i % 37 == 5])
    assert reasons["malformed: line longer than dataset.max_row_bytes=1500"] == 1
    assert reasons["empty: file holds no rows"] == 1
    assert m["source"]["rows_read"] == 330
    assert m["dropped"]["malformed"] == sum(v for k, v in reasons.items() if k.startswith("malformed"))
    assert any("c.jsonl: empty" in e for e in m["dropped_examples"])
    assert any("b.jsonl:line" in e and "not UTF-8" in e for e in m["dropped_examples"])


def test_join_refuses_missing_or_altered_shards_and_a_retry_rewrites_only_its_own(source, tmp_path):
    s = _settings(source, tmp_path / "prep", task_rows=60)
    plan = plan_prepare(s)
    staging = Path(plan["staging"])
    records = [run_unit(s, plan, k) for k in range(len(plan["source"]["units"])) if k != 3]
    with pytest.raises(PrepareJoinError, match=r"unit 3 \(.*b\.jsonl\[\d+:\d+\]\) has no record"):
        join_prepare(s, plan)
    run_unit(s, plan, 3)
    victim = next(f for f in records[0]["files"] if f.endswith(".parquet"))
    (staging / victim).write_bytes(b"garbage")
    with pytest.raises(PrepareJoinError, match=f"{victim}: shard of unit 0 does not match its checksum"):
        join_prepare(s, plan)
    (staging / victim).unlink()
    with pytest.raises(PrepareJoinError, match=f"{victim}: shard of unit 0 is missing"):
        join_prepare(s, plan)
    # the retry of unit 0 writes its own files only: every other unit's files keep their inode
    before = {p: p.stat().st_ino for p in staging.rglob("shard-*") if p.name not in records[0]["files"]}
    run_unit(s, plan, 0)
    after = {p: p.stat().st_ino for p in before if p.exists()}
    unit0 = {staging / f for f in records[0]["files"]}
    assert {p: i for p, i in before.items() if p not in unit0} == {
        p: i for p, i in after.items() if p not in unit0
    }
    (staging / victim).with_name(f".{Path(victim).name}.tmp-1").write_bytes(b"a killed attempt's leftover")
    manifest = join_prepare(s, plan)
    assert not list((tmp_path / "prep").rglob(".*.tmp-*")) and not (tmp_path / "prep" / ".units").exists()
    assert set(manifest["files"]) == set(_files(tmp_path / "prep")) - {"manifest.json"} - {
        str(p.relative_to(tmp_path / "prep")) for p in (tmp_path / "prep" / "tokenizer").iterdir()
    }


def test_plan_and_join_hold_the_one_writer_lock(source, tmp_path):
    out = tmp_path / "prep"
    s = _settings(source, out, task_rows=200)
    plan = plan_prepare(s)
    for k in range(len(plan["source"]["units"])):
        run_unit(s, plan, k)
    with hold_dir_lock(out, "another prepare"):
        with pytest.raises(DirLockedError, match="one writer per directory"):
            plan_prepare(s, force=True)
        with pytest.raises(DirLockedError, match="another prepare"):
            join_prepare(s, plan)
    assert not (out / "manifest.json").exists()  # nothing swapped in while the other held it
    join_prepare(s, plan)
    assert plan_prepare(s)["reused"] is not None  # the next plan reuses it: nothing to run


def test_opening_a_split_reads_no_shard_and_a_row_reads_only_its_own(one_process):
    import pyarrow as pa

    out, m = one_process
    ds = PreparedDataset(out, "train")
    store = ds._store
    assert len(ds) == m["splits"]["train"]["rows"] and len(store.paths) > 3
    assert store._layouts == {} and store._fds == {}  # opening read the manifest only
    last = ds[len(ds) - 1]
    assert list(store._layouts) == list(store._fds) == [len(store.paths) - 1]
    # the positioned reads give exactly the rows Arrow reads from the token files
    tables = [pa.ipc.open_file(pa.memory_map(str(out / p))).read_all() for p in store.paths]
    want = pa.concat_tables(tables).to_pylist()
    assert last == want[-1] and [ds[i] for i in range(len(ds))] == want
    assert ds.rows(3) == PreparedDataset(out, "train").rows()[:3]
    assert os.path.getsize(out / store.paths[0]) == m["files"][store.paths[0]]["bytes"]


def test_batched_chat_encoding_equals_one_chat_at_a_time():
    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.tokenizer import encode_chat, encode_chats, train_bpe_tokenizer

    rows = load_gsm8k_rows()[:40]
    tok = train_bpe_tokenizer(
        (m["content"] for r in rows for m in r["messages"]), 400, "<|mask|>", "<|pad|>", "<|eos|>"
    )
    chats = [r["messages"] for r in rows[:20]]
    chats += [  # multi-turn, a system turn, an empty earlier answer, unicode
        [{"role": "system", "content": "Be brief."}, *rows[20]["messages"], *rows[21]["messages"]],
        [*rows[22]["messages"][:1], {"role": "assistant", "content": ""}, *rows[23]["messages"]],
        [{"role": "user", "content": "café ≈ 2€?"}, {"role": "assistant", "content": "ja, ≈ 2 € 🙂"}],
    ]
    for history in (True, False):
        assert encode_chats(tok, chats, history) == [encode_chat(tok, c, history) for c in chats]
