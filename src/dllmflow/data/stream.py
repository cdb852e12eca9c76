"""The source of `dllmflow prepare` as units of work, read as a stream (docs/contracts.md, prepare).

    source = plan_source(dcfg)               # SourcePlan: sha256, units, plan-time drops
    out = ChatSource(rows=[])                # drop counts and examples land here
    for row in iter_unit(dcfg, source.units[k], out): ...

The source's records (JSONL lines that are not blank, parquet rows, a HF dataset's rows, an embedded
set's or a mixture's rows), in order across its files, are cut every `dataset.task_rows` records: unit
k is records [k * task_rows, (k + 1) * task_rows), a list of segments (a byte range of a JSONL file,
row groups of a parquet file, an index range). The cut is a pure function of the source, so one
process reading every unit in turn and one task per unit read the same records; a source under
`task_rows` records is one unit (the layout of a prepare before units). The plan reads each file once
(its sha256 and, for JSONL, the byte offset of each cut); a unit reads only its segments, a chunk
of lines or a parquet batch at a time. Embedded sets and mixtures are built in memory (a mixture
samples from whole sources) and cut by index.

The source cannot change under prepare: the plan records each file's fingerprint (`bytes`, `mtime_ns`
and `sha256`; an object store's `etag` / `version_id` too) around its own read, a JSONL unit checks it
read every record the plan counted in its byte range, and `check_source_unchanged` (the join, before
anything is published) fingerprints the files again. Any difference is a `SourceChangedError` naming
the file and what changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from dllmflow.errors import UserError

from .chat import (
    FILE_SUFFIXES,
    ChatSource,
    _data_files,
    _jsonl_records,
    convert_record,
    load_hf_dataset,
    open_binary,
)
from .formats import RowSpec
from .gsm8k import EMBEDDED_PREFIX

PARQUET_BATCH = 1024  # parquet rows decoded at a time
EMPTY_FILE = "empty: file holds no rows"


@dataclass(frozen=True)
class Segment:
    kind: str  # "jsonl" | "parquet" | "hf" | "rows"
    path: str  # file, HF dataset id, or "" (the embedded set / mixture the settings name)
    start: int  # jsonl: byte offset; parquet: first row group; hf / rows: first index
    stop: int  # exclusive, same unit as start
    first: int = 0  # records of this file before `start` (default ids)
    line: int = 0  # jsonl: lines before `start` (line numbers in drop examples)
    count: int = 0  # records in the segment (for progress)


@dataclass
class SourcePlan:
    sha256: str
    files: list[str]
    units: list[list[Segment]]
    dropped: dict[str, int] = field(default_factory=dict)  # found while planning (an empty file)
    examples: list[str] = field(default_factory=list)
    columns: dict[str, list[str]] = field(default_factory=dict)  # parquet file -> its columns
    fingerprint: dict[str, dict] = field(default_factory=dict)  # file -> bytes, mtime_ns, sha256 (etag)

    def to_dict(self) -> dict:
        return {**asdict(self), "units": [[asdict(s) for s in u] for u in self.units]}

    @classmethod
    def from_dict(cls, d: dict) -> SourcePlan:
        return cls(**{**d, "units": [[Segment(**s) for s in u] for u in d["units"]]})


class _Cutter:
    """Groups a stream of records (or parquet row groups) into units: a new unit starts before the
    next record once the current one holds `every` (None: never)."""

    def __init__(self, every: int | None):
        self.every, self.since = every, 0
        self.units: list[list[Segment]] = [[]]

    def due(self) -> bool:
        return self.every is not None and self.since >= self.every

    def new_unit(self) -> None:
        if self.units[-1]:
            self.units.append([])
        self.since = 0

    def result(self) -> list[list[Segment]]:
        return [u for u in self.units if u] or [[]]


def spec_of(dcfg) -> RowSpec:
    return RowSpec.build(dcfg.format, dcfg.fields, dcfg.messages_column)


def plan_source(dcfg) -> SourcePlan:
    """Fingerprint and units of the source `dcfg` (a DatasetConfig) names; see the module docstring."""
    every = None if dcfg.limit is not None else dcfg.task_rows  # `limit` counts over the whole source
    source = dcfg.path_or_dataset_id
    if dcfg.mixture is not None or source.startswith(EMBEDDED_PREFIX):
        return _plan_rows(dcfg, every)
    if "://" in source:
        return _plan_files(_url_files(source), dcfg, every)
    path = Path(source).expanduser()
    if path.exists():
        files = _data_files(path)
        return _plan_files(
            [(str(f), f.name if f == path else str(f.relative_to(path))) for f in files], dcfg, every
        )
    if source.endswith(FILE_SUFFIXES) or source.startswith((".", "/", "~")):
        raise UserError(f"dataset.path_or_dataset_id: {source}: no such file or directory")
    return _plan_hf(dcfg, every)


def _index_units(kind: str, path: str, n: int, every: int | None) -> list[list[Segment]]:
    step = every or max(n, 1)
    return [[Segment(kind, path, a, min(a + step, n), first=a, count=min(a + step, n) - a)]
            for a in range(0, max(n, 1), step)]  # fmt: skip


def _plan_rows(dcfg, every: int | None) -> SourcePlan:
    from .prepared_dir import load_source

    src = load_source(dcfg)  # in memory: a mixture samples across whole sources
    plan = SourcePlan(src.sha256, src.files, _index_units("rows", "", len(src.rows), every))
    for f in src.files:  # each unit loads them again: the join checks they stayed what was hashed here
        if "://" in f or Path(f).is_file():
            plan.fingerprint[f] = {**file_stat(f), "sha256": _sha256_of(f)}
    return plan


def _plan_hf(dcfg, every: int | None) -> SourcePlan:
    ds = _load_hf_dataset(dcfg, spec_of(dcfg))
    name = dcfg.path_or_dataset_id
    files = [f"{name}:{dcfg.split}"]
    return SourcePlan(f"datasets:{ds._fingerprint}", files, _index_units("hf", name, len(ds), every))


def _url_files(url: str) -> list[tuple[str, str]]:
    """(URL, name relative to `url`) of the data files an fsspec URL names: the object itself, or a
    prefix's shard-*.parquet, else its .jsonl/.json/.parquet objects (as for a local directory)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    protocol = url.split("://", 1)[0]
    try:
        if fs.isfile(root):
            return [(url, root.rsplit("/", 1)[-1])]
        found = sorted(fs.find(root))
    except OSError as e:
        raise UserError(
            f"dataset.path_or_dataset_id: {url}: cannot list ({e.__class__.__name__}: {e})"
        ) from None
    shards = [p for p in found if p.rsplit("/", 1)[-1].startswith("shard-") and p.endswith(".parquet")]
    files = shards or [p for p in found if p.endswith(FILE_SUFFIXES) and not p.endswith("/manifest.json")]
    if not files:
        raise UserError(f"dataset.path_or_dataset_id: {url}: no .jsonl or .parquet objects there")
    return [(f"{protocol}://{p}", p[len(root.rstrip("/")) + 1 :]) for p in files]


def _plan_files(files: list[tuple[str, str]], dcfg, every: int | None) -> SourcePlan:
    digest, cutter = hashlib.sha256(), _Cutter(every)
    plan = SourcePlan("", [], [])
    for f, rel in files:
        plan.files.append(f)
        try:
            before = file_stat(f)
            if f.endswith(".parquet"):
                file_hash, records = _sha256_of(f), _cut_parquet(f, cutter, plan)
                if records:
                    spec_of(dcfg).check_columns(plan.columns[f], f)
            else:
                file_hash, records = _cut_jsonl(f, cutter, dcfg.max_row_bytes)
            _check_same(f, before, file_stat(f))
        except OSError as e:
            raise SourceReadError(f"{f}: cannot read ({e.__class__.__name__}: {e})") from None
        plan.fingerprint[f] = {**before, "sha256": file_hash}
        digest.update(f"{rel}\0{file_hash}\n".encode())
        if not records:
            plan.dropped[EMPTY_FILE] = plan.dropped.get(EMPTY_FILE, 0) + 1
            plan.examples.append(f"{f}: {EMPTY_FILE}")
    plan.sha256, plan.units = digest.hexdigest(), cutter.result()
    return plan


# ---- the source's fingerprint ---------------------------------------------------------------------


class SourceChangedError(UserError):
    """A source file changed between the plan's read and the publish: nothing was published."""


def file_stat(f: str) -> dict:
    """What says a file changed without reading it: size and mtime; for an object store, its ETag and
    version (when the bucket keeps versions) too."""
    if "://" not in f:
        st = Path(f).stat()
        return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    import fsspec

    fs, path = fsspec.core.url_to_fs(f)
    fs.invalidate_cache(path)
    info = fs.info(path)
    out = {"bytes": info.get("size"), "etag": info.get("ETag"), "version_id": info.get("VersionId")}
    return {k: v for k, v in out.items() if v is not None}


def _check_same(f: str, before: dict, after: dict, what: str = "while prepare read it") -> None:
    changed = [
        f"{k} {before.get(k)} -> {after.get(k)}"
        for k in sorted({*before, *after})
        if before.get(k) != after.get(k)
    ]
    if changed:
        raise SourceChangedError(
            f"{f}: changed {what} ({'; '.join(changed)}); nothing was published to dataset.prepared_dir: "
            "prepare again once the source is complete and no longer written"
        )


def check_source_unchanged(plan: SourcePlan) -> None:
    """SourceChangedError unless every file the plan read is as it was: size, mtime and (local files)
    a fresh sha256, streamed; an object's ETag / version. Called before anything is published."""
    for f, was in plan.fingerprint.items():
        try:
            now = file_stat(f)
            if "://" not in f:
                now["sha256"] = _sha256_of(f)
        except OSError as e:
            raise SourceChangedError(
                f"{f}: gone since prepare read it ({e.__class__.__name__}); nothing was published to "
                "dataset.prepared_dir: prepare again once the source is complete"
            ) from None
        _check_same(f, {k: v for k, v in was.items() if k in now}, now, "since prepare planned it")


def same_content(recorded: dict | None, now: dict) -> bool:
    """Reuse rule: the recorded fingerprint equals the source's now by content (sha256, size, ETag,
    version); not by mtime, which a checkout or copy changes without changing the data."""
    keys = ("bytes", "sha256", "etag", "version_id")
    strip = lambda fp: {f: {k: v for k, v in m.items() if k in keys} for f, m in fp.items()}  # noqa: E731
    return recorded is not None and strip(recorded) == strip(now)


def _sha256_of(f: str) -> str:
    with open_binary(f) as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _cut_jsonl(f: str, cutter: _Cutter, max_row_bytes: int) -> tuple[str, int]:
    """One read of `f`: its sha256 and record count, its segments added to `cutter`. A record is a
    non-blank line (an over-long one too: it is dropped, so it counts)."""
    h = hashlib.sha256()
    pos, lines, records, open_at = 0, 0, 0, None  # open_at: (byte, lines before, records before)

    def close(stop: int) -> None:
        b, ln, r = open_at
        cutter.units[-1].append(Segment("jsonl", str(f), b, stop, first=r, line=ln, count=records - r))

    with open_binary(f) as fh:
        while raw := fh.readline(max_row_bytes + 1):
            start, pos, lines = pos, pos + len(raw), lines + 1
            h.update(raw)
            long = len(raw) > max_row_bytes
            record = long or bool(raw.strip())
            while (
                long and raw and not raw.endswith(b"\n")
            ):  # the rest of an over-long line, as the reader skips it
                raw = fh.readline(1 << 20)
                pos += len(raw)
                h.update(raw)
            if not record:
                continue
            if cutter.due():
                if open_at is not None:
                    close(start)
                    open_at = None
                cutter.new_unit()
            if open_at is None:
                open_at = (start, lines - 1, records)
            records += 1
            cutter.since += 1
    if open_at is not None:
        close(pos)
    return h.hexdigest(), records


def _cut_parquet(f: str, cutter: _Cutter, plan: SourcePlan) -> int:
    """Segments of whole row groups (a group is never split); the file's columns for the join's check."""
    pf = _parquet_file(f)
    plan.columns[f] = pf.schema_arrow.names
    records, open_at = 0, None  # open_at: (first group, records before)
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if cutter.due():
            if open_at is not None:
                seg = Segment("parquet", f, open_at[0], g, first=open_at[1], count=records - open_at[1])
                cutter.units[-1].append(seg)
                open_at = None
            cutter.new_unit()
        if open_at is None:
            open_at = (g, records)
        records += n
        cutter.since += n
    if open_at is not None:
        groups, rows = pf.metadata.num_row_groups, records - open_at[1]
        cutter.units[-1].append(Segment("parquet", f, open_at[0], groups, first=open_at[1], count=rows))
    return records


def _parquet_file(f: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(open_binary(f) if "://" in f else f)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise UserError(f"{f}: cannot read parquet ({e})") from None


def _load_hf_dataset(dcfg, spec: RowSpec):
    return load_hf_dataset(dcfg.path_or_dataset_id, dcfg.split, dcfg.dataset_name, spec)


# ---- reading a unit -------------------------------------------------------------------------------


def iter_unit(dcfg, unit: list[Segment], out: ChatSource) -> Iterator[dict]:
    """The usable rows of `unit`, in order; drops are counted in `out` (and `out.columns` collects the
    columns of each JSONL file seen, for the join's missing-column check)."""
    spec = spec_of(dcfg)
    for seg in unit:
        try:
            yield from READERS[seg.kind](dcfg, seg, spec, out)
        except OSError as e:  # deleted, replaced or unreachable since the plan read it
            raise SourceReadError(
                f"{seg.path}: cannot read ({e.__class__.__name__}: {e}); the source changed or disappeared "
                "while prepare read it: nothing was written to dataset.prepared_dir; prepare again"
            ) from None


class SourceReadError(UserError):
    """A source file or object that could not be read (gone, replaced or unreachable mid-prepare)."""


def _read_jsonl(dcfg, seg: Segment, spec: RowSpec, out: ChatSource) -> Iterator[dict]:
    f, stem = seg.path, _stem(seg.path)
    columns = out.columns.setdefault(seg.path, set())
    records = _jsonl_records(f, dcfg.max_row_bytes, seg.start, seg.stop, seg.line)
    read = 0
    for i, (n, rec) in enumerate(records, start=seg.first):
        read += 1
        if isinstance(rec, dict):
            columns.update(rec)
        row = convert_record(out, rec, f"{stem}-{i:06d}", spec, f"{f}:line {n}")
        if row is not None:
            yield row
    if read != seg.count:  # cut short (or rewritten) after the plan counted its records
        raise SourceChangedError(
            f"{f}: bytes [{seg.start}, {seg.stop}) held {seg.count} records when prepare planned, {read} "
            "when it read them: the file changed while prepare read it; nothing was published to "
            "dataset.prepared_dir: prepare again once the source is complete and no longer written"
        )


def _read_parquet(dcfg, seg: Segment, spec: RowSpec, out: ChatSource) -> Iterator[dict]:
    f, stem = seg.path, _stem(seg.path)
    pf = _parquet_file(f)
    i = seg.first
    row_groups = list(range(seg.start, seg.stop))
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=row_groups) if row_groups else ():
        for rec in batch.to_pylist():
            row = convert_record(out, rec, f"{stem}-{i:06d}", spec, f"{f}:row {i}")
            i += 1
            if row is not None:
                yield row


def _read_hf(dcfg, seg: Segment, spec: RowSpec, out: ChatSource) -> Iterator[dict]:
    ds = _load_hf_dataset(dcfg, spec)
    source, split = dcfg.path_or_dataset_id, dcfg.split
    for i, rec in enumerate(ds.select(range(seg.start, seg.stop)), start=seg.start):
        row = convert_record(
            out, rec, f"{source.replace('/', '_')}-{i:06d}", spec, f"{source}:{split}: row {i}"
        )
        if row is not None:
            yield row


def _read_rows(dcfg, seg: Segment, spec: RowSpec, out: ChatSource) -> Iterator[dict]:
    from .prepared_dir import load_source

    src = load_source(dcfg)
    if seg.start == 0:  # the mixture's drops, counted once (by the unit that starts it)
        out.dropped.update(src.dropped)
        out.examples += src.examples
        out.num_read += src.num_read - len(src.rows)
    out.num_read += seg.stop - seg.start
    yield from src.rows[seg.start : seg.stop]


def _stem(path: str) -> str:
    return PurePosixPath(path.split("://", 1)[-1]).stem


READERS = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf, "rows": _read_rows}
