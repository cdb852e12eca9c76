"""The input side of `dllmflow regenerate`: rows from a file, a dir or a HF dataset (with a split slice),
and the prompts to regenerate (each conversation minus its trailing assistant turns).

    rows = load_rows("data/chat.jsonl", split="train[:1000]", shuffle_seed=0)
    prompts, skipped = build_prompts(rows, "messages", "data/chat.jsonl")
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllmflow.data.regen_shards import MANIFEST
from dllmflow.errors import UserError

_SPLIT_RE = re.compile(r"^([\w.-]+)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?$")


def parse_split(split: str) -> tuple[str, str | None, str | None]:
    """`train[:1000]` -> ("train", None, "1000"); bounds may be negative or percentages (`10%`)."""
    m = _SPLIT_RE.match(split.replace(" ", ""))
    if not m:
        raise UserError(f"--split {split!r}: expected NAME or NAME[START:END], e.g. train or train[:1000]")
    return m.group(1), m.group(2), m.group(3)


def _bound(value: str | None, n: int) -> int | None:
    if value is None:
        return None
    return round(n * float(value[:-1]) / 100) if value.endswith("%") else int(value)


def slice_rows(rows: list, start: str | None, end: str | None) -> list:
    return rows[_bound(start, len(rows)) : _bound(end, len(rows))]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line"
                ) from e
    return rows


def _local_files(path: Path, split_name: str) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / split_name).is_dir():  # dir/train/*.parquet layouts
        path = path / split_name
    for pattern in ("*.parquet", "*.jsonl", "*.json"):
        files = sorted(p for p in path.glob(pattern) if p.name != MANIFEST)
        if files:
            return files
    raise UserError(f"--input-data {path}: no .parquet, .jsonl or .json files in this directory")


def load_rows(
    input_data: str, split: str = "train", dataset_name: str | None = None, shuffle_seed: int | None = None
) -> list[dict[str, Any]]:
    """Rows of a local file/dir or a HF dataset; the split's slice is applied after an optional shuffle."""
    name, start, end = parse_split(split)
    path = Path(input_data).expanduser()
    if path.exists():
        rows = [r for f in _local_files(path, name) for r in _read_file(f)]
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(rows)
        return slice_rows(rows, start, end)
    if input_data.startswith((".", "/", "~")) or Path(input_data).suffix in (".jsonl", ".json", ".parquet"):
        raise UserError(f"--input-data {input_data}: no such file or directory")
    import datasets

    try:
        if shuffle_seed is None:  # let `datasets` slice (it reads only what the slice needs)
            return datasets.load_dataset(input_data, dataset_name, split=split).to_list()
        ds = datasets.load_dataset(input_data, dataset_name, split=name).shuffle(seed=shuffle_seed)
    except Exception as e:  # hub/offline/config errors: name the flag
        raise UserError(
            f"--input-data {input_data} (split {split!r}): cannot load it as a HF dataset: {e}"
        ) from e
    rows = ds.to_list()
    return slice_rows(rows, start, end)


def _clean_message(m: Any) -> dict[str, Any] | None:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return None
    return {k: v for k, v in m.items() if v is not None}  # parquet fills absent struct fields with None


def extract_prompt(messages: Any) -> list[dict[str, Any]] | None:
    """Drop every trailing assistant turn; None when no user turn is left (the row is skipped)."""
    if isinstance(messages, str):  # JSON-encoded chats (e.g. prepared data)
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            return None
    if not isinstance(messages, list):
        return None
    cleaned = [_clean_message(m) for m in messages]
    if any(m is None for m in cleaned):
        return None
    end = len(cleaned)
    while end and cleaned[end - 1]["role"] == "assistant":
        end -= 1
    prompt = cleaned[:end]
    return prompt if any(m["role"] == "user" for m in prompt) else None


@dataclass
class Prompt:
    index: int  # row number in the input
    messages: list[dict[str, Any]]
    original: Any


def build_prompts(rows: list[dict[str, Any]], messages_column: str, source: str) -> tuple[list[Prompt], int]:
    """(usable prompts in input order, number of skipped rows)."""
    if rows and messages_column not in rows[0]:
        raise UserError(
            f"--messages-column {messages_column!r} is not a column of {source} (columns: {sorted(rows[0])})"
        )
    prompts = []
    for i, row in enumerate(rows):
        prompt = extract_prompt(row.get(messages_column))
        if prompt is not None:
            prompts.append(Prompt(i, prompt, row.get(messages_column)))
    return prompts, len(rows) - len(prompts)
