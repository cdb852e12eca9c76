"""Atomic file writes and tolerant JSONL reads (stdlib only; importable from settings up).

A file is written under `<name>.tmp` next to its destination, flushed and fsynced, then renamed over
it with `os.replace`, and the directory is fsynced: a reader (a resumed run, the flow, DVC) sees the
old file or the new one, never half of one, even after a crash.

    atomic_write_json(run_dir / "eval" / "llada.json", result)
    with atomic_path(shard) as tmp:          # any writer that takes a path (parquet, save_pretrained...)
        pq.write_table(table, tmp)
    rows = read_jsonl(path)                  # [] when missing; a torn last line skipped
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a tmp path to write; on success publish it at `path` (fsync file, rename, fsync dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """Pretty, key-sorted JSON plus a newline (override with json.dumps keyword arguments)."""
    kwargs = {"indent": 2, "sort_keys": True, **dumps_kwargs}
    return atomic_write_text(path, json.dumps(obj, **kwargs) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL file ([] when it is missing); a line cut by a killed writer is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, streamed in 1 MiB chunks (memory does not grow with the file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_file_once(path: str | os.PathLike) -> str:
    """`sha256_file`, each file version (path, inode, size, mtime) hashed once per process: a sweep
    evaluates one checkpoint many times, a prepared dir is verified by every reader."""
    path = Path(path).resolve()
    st = path.stat()
    return _sha256_of_version(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256_of_version(path: str, dev: int, ino: int, size: int, mtime_ns: int) -> str:
    return sha256_file(path)
