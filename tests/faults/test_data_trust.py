"""Prepared data verifies itself (data/prepared_dir.py, data/dataset.py, data/shards.py): a token file or
shard changed, swapped with the other split's, or holding ids outside the vocabulary is one line naming
the file (and the expected and actual hash) before training or evaluation reads a row of it; the
manifest's `content_hash` covers the token files; each file is hashed once per process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dllmflow.common import files
from dllmflow.common.files import sha256_file
from dllmflow.data.dataset import PreparedDataset
from dllmflow.data.prepare import prepare
from dllmflow.data.prepared_dir import PreparedDataError, content_hash, read_manifest
from dllmflow.data.shards import TokenFileError
from dllmflow.errors import UserError
from dllmflow.settings import load_settings


def _source(path: Path, n: int = 80) -> Path:
    # fixed-width numbers: rows of one length, so shards of one row count have one size
    chats = [
        [{"role": "user", "content": f"What is {i:03d} plus {i:03d}?"}, {"role": "assistant", "content": f"{2 * i:03d}"}]
        for i in range(100, 100 + n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def _settings(tmp: Path, **dataset):
    data = {"path_or_dataset_id": str(tmp / "chat.jsonl"), "prepared_dir": str(tmp / "prep"), "seq_length": 64,
            "eval_fraction": 0.5, "shard_size": 4, **dataset}  # fmt: skip
    return load_settings(tokenizer={"train_vocab_size": 300}, dataset=data)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trust")
    _source(tmp / "chat.jsonl")
    prepare(_settings(tmp))
    return tmp / "prep"


@pytest.fixture
def copy(prepared, tmp_path) -> Path:
    """A fresh copy of the prepared dir (new inodes: nothing hashed yet in this process)."""
    out = tmp_path / "prep"
    shutil.copytree(prepared, out)
    return out


def _rebless(d: Path, *, hash_too: bool = True) -> None:
    """Rewrite the manifest's checksums (and content_hash) to the files as they are now: what a tool
    that edits the data and its manifest together would leave."""
    m = read_manifest(d)
    for rel, meta in m["files"].items():
        meta.update(sha256=sha256_file(d / rel), bytes=(d / rel).stat().st_size)
    if hash_too:
        m["content_hash"] = content_hash(d, m)
    (d / "manifest.json").write_text(json.dumps(m))


def _same_size_pair(d: Path, suffix: str) -> tuple[Path, Path]:
    m = read_manifest(d)
    train = [d / f for f in m["files"] if f.startswith("train/") and f.endswith(suffix)]
    evals = [d / f for f in m["files"] if f.startswith("eval/") and f.endswith(suffix)]
    pairs = [(a, b) for a in train for b in evals if a.stat().st_size == b.stat().st_size]
    assert pairs, "the fixture should give a train and an eval file of one size"
    return pairs[0]


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap.tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, UserError)
    return msg


def test_swapped_token_files_of_one_size_are_caught_naming_the_file_and_both_hashes(copy):
    a, b = _same_size_pair(copy, ".tokens.arrow")
    expected = read_manifest(copy)["files"][str(a.relative_to(copy))]["sha256"]
    _swap(a, b)
    ds = PreparedDataset(copy, "train")  # opening reads no shard
    with pytest.raises(PreparedDataError) as err:
        ds[0]
    msg = _one_line(err)
    assert f"{a}: sha256 {sha256_file(a)} does not match the manifest's {expected}" in msg


def test_swapped_parquet_shards_are_caught_before_evaluation_reads_them(copy):
    a, b = _same_size_pair(copy, ".parquet")
    _swap(a, b)
    split = "train" if "train" in str(a.parent) else "eval"
    with pytest.raises(PreparedDataError, match=f"{a}: sha256 "):
        PreparedDataset(copy, split).rows()


@pytest.mark.parametrize("damage", ["every id 5", "sign bit", "low bit every 7th", "offset 2e9", "cut short"])
def test_a_damaged_token_file_is_refused_before_a_row_is_read(copy, damage):
    import numpy as np

    from dllmflow.data.shards import TokenStore

    m = read_manifest(copy)
    rel = m["splits"]["train"]["shards"][0]
    store = TokenStore(copy, [rel], [m["files"][rel]["rows"]])
    at = store._layout(0)
    path = copy / store.paths[0]
    raw = bytearray(path.read_bytes())
    first, last = np.frombuffer(bytes(raw[at["ids_offsets"] :][:8]), np.int32)
    ids = np.frombuffer(raw, np.int32, count=int(last), offset=at["ids"])  # a view: edits land in raw
    if damage == "every id 5":
        ids[:] = 5
    elif damage == "sign bit":
        ids[0] |= np.int32(-(2**31))
    elif damage == "low bit every 7th":
        ids[::7] ^= 1
    elif damage == "offset 2e9":
        raw[at["ids_offsets"] + 4 : at["ids_offsets"] + 8] = np.int32(2_000_000_000).tobytes()
    else:
        raw = raw[: len(raw) // 2]
    path.write_bytes(bytes(raw))
    ds = PreparedDataset(copy, "train")
    with pytest.raises(PreparedDataError) as err:
        ds[0]
    assert str(path) in _one_line(err)


def test_the_reader_bounds_a_row_by_its_file_even_when_the_manifest_was_rewritten(copy):
    """Defence in depth: an offset no writer made (2e9) with a manifest re-blessed to match is a
    TokenFileError naming the file, not `OSError: [Errno 22]` from a multi-GB read."""
    import numpy as np

    m = read_manifest(copy)
    rel = m["splits"]["train"]["shards"][0]
    ds = PreparedDataset(copy, "train")
    at = ds._store._layout(0)
    path = copy / ds._store.paths[0]
    raw = bytearray(path.read_bytes())
    raw[at["ids_offsets"] + 4 : at["ids_offsets"] + 8] = np.int32(2_000_000_000).tobytes()
    path.write_bytes(bytes(raw))
    _rebless(copy)
    with pytest.raises(TokenFileError) as err:
        PreparedDataset(copy, "train")[0]
    assert f"{path}: row 0 spans values" in _one_line(err) and rel


def test_a_token_file_of_two_record_batches_is_refused(copy):
    import pyarrow as pa

    m = read_manifest(copy)
    path = copy / m["splits"]["train"]["shards"][0].replace(".parquet", ".tokens.arrow")
    table = pa.ipc.open_file(str(path)).read_all()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)  # same rows, two batches
    _rebless(copy)
    with pytest.raises(TokenFileError) as err:
        PreparedDataset(copy, "train")[0]
    assert str(path) in _one_line(err) and "record batch" in str(err.value)


def test_ids_outside_the_vocabulary_are_refused_on_open(copy):
    m = read_manifest(copy)
    top = max(meta["ids"][1] for rel, meta in m["files"].items() if "ids" in meta)
    with pytest.raises(
        PreparedDataError, match=r"token ids span \[\d+, \d+\], outside the vocabulary \[0, 10\)"
    ):
        PreparedDataset(copy, "train", vocab_size=10)
    PreparedDataset(copy, "train", vocab_size=top + 1)[0]  # the model's vocabulary holds them: fine
    # ids written with a larger tokenizer's ids, manifest re-blessed but the range is the file's own
    rel = next(r for r in m["files"] if r.startswith("train/") and r.endswith(".tokens.arrow"))
    m["files"][rel]["ids"][1] = m["tokenizer"]["vocab_size"]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PreparedDataError, match=f"{copy / rel}: token ids span"):
        PreparedDataset(copy, "train")


def test_content_hash_covers_token_files_and_tokenizer_and_is_checked_on_open(copy):
    m = read_manifest(copy)
    assert m["content_hash"] == content_hash(copy, m)
    rel = next(r for r in m["files"] if r.endswith(".tokens.arrow"))
    edited = json.loads(json.dumps(m))
    edited["files"][rel]["sha256"] = "0" * 64
    assert content_hash(copy, edited) != m["content_hash"]
    # a token file changed and its manifest entry rewritten to match, content_hash left: refused on open
    (copy / rel).write_bytes((copy / rel).read_bytes()[:-1] + b"\0")
    _rebless(copy, hash_too=False)
    with pytest.raises(PreparedDataError, match="content_hash .* does not match its files and tokenizer"):
        PreparedDataset(copy, "train")
    # the tokenizer replaced (another vocabulary under the same manifest): refused the same way
    _rebless(copy)
    PreparedDataset(copy, "train")
    tok = copy / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<mask>"', '"<MASK>"'))
    with pytest.raises(PreparedDataError, match="content_hash"):
        PreparedDataset(copy, "eval")


def test_a_dir_prepared_before_verification_is_refused_and_rebuilt_by_prepare(tmp_path):
    _source(tmp_path / "chat.jsonl")
    s = _settings(tmp_path)
    first = prepare(s)
    m = read_manifest(tmp_path / "prep")
    for meta in m["files"].values():
        meta.pop("ids", None)
    (tmp_path / "prep" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PreparedDataError, match="prepared before token files were verified"):
        PreparedDataset(tmp_path / "prep", "train")
    again = prepare(s)  # not reused: rebuilt with id ranges
    assert again["content_hash"] == first["content_hash"]
    PreparedDataset(tmp_path / "prep", "train")[0]


def test_each_file_is_hashed_once_per_process(copy, monkeypatch):
    calls = []
    files._sha256_of_version.cache_clear()  # common/files.py holds the per-process hashes
    monkeypatch.setattr(files, "sha256_file", lambda p: calls.append(Path(p).name) or sha256_file(p))
    for _ in range(3):
        ds = PreparedDataset(copy, "train")
        ds[0], ds[len(ds) - 1], ds.rows(2)
    m = read_manifest(copy)
    tokens = [r for r in m["files"] if r.startswith("train/") and r.endswith(".tokens.arrow")]
    assert sorted(calls).count("tokenizer.json") == 1
    assert len([c for c in calls if c.endswith(".tokens.arrow")]) == len(tokens)
    assert len([c for c in calls if c.endswith(".parquet")]) == 1  # rows(2): the first shard only


# ---- the source cannot change under prepare (data/stream.py) -------------------------------------------


def _no_dataset(out: Path) -> bool:
    return not (out / "manifest.json").exists()


def test_a_source_cut_short_while_a_unit_reads_it_is_refused_and_nothing_is_published(tmp_path):
    from dllmflow.data.prepare_units import join_prepare, plan_prepare, run_unit
    from dllmflow.data.stream import SourceChangedError

    src = _source(tmp_path / "chat.jsonl")
    s = _settings(tmp_path)
    full, st = src.read_bytes(), src.stat()
    plan = plan_prepare(s)
    src.write_bytes(full[: len(full) // 3])  # cut short after the plan read it ...
    with pytest.raises(SourceChangedError) as err:
        run_unit(s, plan, 0)
    assert f"{src}: bytes [0, {len(full)}) held 80 records when prepare planned, " in _one_line(err)
    src.write_bytes(full)  # ... and restored byte for byte, mtime too: the join alone would not see it
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(Exception, match="unit 0 .* has no record"):
        join_prepare(s, plan)
    assert _no_dataset(tmp_path / "prep")
    assert prepare(s)["source"]["rows_read"] == 80


def test_a_source_changed_before_the_join_is_refused_and_nothing_is_published(tmp_path, monkeypatch):
    from dllmflow.data import prepare_units
    from dllmflow.data.stream import SourceChangedError

    src = _source(tmp_path / "chat.jsonl")
    size = src.stat().st_size
    real = prepare_units.run_units

    def run_then_append(settings, plan, *args, **kwargs):
        real(settings, plan, *args, **kwargs)
        with open(src, "a") as f:  # a writer still appending when the units finished
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": "late"}, {"role": "assistant", "content": "x"}]}
                )
                + "\n"
            )

    monkeypatch.setattr(prepare_units, "run_units", run_then_append)
    monkeypatch.setattr("dllmflow.data.prepare.run_units", run_then_append)
    with pytest.raises(SourceChangedError) as err:
        prepare(_settings(tmp_path))
    msg = _one_line(err)
    assert (
        f"{src}: changed since prepare planned it (bytes {size} -> " in msg and "nothing was published" in msg
    )
    assert _no_dataset(tmp_path / "prep") and not list(tmp_path.glob(".prep.tmp-*"))


def test_reuse_needs_the_recorded_fingerprint_to_be_the_source_now_by_content(tmp_path):
    src = _source(tmp_path / "chat.jsonl")
    full = src.read_bytes()
    cut = full[: full.index(b"\n", len(full) // 2) + 1]
    src.write_bytes(cut)  # prepared from a truncated file ...
    s = _settings(tmp_path)
    first = prepare(s)
    rec = first["source"]["files"][str(src)]
    assert (
        rec["bytes"] == len(cut)
        and rec["sha256"] == sha256_file(src)
        and rec["mtime_ns"] == src.stat().st_mtime_ns
    )
    src.write_bytes(full)  # ... restored: prepared afresh
    again = prepare(s)
    assert again["source"]["rows_read"] == 80 > first["source"]["rows_read"]
    manifest = tmp_path / "prep" / "manifest.json"
    before = manifest.stat().st_ino
    os.utime(src, ns=(1, 1))  # same bytes, another mtime (a checkout, a copy): reused
    assert prepare(s)["content_hash"] == again["content_hash"] and manifest.stat().st_ino == before


def _die_in_worker(settings: dict, plan: dict, k: int) -> None:  # runs in a spawned prepare worker
    if k == 1:
        os._exit(9)  # as the OOM killer or kill -9 would: no exception, no cleanup


def test_a_killed_prepare_worker_is_one_line_and_its_staging_dir_goes_next_run(tmp_path, monkeypatch):
    from dllmflow.data import prepare_units
    from dllmflow.data.prepare_units import PrepareWorkerError

    _source(tmp_path / "chat.jsonl")
    s = _settings(tmp_path, task_rows=20)
    monkeypatch.setattr(prepare_units, "_run_unit_dict", _die_in_worker)
    with pytest.raises(PrepareWorkerError) as err:
        prepare(s, workers=2)
    assert "a prepare worker died while tokenising unit" in _one_line(err) and "--workers 2" in str(err.value)
    assert _no_dataset(tmp_path / "prep")
    # a prepare killed outright (no cleanup at all) leaves its staging dir and a swap's old copy: the
    # next run of that prepared dir removes them
    (tmp_path / ".prep.tmp-killed" / "train").mkdir(parents=True)
    (tmp_path / ".prep.old-killed").mkdir()
    monkeypatch.undo()
    prepare(s)
    assert not list(tmp_path.glob(".prep.*")) and not _no_dataset(tmp_path / "prep")
    (tmp_path / ".prep.tmp-killed2").mkdir()
    prepare(s)  # reused: still cleaned
    assert not list(tmp_path.glob(".prep.*"))


def test_loose_ends_no_dead_encoders_and_prepare_units_imports_only_public_helpers():
    import ast

    from dllmflow.data import prepare as prepare_mod
    from dllmflow.data import prepare_units

    assert not hasattr(prepare_mod, "encode_row") and not hasattr(prepare_mod, "tokenize_row")
    tree = ast.parse(Path(prepare_units.__file__).read_text())
    names = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "prepared_dir"
        for a in n.names
    ]
    assert names and not [n for n in names if n.startswith("_")]
