"""Load chat rows (`messages`: a list of {role, content}) from JSONL / parquet files or directories, a
Hugging Face dataset id (through `datasets`, with split slices such as `train[:100]`), or the embedded
GSM8K default, and validate them.

    loaded = load_chat_rows("data/chat.jsonl")          # ChatSource(rows, dropped, sha256, files)
    loaded = load_chat_rows("org/name", split="train[:100]")

Rows that cannot be used are counted, not fatal: `dropped` maps a reason ("malformed: ..." or
"empty: ...") to a count, so `dllmflow prepare` can report what it skipped. The caller decides
whether nothing usable is left.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

from .gsm8k import EMBEDDED_PREFIX, GSM8K_SHA256, load_gsm8k_rows, sha256_file

ROLES = ("system", "user", "assistant")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
EMBEDDED = {"gsm8k": (load_gsm8k_rows, GSM8K_SHA256)}
NOT_UTF8 = "malformed: line is not UTF-8 text"


@dataclass
class ChatSource:
    rows: list[dict]  # {"id": str, "messages": [{"role", "content"}, ...]}
    dropped: Counter = field(default_factory=Counter)  # "malformed: <why>" / "empty: <why>" -> count
    sha256: str = ""  # fingerprint of the input data (file bytes, embedded hash, or datasets fingerprint)
    files: list[str] = field(default_factory=list)
    num_read: int = 0


def check_messages(value: Any) -> tuple[list[dict] | None, str | None]:
    """(clean messages, None) for a usable chat, else (None, reason). A JSON string is decoded first
    (our own shards and regenerated data store messages as JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, "malformed: messages is a string that is not JSON"
    if hasattr(value, "tolist"):  # numpy arrays from parquet/pandas
        value = value.tolist()
    if value is None:
        return None, "malformed: missing messages"
    if not isinstance(value, list | tuple):
        return None, f"malformed: messages is {type(value).__name__}, not a list"
    if not value:
        return None, "empty: no messages"
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None, "malformed: a message is not a {role, content} mapping"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return None, f"malformed: role {role!r} not in {'/'.join(ROLES)}"
        if not isinstance(content, str):
            return None, "malformed: content is not a string"
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "assistant":
        return None, "malformed: last message is not an assistant turn"
    if not out[-1]["content"].strip():
        return None, "empty: final assistant content is empty"
    if not any(m["role"] != "assistant" and m["content"].strip() for m in out[:-1]):
        return None, "empty: no prompt before the final assistant turn"
    return out, None


def load_chat_rows(
    source: str, *, split: str = "train", dataset_name: str | None = None, messages_column: str = "messages"
) -> ChatSource:
    """Read and validate rows from `source` (see module docstring)."""
    if source.startswith(EMBEDDED_PREFIX):
        return _load_embedded(source[len(EMBEDDED_PREFIX) :])
    path = Path(source).expanduser()
    if path.exists():
        return _load_files(path, messages_column)
    if source.endswith(FILE_SUFFIXES) or source.startswith((".", "/", "~")):
        raise UserError(f"dataset.path_or_dataset_id: {source}: no such file or directory")
    return _load_hf(source, split, dataset_name, messages_column)


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


def _load_files(path: Path, messages_column: str) -> ChatSource:
    out = ChatSource(rows=[])
    digest = hashlib.sha256()
    for f in _data_files(path):
        rel = f.name if f == path else str(f.relative_to(path))
        digest.update(f"{rel}\0{sha256_file(f)}\n".encode())
        out.files.append(str(f))
        records = _read_parquet(f) if f.suffix == ".parquet" else _read_jsonl(f)
        for i, rec in enumerate(records):
            _add(out, rec, f"{f.stem}-{i:06d}", messages_column)
    out.sha256 = digest.hexdigest()
    return out


def _read_jsonl(path: Path):
    # surrogateescape: a stray non-UTF-8 byte spoils its line only (counted as malformed), not the file
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                line.encode("utf-8")  # fails on a lone surrogate, i.e. a byte that was not UTF-8
            except UnicodeEncodeError:
                yield NOT_UTF8
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None  # counted as malformed by _add
            yield rec if isinstance(rec, dict) else None


def _read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise UserError(f"{path}: cannot read parquet ({e})") from None
    yield from table.to_pylist()


def _load_hf(source: str, split: str, dataset_name: str | None, messages_column: str) -> ChatSource:
    import datasets

    try:
        ds = datasets.load_dataset(source, dataset_name, split=split)
    except Exception as e:  # offline, missing id, bad split: all are the user's input
        raise UserError(
            f"dataset.path_or_dataset_id={source!r} (split {split!r}): cannot load with datasets ({e})"
        ) from None
    if messages_column not in ds.column_names:
        raise UserError(
            f"dataset.messages_column={messages_column!r} is not a column of {source}; columns: {ds.column_names}"
        )
    out = ChatSource(rows=[], sha256=f"datasets:{ds._fingerprint}", files=[f"{source}:{split}"])
    for i, rec in enumerate(ds):
        _add(out, rec, f"{source.replace('/', '_')}-{i:06d}", messages_column)
    return out


def _add(out: ChatSource, rec: dict | str | None, default_id: str, messages_column: str) -> None:
    out.num_read += 1
    if rec is None or isinstance(rec, str):
        out.dropped[rec or "malformed: line is not a JSON object"] += 1
        return
    messages, reason = check_messages(rec.get(messages_column))
    if reason:
        out.dropped[reason] += 1
        return
    row_id = rec.get("id")
    out.rows.append({"id": str(row_id) if row_id is not None else default_id, "messages": messages})
