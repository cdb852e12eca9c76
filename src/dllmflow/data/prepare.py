"""`dllmflow prepare`: chat rows in, tokenised parquet shards + tokenizer + manifest out (the DVC stage).

    dllmflow prepare --params params/tiny_mdlm.yaml [more.yaml ...] [--force] [--workers N]
    manifest = prepare(load_settings("params/tiny_mdlm.yaml"))

With `dataset.remote_dir` the prepared set is then published to the object store (data/remote.py), where
every trainer fetches it. Layout of `dataset.prepared_dir` (docs/contracts.md): manifest.json, tokenizer/, train/shard-*.parquet,
eval/shard-*.parquet. The directory is built under a temporary name next to it and renamed into place,
so a failed or interrupted run never leaves half of one. An existing `prepared_dir` is replaced only
when its manifest proves it a prepared dataset: a file, an unrelated dir or another artefact is refused
naming the path (dllmflow.common.outputs), and one `prepare` at a time holds the dir's lock. When the
manifest's input fingerprint (dataset + tokenizer settings + source data hash) is unchanged, the
existing output is reused. A JSONL line over `dataset.max_row_bytes` or nested too deep is a malformed
row (data/chat.py), counted and named in the manifest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dllmflow.common.outputs import LOCK_FILE, hold_dir_lock

from .formats import split_key
from .gsm8k import split_of
from .prepare_units import join_prepare, plan_with_tokenizer, run_units
from .prepared_dir import SPLITS, check_prepared_dir

# ---- splitting ----------------------------------------------------------------------------------


def split_rows(rows: list[dict], eval_fraction: float, limit: int | None) -> dict[str, list[dict]]:
    """Deterministic split on the first prompt turn (so a question never lands in both splits)."""
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for row in rows:
        out[split_of(split_key(row), eval_fraction)].append(row)
    if limit is not None:
        out["train"] = out["train"][:limit]
    return out


# ---- the stage ----------------------------------------------------------------------------------


def prepare(settings, force: bool = False, workers: int = 1) -> dict:
    """Build (or reuse) `settings.dataset.prepared_dir`; returns the manifest. The dir is replaced only
    when it is a prepared dataset (its manifest proves it), and by one `prepare` at a time (its lock).
    The source streams through in units (data/prepare_units.py), `workers` processes at a time."""
    out_dir = Path(settings.dataset.prepared_dir)
    check_prepared_dir(out_dir)  # before the lock: no lock file is ever written into a dir not ours
    created = not out_dir.exists()
    with hold_dir_lock(out_dir, "prepare") as lock:
        check_prepared_dir(out_dir)  # another writer may have changed it before we held the lock
        try:
            return _prepare_locked(settings, out_dir, force, workers)
        except BaseException:
            if created and [p.name for p in out_dir.iterdir()] == [LOCK_FILE]:
                lock.unlink()  # a failed first run leaves no dir behind, as before the lock
                out_dir.rmdir()
            raise


def _prepare_locked(settings, out_dir: Path, force: bool, workers: int) -> dict:
    plan, tok = plan_with_tokenizer(settings, out_dir, force)
    if plan["reused"] is not None:
        return plan["reused"]
    try:
        run_units(settings, plan, workers, tok)
        return join_prepare(settings, plan, locked=True)
    except BaseException:
        shutil.rmtree(plan["staging"], ignore_errors=True)  # the previous dir stays as it was
        raise


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli_args(parser) -> None:
    parser.add_argument(
        "--params",
        nargs="+",
        required=True,
        metavar="YAML",
        help="Recipe YAML files (later override earlier).",
    )
    parser.add_argument("--force", action="store_true", help="Rebuild even if the inputs are unchanged.")
    parser.add_argument(
        "--workers", type=int, default=1, help="Units tokenised in parallel, one process each (default 1)."
    )


def summary_lines(manifest: dict, out_dir: str) -> list[str]:
    tok = manifest["tokenizer"]
    lines = [
        f"prepared {out_dir}  (content_hash {manifest['content_hash'][:12]})",
        f"source   {manifest['source']['path_or_dataset_id']}  rows read {manifest['source']['rows_read']}",
    ]
    for name, s in manifest["splits"].items():
        lines.append(f"{name:<8} {s['rows']} rows in {len(s['shards'])} shard(s), {s['truncated']} truncated")
    lines.append("dropped  " + ", ".join(f"{k} {v}" for k, v in sorted(manifest["dropped"].items())))
    lines.append(
        f"tokenizer {tok['name']}  vocab {tok['vocab_size']}  mask {tok['mask_token_id']}  "
        f"pad {tok['pad_token_id']}  eos {tok['eos_token_id']}  seq_length {manifest['seq_length']}"
    )
    return lines


def cli_main(args) -> int:
    from dllmflow.settings import load_settings

    settings = load_settings(*args.params)
    remote = settings.dataset.remote_dir
    if remote:  # where the pointer was before this prepare: it is published only if no one moved it since
        from .remote import pointer_etag, publish_prepared

        planned_at = pointer_etag(remote)
    manifest = prepare(settings, force=args.force, workers=args.workers)
    lines = summary_lines(manifest, settings.dataset.prepared_dir)
    if remote:
        out = publish_prepared(settings.dataset.prepared_dir, remote, planned_at)
        lines.append(
            f"published {out['set']}  ({out['uploaded_bytes']:,} bytes uploaded; {remote}/manifest.json points at it)"
        )
    try:
        from rich.console import Console

        Console().print("\n".join(lines), highlight=False)
    except ImportError:
        print("\n".join(lines))
    return 0
