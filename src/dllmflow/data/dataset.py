"""Read one split of a prepared directory (written by `dllmflow prepare`) as a map-style dataset.

    ds = PreparedDataset("data/prepared/tiny", "train")
    len(ds); ds[0]            # {"id", "input_ids": [...], "loss_mask": [...], "prompt_length"}
    ds.rows(limit=8)          # [{"id", "messages": [...], "answer"}, ...] for generation / evaluation

Plain Python (no torch import): a `torch.utils.data.DataLoader` takes it as is, with `DLLMCollator`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dllmflow.errors import UserError

from .prepare import MANIFEST, read_manifest


class PreparedDataset:
    def __init__(self, prepared_dir: str | os.PathLike, split: str = "train"):
        import pyarrow as pa
        import pyarrow.parquet as pq

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
        self.manifest, self.split = manifest, split
        tables = [pq.read_table(self.prepared_dir / f) for f in manifest["splits"][split]["shards"]]
        self._table = pa.concat_tables(tables).combine_chunks()
        self._ids = self._table.column("input_ids")
        self._mask = self._table.column("loss_mask")

    @property
    def tokenizer_dir(self) -> Path:
        return self.prepared_dir / "tokenizer"

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return {
            "id": self._table.column("id")[i].as_py(),
            "input_ids": self._ids[i].as_py(),
            "loss_mask": self._mask[i].as_py(),
            "prompt_length": self._table.column("prompt_length")[i].as_py(),
        }

    def rows(self, limit: int | None = None) -> list[dict]:
        """The chats behind the rows: `messages` (decoded list), `answer` (reference text), `id`."""
        n = len(self) if limit is None else min(limit, len(self))
        sub = self._table.slice(0, n).select(["id", "messages", "answer", "prompt_length"]).to_pylist()
        for r in sub:
            r["messages"] = json.loads(r["messages"])
        return sub
