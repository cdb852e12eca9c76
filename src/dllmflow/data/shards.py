"""Shard files of a prepared split: written as rows arrive, read back memory-mapped (docs/contracts.md).

    writer = ShardWriter(split_dir, first=0, shard_size=1000)
    writer.add(row); ...; files = writer.close()   # {"train/shard-000000.parquet": {sha256, rows, bytes}, ...}
    store = TokenStore(prepared_dir, ["train/shard-000000.parquet", ...], [1000, ...])
    store[i]                                         # {"id", "input_ids", "loss_mask", "prompt_length"}

Each shard is two files of the same rows: `shard-N.parquet` (every column: the chat, its answer and
its tokens; compressed, what evaluation and users read) and `shard-N.tokens.arrow`, an uncompressed
Arrow IPC file of the columns training reads (id, input_ids, loss_mask, prompt_length), one record
batch per file (the reader refuses any other count), its id range recorded beside its checksum (the
vocabulary check of data/prepared_dir.py). Training reads
a row's bytes where they lie: opening a split reads no shard; a shard's buffer positions come from its
Arrow metadata on first access; a row is a few positioned reads of its own bytes, so each rank touches
only the rows its sampler gives it and its memory does not grow with the rows. A shard is written
under a temporary name and renamed into place: a killed writer leaves no partial shard under a final
name.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from itertools import chain
from pathlib import Path

from dllmflow.common.files import sha256_file
from dllmflow.errors import UserError

TOKENS_SUFFIX = ".tokens.arrow"
TOKEN_COLUMNS = ("id", "input_ids", "loss_mask", "prompt_length")


class TokenFileError(UserError):
    """A token file that does not read as its manifest describes it."""


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
    one shard (an empty one for a split without rows, as the split's only shard before units). A row's
    values go straight into its shard's columns (the token lists into flat int32 / int8 buffers): the
    table is built from them, not from one dict per row."""

    def __init__(self, split_dir: Path, first: int, shard_size: int):
        self.split_dir, self.next, self.shard_size = split_dir, first, shard_size
        self.files: dict[str, dict] = {}
        self.written = 0
        self._reset()

    def _reset(self) -> None:
        self.rows = 0
        self.ids, self.prompt_lengths, self.messages, self.answers = [], [], [], []
        self.tokens: list[list[int]] = []  # each row's ids, flattened once per shard
        self.mask = bytearray()  # every row's loss mask (0/1 bytes), end to end
        self.ends = [0]  # where each row's tokens end, end to end (the list columns' offsets)

    def add(self, row: dict) -> None:
        """A shard row (prepared_dir.fit_row's keys)."""
        if len(row["loss_mask"]) != len(row["input_ids"]):  # the two list columns share their offsets
            raise ValueError(f"{self.split_dir}: row {row['id']}: loss mask and input ids differ in length")
        self.ids.append(row["id"])
        self.tokens.append(row["input_ids"])
        self.mask += bytes(row["loss_mask"])
        self.ends.append(len(self.mask))
        self.prompt_lengths.append(row["prompt_length"])
        self.messages.append(row["messages"])
        self.answers.append(row["answer"])
        self.rows += 1
        if self.rows == self.shard_size:
            self._flush()

    def close(self) -> dict[str, dict]:
        if self.rows or not self.written:
            self._flush()
        return self.files

    def _table(self):
        """The shard's table (shard_schema), its values the same as Table.from_pylist of the rows."""
        import numpy as np
        import pyarrow as pa

        offsets = pa.array(self.ends, pa.int32())
        schema = shard_schema()
        columns = [
            pa.array(self.ids, pa.string()),
            pa.ListArray.from_arrays(
                offsets,
                np.fromiter(chain.from_iterable(self.tokens), np.int32, self.ends[-1]),
                type=schema.field(1).type,
            ),
            pa.ListArray.from_arrays(offsets, np.frombuffer(self.mask, np.int8), type=schema.field(2).type),
            pa.array(self.prompt_lengths, pa.int32()),
            pa.array(self.messages, pa.string()),
            pa.array(self.answers, pa.string()),
        ]
        return pa.Table.from_arrays(columns, schema=schema)

    def _flush(self) -> None:
        import pyarrow.parquet as pq

        self.split_dir.mkdir(parents=True, exist_ok=True)
        table = self._table()
        name = f"{self.split_dir.name}/shard-{self.next:06d}.parquet"
        _write_atomic(self.split_dir.parent / name, lambda p: pq.write_table(table, p))
        tokens = table.select(list(TOKEN_COLUMNS))
        _write_atomic(self.split_dir.parent / tokens_path(name), lambda p: _write_ipc(tokens, p))
        for rel in (name, tokens_path(name)):
            path = self.split_dir.parent / rel
            self.files[rel] = {"sha256": sha256_file(path), "rows": self.rows, "bytes": path.stat().st_size}
        self.files[tokens_path(name)]["ids"] = id_range(tokens)
        self.next, self.written = self.next + 1, self.written + 1
        self._reset()


def id_range(tokens) -> list[int] | None:
    """[min, max] of a token table's ids (None without ids): what the vocabulary check compares."""
    import pyarrow.compute as pc

    lo_hi = pc.min_max(pc.list_flatten(tokens.column("input_ids")))
    return None if lo_hi["min"].as_py() is None else [lo_hi["min"].as_py(), lo_hi["max"].as_py()]


def _write_ipc(table, path: str) -> None:
    import pyarrow as pa

    # The reader locates a row's bytes in batch 0 only: one batch per file (an empty split included).
    batches = table.combine_chunks().to_batches() or [pa.RecordBatch.from_pylist([], schema=table.schema)]
    assert len(batches) == 1, f"{path}: {len(batches)} record batches; a token file holds one"
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_batch(batches[0])


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TokenStore:
    """Rows of a split's token files by positioned reads: a shard's layout (where each column's
    buffers sit in the file) is read from its Arrow metadata on first access, then a row is a few
    `os.pread`s of its own bytes. Nothing stays mapped: mapped file pages count in a rank's RSS and the
    kernel maps them around each fault (measured: ~0.5 MB of RSS per random row, 0.5 GB per 1,000 rows
    of a 1M-row split), while read pages stay in the shared page cache."""

    MAX_OPEN = 64  # file descriptors kept open per store (least recently opened closed first)

    def __init__(self, root: Path, shards: list[str], rows: list[int]):
        self.root, self.paths = root, [tokens_path(s) for s in shards]
        self.starts = [0]
        for n in rows:
            self.starts.append(self.starts[-1] + n)
        self._layouts: dict[int, dict[str, int]] = {}
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _layout(self, k: int) -> dict[str, int]:
        """File offsets of shard k's buffers: {column: offsets/data position}, and the file's size."""
        if k not in self._layouts:
            import pyarrow as pa

            path = self.root / self.paths[k]
            source = pa.memory_map(str(path))
            try:
                base = source.read_buffer(1).address  # file offset 0
                reader = pa.ipc.open_file(source)
                rows = self.starts[k + 1] - self.starts[k]
                if reader.num_record_batches != 1 or reader.get_batch(0).num_rows != rows:
                    raise TokenFileError(
                        f"{path}: {reader.num_record_batches} record batch(es) of "
                        f"{sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))} "
                        f"rows, the manifest records one of {rows}; run `dllmflow prepare --force` again"
                    )
                batch = reader.get_batch(0)
                key, ids, mask, plen = (batch.column(n) for n in TOKEN_COLUMNS)
                self._layouts[k] = {
                    "ids_offsets": ids.buffers()[1].address - base,
                    "ids": ids.buffers()[3].address - base,
                    "mask_offsets": mask.buffers()[1].address - base,
                    "mask": mask.buffers()[3].address - base,
                    "id_offsets": key.buffers()[1].address - base,
                    "id": key.buffers()[2].address - base,
                    "prompt_length": plen.buffers()[1].address - base,
                    "size": source.size(),
                }
            except (pa.ArrowInvalid, OSError) as e:
                raise TokenFileError(
                    f"{path}: not a readable token file ({e}); run `dllmflow prepare --force` again"
                ) from None
            finally:
                source.close()
        return self._layouts[k]

    def _fd(self, k: int) -> int:
        if k not in self._fds:
            if len(self._fds) >= self.MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[k] = os.open(self.root / self.paths[k], os.O_RDONLY)
        return self._fds[k]

    def __getitem__(self, i: int) -> dict:
        import numpy as np

        k = bisect_right(self.starts, i) - 1
        j, at, fd = i - self.starts[k], self._layout(k), self._fd(k)

        def span(offsets: int, values: int, width: int, dtype) -> np.ndarray:
            a, b = (int(x) for x in np.frombuffer(os.pread(fd, 8, offsets + 4 * j), np.int32))
            if not 0 <= a <= b or values + width * b > at["size"]:  # an offset no writer made
                raise TokenFileError(
                    f"{self.root / self.paths[k]}: row {j} spans values [{a}, {b}), past the file's "
                    f"{at['size']} bytes; the file is damaged: run `dllmflow prepare --force` again"
                )
            return np.frombuffer(os.pread(fd, width * (b - a), values + width * a), dtype)

        return {
            "id": span(at["id_offsets"], at["id"], 1, np.uint8).tobytes().decode("utf-8"),
            "input_ids": span(at["ids_offsets"], at["ids"], 4, np.int32).tolist(),
            "loss_mask": span(at["mask_offsets"], at["mask"], 1, np.int8).tolist(),
            "prompt_length": int(np.frombuffer(os.pread(fd, 4, at["prompt_length"] + 4 * j), np.int32)[0]),
        }
