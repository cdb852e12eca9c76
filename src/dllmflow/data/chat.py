"""Load rows from JSONL / parquet files or directories, a Hugging Face dataset id (through `datasets`,
with split slices such as `train[:100]`), or an embedded default (GSM8K, synthetic addition), convert
them from their format (chat `messages`, prompt/completion, Alpaca, raw text: data/formats.py) and
validate them.

    loaded = load_chat_rows("data/chat.jsonl")          # ChatSource(rows, dropped, examples, sha256, files)
    loaded = load_chat_rows("org/name", split="train[:100]")
    loaded = load_chat_rows("qa.jsonl", spec=RowSpec.build("prompt_completion", {"prompt": "question"}))

Rows that cannot be used are counted, not fatal: `dropped` maps a reason ("malformed: ..." or
"empty: ...") to a count and `examples` names the first few (`file:line N: reason`), so `dllmflow
prepare` can report what it skipped. A mapped column absent from a whole file is a UserError. The
caller decides whether nothing usable is left.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dllmflow.common.files import sha256_file
from dllmflow.errors import UserError
from dllmflow.settings.sections import DatasetConfig

from .formats import ROLES, TOO_DEEP, RowSpec, check_messages, loads_row  # noqa: F401 - re-exported
from .gsm8k import EMBEDDED_PREFIX, GSM8K_SHA256, load_gsm8k_rows
from .synthetic import SYNTHETIC

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# `embedded:<name>` -> (loader() -> rows, sha256 that identifies those rows)
EMBEDDED = {"gsm8k": (load_gsm8k_rows, GSM8K_SHA256), **SYNTHETIC}
NOT_UTF8 = "malformed: line is not UTF-8 text"
MAX_ROW_BYTES = DatasetConfig.model_fields["max_row_bytes"].default  # `dataset.max_row_bytes`


MAX_EXAMPLES = 20  # dropped rows named one by one (file:line: field: why) in the manifest


@dataclass
class ChatSource:
    rows: list[dict]  # {"id": str, "messages": [{"role", "content"}, ...]} or {"id": str, "text": str}
    dropped: Counter = field(default_factory=Counter)  # "malformed: <why>" / "empty: <why>" -> count
    examples: list[str] = field(default_factory=list)  # the first MAX_EXAMPLES drops, "<file>:<line>: <why>"
    sha256: str = ""  # fingerprint of the input data (file bytes, embedded hash, or datasets fingerprint)
    files: list[str] = field(default_factory=list)
    num_read: int = 0
    columns: dict[str, set] = field(default_factory=dict)  # JSONL file -> the columns its records had


def load_chat_rows(
    source: str,
    *,
    split: str = "train",
    dataset_name: str | None = None,
    messages_column: str = "messages",
    spec: RowSpec | None = None,
    max_row_bytes: int = MAX_ROW_BYTES,
) -> ChatSource:
    """Read and validate rows from `source` (see module docstring); `spec` = format and field mapping
    (docs/data_formats.md), default: detect the format of each record. A JSONL line over
    `max_row_bytes` is dropped as malformed unread."""
    spec = spec or RowSpec.build(messages_column=messages_column)
    if source.startswith(EMBEDDED_PREFIX):
        return _load_embedded(source[len(EMBEDDED_PREFIX) :])
    path = Path(source).expanduser()
    if path.exists():
        return _load_files(path, spec, max_row_bytes)
    if source.endswith(FILE_SUFFIXES) or source.startswith((".", "/", "~")):
        raise UserError(f"dataset.path_or_dataset_id: {source}: no such file or directory")
    return _load_hf(source, split, dataset_name, messages_column, spec)


def _load_embedded(name: str) -> ChatSource:
    if name not in EMBEDDED:
        raise UserError(
            f"dataset.path_or_dataset_id: unknown embedded dataset {name!r}; choose one of {sorted(EMBEDDED)}"
        )
    loader, digest = EMBEDDED[name]
    rows = loader()
    return ChatSource(rows=rows, sha256=digest, files=[f"{EMBEDDED_PREFIX}{name}"], num_read=len(rows))


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise UserError(f"{path}: unsupported file type; use .jsonl or .parquet")
        return [path]
    # A dir of shards (e.g. `dllmflow regenerate` output) reads only its shards, not its manifest.json.
    shards = sorted(path.glob("shard-*.parquet"))
    files = shards or sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES and p.name != "manifest.json"
    )
    if not files:
        raise UserError(f"{path}: directory holds no .jsonl or .parquet files")
    return files


def _load_files(path: Path, spec: RowSpec, max_row_bytes: int = MAX_ROW_BYTES) -> ChatSource:
    out = ChatSource(rows=[])
    digest = hashlib.sha256()
    for f in _data_files(path):
        rel = f.name if f == path else str(f.relative_to(path))
        digest.update(f"{rel}\0{sha256_file(f)}\n".encode())
        out.files.append(str(f))
        columns: set[str] = set()
        records = _read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f, max_row_bytes)
        for i, (where, rec) in enumerate(records):
            if isinstance(rec, dict):
                columns.update(rec)
            _add(out, rec, f"{f.stem}-{i:06d}", spec, f"{f}:{where}")
        if columns:
            spec.check_columns(columns, str(f))
    out.sha256 = digest.hexdigest()
    return out


def _read_jsonl(path: Path, max_row_bytes: int = MAX_ROW_BYTES):
    yield from ((f"line {n}", rec) for n, rec in _jsonl_records(path, max_row_bytes))


def _bounded_lines(f, max_row_bytes: int, line: int = 0, stop: int | None = None):
    """(line number, bytes or None) per line of the binary file `f` (numbered after `line`, up to byte
    offset `stop`); None for a line (newline included) longer than `max_row_bytes`, whose rest is
    skipped in chunks, never held whole."""
    n = line
    while (stop is None or f.tell() < stop) and (line := f.readline(max_row_bytes + 1)):
        n += 1
        if len(line) <= max_row_bytes:
            yield n, line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(1 << 20)
        yield n, None


def open_binary(path: str | Path):
    """A local file with open(); a URL (s3://, gs://, any fsspec protocol) through fsspec, buffered so
    lines read as from a local file."""
    if "://" not in str(path):
        return open(path, "rb")
    import io

    import fsspec

    return io.BufferedReader(fsspec.open(str(path), "rb").open(), 1 << 20)


def _jsonl_records(
    path: Path, max_row_bytes: int = MAX_ROW_BYTES, start: int = 0, stop: int | None = None, line: int = 0
):
    """(line number, record or drop reason) per non-blank line of bytes [start, stop) of `path`
    (`line` = the number of lines before `start`)."""
    with open_binary(path) as f:
        f.seek(start)
        for n, raw in _bounded_lines(f, max_row_bytes, line, stop):
            if raw is None:
                yield n, f"malformed: line longer than dataset.max_row_bytes={max_row_bytes}"
                continue
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")  # a stray non-UTF-8 byte spoils its line only, not the file
            except UnicodeDecodeError:
                yield n, NOT_UTF8
                continue
            rec, reason = loads_row(line)
            yield n, reason if reason == TOO_DEEP else rec if isinstance(rec, dict) else None


def _read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise UserError(f"{path}: cannot read parquet ({e})") from None
    for i, rec in enumerate(table.to_pylist()):
        yield f"row {i}", rec


def _load_hf(
    source: str,
    split: str,
    dataset_name: str | None,
    messages_column: str = "messages",
    spec: RowSpec | None = None,
) -> ChatSource:
    spec = spec or RowSpec.build(messages_column=messages_column)
    ds = load_hf_dataset(source, split, dataset_name, spec)
    out = ChatSource(rows=[], sha256=f"datasets:{ds._fingerprint}", files=[f"{source}:{split}"])
    for i, rec in enumerate(ds):
        _add(out, rec, f"{source.replace('/', '_')}-{i:06d}", spec, f"{source}:{split}: row {i}")
    return out


def load_hf_dataset(source: str, split: str, dataset_name: str | None, spec: RowSpec):
    """The `datasets` split (memory-mapped Arrow), its columns checked against `spec`."""
    import datasets

    try:
        ds = datasets.load_dataset(source, dataset_name, split=split)
    except Exception as e:  # offline, missing id, bad split: all are the user's input
        raise UserError(
            f"dataset.path_or_dataset_id={source!r} (split {split!r}): cannot load with datasets ({e})"
        ) from None
    if spec.format == "auto" and spec.detect(dict.fromkeys(ds.column_names)) is None:
        raise UserError(
            f"dataset.messages_column={spec.column('messages')!r} is not a column of {source} and no other format fits; "
            f"columns: {ds.column_names} (set dataset.format / dataset.fields, docs/data_formats.md)"
        )
    spec.check_columns(ds.column_names, f"{source}:{split}")
    return ds


def _add(out: ChatSource, rec: dict | str | None, default_id: str, spec: RowSpec, where: str) -> None:
    row = convert_record(out, rec, default_id, spec, where)
    if row is not None:
        out.rows.append(row)


def convert_record(
    out: ChatSource, rec: dict | str | None, default_id: str, spec: RowSpec, where: str
) -> dict | None:
    """The internal row of one source record, or None after counting why it was dropped in `out`
    (a str record is the reader's drop reason, None a line that is not a JSON object)."""
    out.num_read += 1
    if rec is None or isinstance(rec, str):
        reason = rec or "malformed: line is not a JSON object"
    else:
        row, reason = spec.convert(rec)
    if reason:
        out.dropped[reason] += 1
        if len(out.examples) < MAX_EXAMPLES:
            out.examples.append(f"{where}: {reason}")
        return None
    row_id = rec.get("id")
    return {"id": str(row_id) if row_id is not None else default_id, **row}
