"""What a prepared dataset dir is (docs/contracts.md): its manifest, input fingerprint and content hash,
the check that proves a dir one before it is replaced, the atomic swap into place, and the source rows
`dataset` names. `prepare` (data/prepare.py) and its units (data/prepare_units.py) both build on it.

    manifest = read_manifest("data/prepared/tiny_mdlm")     # None when absent or unreadable
    check_prepared_dir(Path("data/prepared/tiny_mdlm"))       # True: replaceable; raises when not ours
    source = load_source(settings.dataset)                    # ChatSource: one source or a mixture
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

from dllmflow.common.files import sha256_file_once
from dllmflow.common.outputs import LOCK_FILE, OutputPathError, check_output_dir
from dllmflow.errors import UserError

from .chat import ChatSource, load_chat_rows
from .formats import RowSpec
from .mixture import mix_rows
from .shards import TOKENS_SUFFIX, tokens_path

FORMAT_VERSION = 1
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
PREPARED_DIR = "dataset.prepared_dir"
_PREPARED_KEYS = frozenset({"format", "fingerprint", "splits", "content_hash"})  # what proves a manifest ours

# Added after format 1 shipped: left out of the fingerprint while unset, so existing prepared data is reused.
_NEW_DATASET_KEYS = ("format", "fields", "mixture", "mixture_rows", "seed", "max_row_bytes", "task_rows")
# Read at batch time (dllmflow.data.pack), not by prepare: never part of the fingerprint.
_BATCH_TIME_KEYS = ("packing", "packing_overflow")
# Where the data lives (this machine, the object store) or which published set to fetch: not what it is.
_LOCATION_KEYS = ("prepared_dir", "remote_dir", "content_hash")


def settings_used(settings) -> dict:
    dataset = settings.dataset
    unset = {k for k in _NEW_DATASET_KEYS if getattr(dataset, k) == type(dataset).model_fields[k].get_default(
        call_default_factory=True)}  # fmt: skip
    used = {
        "dataset": dataset.model_dump(mode="json", exclude={*_LOCATION_KEYS, *_BATCH_TIME_KEYS, *unset}),
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


def input_fingerprint(used: dict, source_sha256: str) -> str:
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


def reusable(manifest: dict | None, fingerprint: str, out_dir: Path) -> bool:
    if not manifest or manifest.get("fingerprint") != fingerprint:
        return False
    # a dir prepared before token files (no `files` checksums) or before their id ranges is rebuilt once
    files = manifest.get("files")
    return (
        bool(files)
        and all("ids" in m for f, m in files.items() if f.endswith(TOKENS_SUFFIX))
        and all((out_dir / f).is_file() for f in files)
        and (out_dir / "tokenizer").is_dir()
    )


# json.dumps(value, ensure_ascii=False) without building an encoder per call (json.dumps does, for any
# non-default argument): the same encoder, the same text
_dumps = json.JSONEncoder(ensure_ascii=False).encode


def fit_row(row: dict, ids: list[int], mask: list[int], seq_length: int, drop_truncated: bool) -> dict | None:
    """The shard row of `row` encoded as (ids, mask), or None when its response does not fit."""
    if 1 not in mask:
        return None
    prompt_length, last = mask.index(1), len(mask) - 1
    while mask[last] != 1:  # the last supervised token: near the end
        last -= 1
    if last >= seq_length and (drop_truncated or prompt_length >= seq_length):
        return None
    if len(ids) > seq_length:
        ids, mask = ids[:seq_length], mask[:seq_length]
    return {
        "id": row["id"],
        "input_ids": ids,
        "loss_mask": mask,
        "prompt_length": prompt_length,
        # a text row is stored as one assistant turn (nothing to prompt with)
        "messages": _dumps(row.get("messages") or [{"role": "assistant", "content": row["text"]}]),
        "answer": row["messages"][-1]["content"] if "messages" in row else row["text"],
    }  # fmt: skip


def content_hash(out_dir: Path, manifest: dict) -> str:
    """The data's identity: sha256 over the relative path and sha256 of every file the manifest lists
    (parquet shards and token files), every tokenizer file, and the tokenizer facts the ids are checked
    against, in a fixed order. Computed from the per-file checksums, so checking it reads only the
    tokenizer; a file whose bytes match its checksum then matches the hash."""
    entries = {rel: meta["sha256"] for rel, meta in manifest["files"].items()}
    entries.update(tokenizer_hashes(out_dir))
    h = hashlib.sha256(json.dumps(manifest["tokenizer"], sort_keys=True).encode() + b"\n")
    for rel in sorted(entries):
        h.update(f"{rel}\0{entries[rel]}\n".encode())
    return h.hexdigest()


def tokenizer_hashes(out_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(out_dir)): sha256_file_once(p) for p in sorted((out_dir / "tokenizer").rglob("*"))
            if p.is_file()}  # fmt: skip


# ---- what a consumer checks before it reads (docs/contracts.md: prepared data verifies itself) -------


class PreparedDataError(UserError):
    """A prepared file that is not what its manifest records: changed, swapped, cut short, ids outside
    the vocabulary, or a dir prepared before files were verified."""


def verify_file(out_dir: Path, rel: str, meta: dict) -> None:
    """`out_dir/rel` against its manifest entry (bytes, then sha256), hashed once per process: a file
    changed, cut short or swapped with another split's (the checksum is per path) is refused by name."""
    path = out_dir / rel
    fix = "run `dllmflow prepare --force --params <recipe.yaml>` to rebuild it"
    try:
        size = path.stat().st_size
    except OSError:
        raise PreparedDataError(f"{path}: missing (the manifest lists it); {fix}") from None
    if size != meta["bytes"]:
        raise PreparedDataError(f"{path}: {size} bytes, the manifest records {meta['bytes']}; {fix}")
    actual = sha256_file_once(path)
    if actual != meta["sha256"]:
        raise PreparedDataError(
            f"{path}: sha256 {actual} does not match the manifest's {meta['sha256']} (changed or swapped "
            f"since prepare wrote it); {fix}"
        )


def check_manifest(out_dir: Path, manifest: dict, split: str, vocab_size: int | None = None) -> None:
    """What opening `split` checks before any row is read (cheap: the tokenizer files are hashed, the
    shards are not): the dir was prepared with verification, its `content_hash` is its files' and
    tokenizer's, and every token file's recorded id range lies in [0, vocab_size) (default: the
    prepared tokenizer's size; training passes the model's)."""
    fix = "run `dllmflow prepare --force --params <recipe.yaml>` to rebuild it"
    shards = manifest["splits"][split]["shards"]
    tokens = [tokens_path(s) for s in shards]
    if any("ids" not in manifest["files"].get(t, {}) for t in tokens):
        raise PreparedDataError(f"{out_dir}: prepared before token files were verified (no id ranges); {fix}")
    actual = content_hash(out_dir, manifest)
    if actual != manifest["content_hash"]:
        raise PreparedDataError(
            f"{out_dir / MANIFEST}: content_hash {manifest['content_hash']} does not match its files and "
            f"tokenizer ({actual}): the manifest or tokenizer/ changed since prepare; {fix}"
        )
    vocab = manifest["tokenizer"]["vocab_size"] if vocab_size is None else vocab_size
    for t in tokens:
        ids = manifest["files"][t]["ids"]
        if ids is not None and not (0 <= ids[0] and ids[1] < vocab):
            raise PreparedDataError(
                f"{out_dir / t}: token ids span [{ids[0]}, {ids[1]}], outside the vocabulary [0, {vocab}): "
                f"the data was prepared with another tokenizer; prepare it with the model's tokenizer"
            )


def check_usable(
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


def check_splits(settings, examples, split_rows: dict, kept: dict, prompt_lengths, dropped: Counter) -> None:
    dcfg, source = settings.dataset, source_name(settings.dataset)
    check_usable(settings, source, prompt_lengths, kept["train"], dropped, examples)
    if dcfg.eval_fraction > 0 and not kept["eval"]:
        raise UserError(
            f"{source}: dataset.eval_fraction={dcfg.eval_fraction} left no held-out row ({split_rows['eval']} "
            f"before tokenising, {kept['train']} training rows); raise dataset.eval_fraction, add "
            f"rows, or set it to 0 to train on every row (then evaluate on the train split)"
        )


def tokenizer_facts(settings, tok) -> dict:
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


def swap_into_place(tmp: Path, out_dir: Path) -> None:
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
