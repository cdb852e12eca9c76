"""`dllmflow prepare`: chat rows in, tokenised parquet shards + tokenizer + manifest out (the DVC stage).

    dllmflow prepare --params params/tiny_mdlm.yaml [more.yaml ...] [--force] [--workers N]
    manifest = prepare(load_settings("params/tiny_mdlm.yaml"))

Layout of `dataset.prepared_dir` (docs/contracts.md): manifest.json, tokenizer/, train/shard-*.parquet,
eval/shard-*.parquet. The directory is built under a temporary name next to it and renamed into place,
so a failed or interrupted run never leaves half of one. An existing `prepared_dir` is replaced only
when its manifest proves it a prepared dataset: a file, an unrelated dir or another artefact is refused
naming the path (dllmflow.common.outputs), and one `prepare` at a time holds the dir's lock. When the
manifest's input fingerprint (dataset + tokenizer settings + source data hash) is unchanged, the
existing output is reused. A JSONL line over `dataset.max_row_bytes` or nested too deep is a malformed
row (data/chat.py), counted and named in the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from dllmflow.common.outputs import LOCK_FILE, OutputPathError, check_output_dir, hold_dir_lock
from dllmflow.errors import UserError

from .chat import ChatSource, load_chat_rows
from .formats import RowSpec, split_key
from .gsm8k import split_of
from .mixture import mix_rows
from .shards import TOKENS_SUFFIX
from .tokenizer import encode_chat

FORMAT_VERSION = 1
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
PREPARED_DIR = "dataset.prepared_dir"
_PREPARED_KEYS = frozenset({"format", "fingerprint", "splits", "content_hash"})  # what proves a manifest ours


# ---- fingerprint and reuse ------------------------------------------------------------------------


# Added after format 1 shipped: left out of the fingerprint while unset, so existing prepared data is reused.
_NEW_DATASET_KEYS = ("format", "fields", "mixture", "mixture_rows", "seed", "max_row_bytes", "task_rows")
# Read at batch time (dllmflow.data.pack), not by prepare: never part of the fingerprint.
_BATCH_TIME_KEYS = ("packing", "packing_overflow")


def _settings_used(settings) -> dict:
    dataset = settings.dataset
    unset = {k for k in _NEW_DATASET_KEYS if getattr(dataset, k) == type(dataset).model_fields[k].get_default(
        call_default_factory=True)}  # fmt: skip
    used = {
        "dataset": dataset.model_dump(mode="json", exclude={"prepared_dir", *_BATCH_TIME_KEYS, *unset}),
        "tokenizer": settings.tokenizer.model_dump(mode="json"),
    }
    if settings.tokenizer.name_or_path is None and settings.model.pretrained_model_name_or_path:
        used["model"] = {  # the tokenizer comes from the model
            k: getattr(settings.model, k)
            for k in ("pretrained_model_name_or_path", "gguf_file", "trust_remote_code")
        }
    if settings.dllm.mask_token_id is not None:
        used["dllm"] = {"mask_token_id": settings.dllm.mask_token_id}
    return used


def _fingerprint(used: dict, source_sha256: str) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "settings": used, "source": source_sha256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_manifest(prepared_dir: str | os.PathLike) -> dict | None:
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _reusable(manifest: dict | None, fingerprint: str, out_dir: Path) -> bool:
    if not manifest or manifest.get("fingerprint") != fingerprint:
        return False
    # a dir prepared before token files (no `files` checksums) is rebuilt once
    files = manifest.get("files")
    return bool(files) and all((out_dir / f).is_file() for f in files) and (out_dir / "tokenizer").is_dir()


# ---- tokenisation -------------------------------------------------------------------------------


def split_rows(rows: list[dict], eval_fraction: float, limit: int | None) -> dict[str, list[dict]]:
    """Deterministic split on the first prompt turn (so a question never lands in both splits)."""
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for row in rows:
        out[split_of(split_key(row), eval_fraction)].append(row)
    if limit is not None:
        out["train"] = out["train"][:limit]
    return out


def encode_row(tok, row: dict, mask_history: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask): a chat through its template; a text row as its tokens + eos, all supervised."""
    if "text" in row:
        ids = tok(row["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids, [1] * len(ids)
    return encode_chat(tok, row["messages"], mask_history=mask_history)


def tokenize_row(tok, row: dict, seq_length: int, mask_history: bool, drop_truncated: bool) -> dict | None:
    """One output row, or None when the supervised response does not fit `seq_length`."""
    ids, mask = encode_row(tok, row, mask_history)
    return fit_row(row, ids, mask, seq_length, drop_truncated)


def fit_row(row: dict, ids: list[int], mask: list[int], seq_length: int, drop_truncated: bool) -> dict | None:
    """The shard row of `row` encoded as (ids, mask), or None when its response does not fit."""
    if not any(mask):
        return None
    prompt_length = mask.index(1)
    last = len(mask) - 1 - mask[::-1].index(1)
    if last >= seq_length and (drop_truncated or prompt_length >= seq_length):
        return None
    ids, mask = ids[:seq_length], mask[:seq_length]
    return {
        "id": row["id"],
        "input_ids": ids,
        "loss_mask": mask,
        "prompt_length": prompt_length,
        # a text row is stored as one assistant turn (nothing to prompt with)
        "messages": json.dumps(row.get("messages") or [{"role": "assistant", "content": row["text"]}],
                               ensure_ascii=False),
        "answer": row["messages"][-1]["content"] if "messages" in row else row["text"],
    }  # fmt: skip


def content_hash(out_dir: Path) -> str:
    """sha256 over the parquet shards and tokenizer files (relative path + bytes), in a fixed order: the
    data's identity. The token files are derived from the shards (the manifest's `files` checksums
    cover them), so the same rows and tokenizer keep the hash they had before there were token files."""
    h = hashlib.sha256()
    files = sorted(
        p
        for sub in (*SPLITS, "tokenizer")
        for p in (out_dir / sub).rglob("*")
        if p.is_file() and not p.name.endswith(TOKENS_SUFFIX)
    )
    for p in files:
        h.update(str(p.relative_to(out_dir)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def _check_usable(
    settings, source: str, prompt_lengths: list[int], kept: int, dropped: Counter, examples: list[str] = ()
) -> None:
    if kept:
        return
    seq = settings.dataset.seq_length
    if prompt_lengths and min(prompt_lengths) >= seq:
        raise UserError(
            f"dataset.seq_length={seq} is shorter than every prompt (shortest prompt: {min(prompt_lengths)} "
            f"tokens); raise dataset.seq_length"
        )
    if dropped.get("truncated"):
        raise UserError(
            f"{source}: no training row fits dataset.seq_length={seq} ({dropped['truncated']} truncated); "
            f"raise dataset.seq_length or set dataset.drop_truncated: false"
        )
    reasons = ", ".join(f"{k} x{v}" for k, v in sorted(dropped.items()) if v) or "no rows"
    first = "".join(f"\n  {e}" for e in examples[:5])
    raise UserError(
        f"{source}: no usable training row (dataset.format={settings.dataset.format!r}, field "
        f"dataset.messages_column={settings.dataset.messages_column!r}; dropped: {reasons}){first}"
    )


# ---- the stage ----------------------------------------------------------------------------------


def load_source(dcfg) -> ChatSource:
    """The rows `dataset` names: one source (`path_or_dataset_id`) or a weighted `mixture` of several."""
    if dcfg.mixture is None:
        spec = RowSpec.build(dcfg.format, dcfg.fields, dcfg.messages_column)
        return load_chat_rows(
            dcfg.path_or_dataset_id, split=dcfg.split, dataset_name=dcfg.dataset_name, spec=spec,
            max_row_bytes=dcfg.max_row_bytes,
        )  # fmt: skip
    parts = []
    for i, m in enumerate(dcfg.mixture):
        spec = RowSpec.build(m.format, m.fields, dcfg.messages_column, where=f"dataset.mixture[{i}]")
        parts.append(load_chat_rows(m.path, split=m.split, dataset_name=m.dataset_name, spec=spec,
                                    max_row_bytes=dcfg.max_row_bytes))  # fmt: skip
    out = ChatSource(rows=mix_rows([(p.rows, m.weight) for p, m in zip(parts, dcfg.mixture)], dcfg.seed,
                                   dcfg.mixture_rows))  # fmt: skip
    digest = hashlib.sha256()
    for i, p in enumerate(parts):
        digest.update(f"{i}\0{p.sha256}\n".encode())
        out.dropped.update(p.dropped)
        out.examples += p.examples[: 20 - len(out.examples)]
        out.files += p.files
        out.num_read += p.num_read
    out.sha256 = digest.hexdigest()
    return out


def source_name(dcfg) -> str:
    if dcfg.mixture is None:
        return dcfg.path_or_dataset_id
    return "mixture(" + ", ".join(f"{m.path}:{m.weight:g}" for m in dcfg.mixture) + ")"


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


def check_prepared_dir(out_dir: Path) -> bool:
    """True when `out_dir` is a prepared dataset (replaceable), False when absent/empty; else
    OutputPathError naming it (a file, an unrelated dir, another artefact's manifest.json)."""
    ours = check_output_dir(out_dir, marker=MANIFEST, kind="prepared dataset", field=PREPARED_DIR)
    manifest = read_manifest(out_dir) if ours else None
    if ours and not (isinstance(manifest, dict) and _PREPARED_KEYS <= manifest.keys()):
        raise OutputPathError(
            f"{PREPARED_DIR} = {out_dir}: its {MANIFEST} is not a prepared dataset's (no "
            f"{'/'.join(sorted(_PREPARED_KEYS))}); refusing to replace or delete it: choose an empty or new path"
        )
    return ours


def _prepare_locked(settings, out_dir: Path, force: bool, workers: int) -> dict:
    from .prepare_units import join_prepare, make_plan, run_units

    plan = make_plan(settings, out_dir, force)
    if plan["reused"] is not None:
        return plan["reused"]
    try:
        run_units(settings, plan, workers)
        return join_prepare(settings, plan, locked=True)
    except BaseException:
        shutil.rmtree(plan["staging"], ignore_errors=True)  # the previous dir stays as it was
        raise


def _check_splits(settings, examples, split_rows: dict, kept: dict, prompt_lengths, dropped: Counter) -> None:
    dcfg, source = settings.dataset, source_name(settings.dataset)
    _check_usable(settings, source, prompt_lengths, kept["train"], dropped, examples)
    if dcfg.eval_fraction > 0 and not kept["eval"]:
        raise UserError(
            f"{source}: dataset.eval_fraction={dcfg.eval_fraction} left no held-out row ({split_rows['eval']} "
            f"before tokenising, {kept['train']} training rows); raise dataset.eval_fraction, add "
            f"rows, or set it to 0 to train on every row (then evaluate on the train split)"
        )


def _tokenizer_facts(settings, tok) -> dict:
    return {
        "name": settings.tokenizer.name_or_path
        or settings.model.pretrained_model_name_or_path
        or f"bpe-{settings.tokenizer.train_vocab_size}",
        "vocab_size": len(tok),
        "mask_token": tok.mask_token,
        "mask_token_id": tok.mask_token_id,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """rename() cannot replace a non-empty directory, so the old one (proved ours by its manifest) is
    moved into a fresh empty temp dir first, then deleted. The held lock file is hard-linked into the
    new dir first: the same inode, so the lock stays held across the swap."""
    lock = out_dir / LOCK_FILE
    if lock.is_file():
        with contextlib.suppress(OSError):  # no hard links on this filesystem: the lock lapses at the swap
            os.link(lock, tmp / LOCK_FILE)
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old)  # onto an empty dir of our own making: allowed, atomic
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)  # the swap failed halfway: the previous dataset goes back
        raise
    os.chmod(out_dir, 0o755)  # mkdtemp creates 0700
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    manifest = prepare(settings, force=args.force, workers=args.workers)
    lines = summary_lines(manifest, settings.dataset.prepared_dir)
    try:
        from rich.console import Console

        Console().print("\n".join(lines), highlight=False)
    except ImportError:
        print("\n".join(lines))
    return 0
