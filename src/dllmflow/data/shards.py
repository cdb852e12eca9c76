"""Shard files of a prepared split: written as rows arrive, read back memory-mapped (docs/contracts.md).

    writer = ShardWriter(split_dir, first=0, shard_size=1000)
    writer.add(row); ...; files = writer.close()   # {"train/shard-000000.parquet": {sha256, rows, bytes}, ...}
    store = TokenStore(prepared_dir, ["train/shard-000000.parquet", ...], [1000, ...])
    store[i]                                         # {"id", "input_ids", "loss_mask", "prompt_length"}

Each shard is two files of the same rows: `shard-N.parquet` (every column: the chat, its answer and
its tokens; compressed, what evaluation and users read) and `shard-N.tokens.arrow`, an uncompressed
Arrow IPC file of the columns training reads (id, input_ids, loss_mask, prompt_length). Training maps
the Arrow files into memory: opening a split reads no rows (a shard is mapped on its first access),
and a row costs the pages of its own tokens, so each rank touches only the rows its sampler gives it
and memory does not grow with the number of rows. A shard is written under a temporary name and
renamed into place: a killed writer leaves no partial shard under a final name.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path

from .gsm8k import sha256_file

TOKENS_SUFFIX = ".tokens.arrow"
TOKEN_COLUMNS = ("id", "input_ids", "loss_mask", "prompt_length")


def shard_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("prompt_length", pa.int32()),
            ("messages", pa.string()),
            ("answer", pa.string()),
        ]
    )


def tokens_path(shard: str) -> str:
    """The token file of the parquet shard `shard` (a path relative to the prepared dir)."""
    return shard.removesuffix(".parquet") + TOKENS_SUFFIX


class ShardWriter:
    """Rows of one split of one unit into shards of `shard_size` rows, numbered from `first`; at least
    one shard (an empty one for a split without rows, as the split's only shard before units)."""

    def __init__(self, split_dir: Path, first: int, shard_size: int):
        self.split_dir, self.next, self.shard_size = split_dir, first, shard_size
        self.rows: list[dict] = []
        self.files: dict[str, dict] = {}
        self.written = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) == self.shard_size:
            self._flush()

    def close(self) -> dict[str, dict]:
        if self.rows or not self.written:
            self._flush()
        return self.files

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.split_dir.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(self.rows, schema=shard_schema())
        name = f"{self.split_dir.name}/shard-{self.next:06d}.parquet"
        _write_atomic(self.split_dir.parent / name, lambda p: pq.write_table(table, p))
        tokens = table.select(list(TOKEN_COLUMNS))
        _write_atomic(self.split_dir.parent / tokens_path(name), lambda p: _write_ipc(tokens, p))
        for rel in (name, tokens_path(name)):
            path = self.split_dir.parent / rel
            self.files[rel] = {
                "sha256": sha256_file(path),
                "rows": len(self.rows),
                "bytes": path.stat().st_size,
            }
        self.next, self.written, self.rows = self.next + 1, self.written + 1, []


def _write_ipc(table, path: str) -> None:
    import pyarrow as pa

    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TokenStore:
    """Rows of a split's token files, memory-mapped shard by shard on first access."""

    def __init__(self, root: Path, shards: list[str], rows: list[int]):
        self.root, self.paths = root, [tokens_path(s) for s in shards]
        self.starts = [0]
        for n in rows:
            self.starts.append(self.starts[-1] + n)
        self._batches: dict[int, object] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def _batch(self, k: int):
        batch = self._batches.get(k)
        if batch is None:
            import pyarrow as pa

            source = pa.memory_map(str(self.root / self.paths[k]))
            try:
                reader = pa.ipc.open_file(source)
                batch = reader.get_batch(0) if reader.num_record_batches else None
            finally:
                source.close()  # the mapping lives on in the batch's buffers; no descriptor is held
            self._batches[k] = batch
        return batch

    def __getitem__(self, i: int) -> dict:
        k = bisect_right(self.starts, i) - 1
        batch, j = self._batch(k), i - self.starts[k]
        return {
            "id": batch.column(0)[j].as_py(),
            "input_ids": batch.column(1)[j].as_py(),
            "loss_mask": batch.column(2)[j].as_py(),
            "prompt_length": batch.column(3)[j].as_py(),
        }
