"""Read one split of a prepared directory (written by `dllmflow prepare`) as a map-style dataset.

    ds = PreparedDataset("data/prepared/tiny", "train")
    len(ds); ds[0]            # {"id", "input_ids": [...], "loss_mask": [...], "prompt_length"}
    ds.rows(limit=8)          # [{"id", "messages": [...], "answer"}, ...] for generation / evaluation

Plain Python (no torch import): a `torch.utils.data.DataLoader` takes it as is, with `DLLMCollator`.
The data verifies itself against its manifest (data/prepared_dir.py): opening a split checks the
manifest's `content_hash` and each token file's id range against the vocabulary; the first row read
hashes every token file of the split, and `rows()` each parquet shard it reads, each file once per
process. A file that is not what prepare wrote is one line naming it and both hashes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dllmflow.errors import UserError

from .prepared_dir import MANIFEST, check_manifest, read_manifest, verify_file
from .shards import TokenStore

ROW_COLUMNS = ("id", "messages", "answer", "prompt_length")


class PreparedDataset:
    """One split, its tokens read in place from the token files (data/shards.py): opening reads the
    manifest only, a row costs positioned reads of its own bytes, so each rank touches only the rows
    its sampler gives it and its memory does not grow with the split."""

    def __init__(self, prepared_dir: str | os.PathLike, split: str = "train", vocab_size: int | None = None):
        self.prepared_dir = Path(prepared_dir)
        manifest = read_manifest(self.prepared_dir)
        if manifest is None:
            raise UserError(
                f"{self.prepared_dir / MANIFEST}: missing or unreadable; run `dllmflow prepare --params <recipe.yaml>`"
            )
        if split not in manifest["splits"]:
            raise UserError(
                f"split {split!r} not in {self.prepared_dir}; choose one of {sorted(manifest['splits'])}"
            )
        if "files" not in manifest:
            raise UserError(
                f"{self.prepared_dir}: prepared before token files (its manifest lists no `files`); run "
                "`dllmflow prepare --params <recipe.yaml>` again (it rebuilds the dir)"
            )
        check_manifest(self.prepared_dir, manifest, split, vocab_size)
        self.manifest, self.split = manifest, split
        self.shards = manifest["splits"][split]["shards"]
        self._store = TokenStore(
            self.prepared_dir, self.shards, [manifest["files"][f]["rows"] for f in self.shards]
        )
        self._verified = False

    def verify(self) -> None:
        """Hash every token file of the split against the manifest (once per process per file): done
        before the first row is read, so a training run fails before its first step, not mid-epoch."""
        if not self._verified:
            for rel in self._store.paths:
                verify_file(self.prepared_dir, rel, self.manifest["files"][rel])
            self._verified = True

    @property
    def tokenizer_dir(self) -> Path:
        return self.prepared_dir / "tokenizer"

    def __len__(self) -> int:
        return len(self._store)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        if not self._verified:
            self.verify()
        return self._store[i % len(self)]

    def rows(self, limit: int | None = None) -> list[dict]:
        """The chats behind the first `limit` rows (all by default): `messages` (decoded list), `answer`
        (reference text), `id`, `prompt_length`; read from the parquet shards, only as many as needed."""
        import pyarrow.parquet as pq

        n = len(self) if limit is None else min(limit, len(self))
        out: list[dict] = []
        for shard in self.shards:
            if len(out) >= n:
                break
            verify_file(self.prepared_dir, shard, self.manifest["files"][shard])
            table = pq.read_table(self.prepared_dir / shard, columns=list(ROW_COLUMNS))
            out += table.select(list(ROW_COLUMNS)).slice(0, n - len(out)).to_pylist()
        for r in out:
            r["messages"] = json.loads(r["messages"])
        return out
