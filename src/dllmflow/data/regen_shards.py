"""The output side of `dllmflow regenerate`: `shard-%06d.parquet` files written atomically, and the
`manifest.json` that marks a directory as a regeneration output and records the settings that change
its content (a resume refuses other settings).

    done = prepare_output_dir("data/regenerated", build_manifest(cfg), resume=True)  # shards to skip
    write_shard("data/regenerated", 3, rows, with_reasoning=False)

An existing output dir is written into only when it is this project's regeneration output, proved by
its manifest (`common.outputs.check_output_dir` + the manifest's keys), never by its name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from dllmflow.common.files import atomic_path, atomic_write_json
from dllmflow.common.outputs import OutputPathError, check_output_dir
from dllmflow.errors import UserError
from dllmflow.settings import RegenerateConfig

MANIFEST = "manifest.json"  # marks a regeneration output; never read as input rows
SHARD_RE = re.compile(r"^shard-(\d{6})\.parquet$")
# Every setting that changes what lands in the shards; output_dir and the operational knobs
# (concurrency, timeout_s, max_retries) are left out so a resume may change them.
MANIFEST_KEYS = (
    "input_data", "target_server", "model", "messages_column", "split", "dataset_name", "shuffle_seed",
    "shard_size", "max_new_tokens", "temperature", "top_p", "reasoning", "seed",
)  # fmt: skip
OPTIONAL_KEYS = {"seed"}  # added later: a manifest written before it still proves a regeneration output


def scan_shards(output_dir: str | os.PathLike) -> set[int]:
    """Indices of the finished shards (`shard-%06d.parquet`); a missing dir gives an empty set."""
    out = Path(output_dir)
    if not out.is_dir():
        return set()
    return {int(m.group(1)) for p in out.iterdir() if (m := SHARD_RE.match(p.name))}


def shard_path(output_dir: str | os.PathLike, index: int) -> Path:
    return Path(output_dir) / f"shard-{index:06d}.parquet"


def build_manifest(cfg: RegenerateConfig) -> dict[str, Any]:
    data = cfg.model_dump(mode="json")
    return {k: data[k] for k in MANIFEST_KEYS}


def read_manifest(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a regeneration output at `output_dir`; None when the path is absent or an empty
    dir. Anything else there (a file, a foreign dir, another tool's manifest.json) is refused naming the
    path: nothing in it is ever overwritten."""
    out = Path(output_dir)
    if not check_output_dir(out, marker=MANIFEST, kind="regeneration output", field="--output-dir"):
        return None
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or not set(MANIFEST_KEYS) - OPTIONAL_KEYS <= set(manifest):
        raise OutputPathError(
            f"--output-dir = {out}: its {MANIFEST} is not a regeneration manifest (another tool's output?); "
            "refusing to write into it: choose an empty or new path"
        )
    return manifest


def prepare_output_dir(output_dir: str | os.PathLike, manifest: dict[str, Any], resume: bool) -> set[int]:
    """Apply the fresh/resume rules; returns the shard indices to skip. Writes the manifest when new."""
    out = Path(output_dir)
    old = read_manifest(out)
    done = scan_shards(out)
    if done and not resume:
        raise UserError(
            f"--output-dir {out} already holds {len(done)} shard(s); pass --resume to continue that run, "
            "or choose an empty directory"
        )
    if resume and old is not None:
        now = json.loads(json.dumps(manifest))  # compare as JSON (floats, None)
        diff = sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))
        if diff:
            changes = "; ".join(f"{k}: {old.get(k)!r} (manifest) vs {now.get(k)!r} (now)" for k in diff)
            raise UserError(
                f"--resume: {out / MANIFEST} was written with different settings ({changes}); "
                "rerun with the original settings or use a new --output-dir"
            )
        return done
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / MANIFEST, manifest)
    return done


def _messages_type(with_reasoning: bool):
    import pyarrow as pa

    fields = [("role", pa.string()), ("content", pa.string())]
    fields += [("reasoning_content", pa.string())] if with_reasoning else []
    return pa.list_(pa.struct(fields))


def write_shard(
    output_dir: str | os.PathLike, index: int, rows: list[dict[str, Any]], with_reasoning: bool
) -> Path:
    """Rows `{messages, original_messages}` -> `shard-%06d.parquet`, atomically. `messages` has a fixed
    struct type so every shard of a run has the same schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = pa.array([r["messages"] for r in rows], type=_messages_type(with_reasoning))
    original = pa.array([r["original_messages"] for r in rows])
    table = pa.Table.from_arrays([messages, original], names=["messages", "original_messages"])
    path = shard_path(output_dir, index)
    with atomic_path(path) as tmp:  # a reader (or a resume) never sees half a file
        pq.write_table(table, tmp)
    return path
