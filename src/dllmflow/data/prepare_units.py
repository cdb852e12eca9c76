"""`dllmflow prepare` in three parts, so a flow can fan the middle one out (one task per unit):

    plan = plan_prepare(settings)                   # under the dir's lock: reuse check, units, tokenizer
    for k in range(len(plan["source"]["units"])):   # each in its own process / Metaflow foreach task
        run_unit(settings, plan, k)                 # unit k's shards + its record into the staging dir
    manifest = join_prepare(settings, plan)         # checks every unit's files, manifest, swap into place

The plan is a JSON-able dict (a flow artifact). It creates the staging dir (a temporary sibling of
`dataset.prepared_dir`) and saves the tokenizer there: a BPE recipe fits it once, here, on one streamed
pass over the training rows. A unit (data/stream.py: records [k * task_rows, (k + 1) * task_rows) of
the source) is read a chunk at a time, each chunk's chats tokenised in one batched call, and its kept
rows written as they come into shards numbered from k * shards_per_unit (data/shards.py), then a
record of what it wrote (file -> sha256, rows) and dropped. A retried unit rewrites only its own files.
The join refuses a missing unit record, shard or checksum mismatch naming it, merges the records in
unit order (so one process and any fan-out give the same bytes and manifest), and swaps the staging
dir into place holding the dir's lock: one writer at a time, however many tasks wrote the shards.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import shutil
import tempfile
from collections import Counter
from itertools import islice
from pathlib import Path

from dllmflow.common.files import sha256_file
from dllmflow.common.outputs import hold_dir_lock
from dllmflow.common.progress import Progress
from dllmflow.errors import UserError

from .chat import MAX_EXAMPLES, ChatSource
from .formats import row_texts, split_key
from .gsm8k import split_of
from .prepared_dir import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    check_prepared_dir,
    check_splits,
    check_usable,
    content_hash,
    fit_row,
    input_fingerprint,
    read_manifest,
    reusable,
    settings_used,
    source_name,
    swap_into_place,
    tokenizer_facts,
)
from .shards import ShardWriter
from .stream import SourcePlan, check_source_unchanged, iter_unit, plan_source, same_content
from .tokenizer import build_tokenizer, encode_chats, encode_texts, load_tokenizer

CHUNK_ROWS = 512  # rows tokenised per batched call: memory is bounded by this and dataset.shard_size
UNITS_DIR = ".units"


class PrepareJoinError(UserError):
    """A unit's record or shard is missing or does not match its checksum."""


class PrepareWorkerError(UserError):
    """A `--workers N` process died (killed, out of memory) before its unit was written."""


# ---- plan ------------------------------------------------------------------------------------------


def plan_prepare(settings, force: bool = False) -> dict:
    """The plan (see the module docstring), holding `dataset.prepared_dir`'s lock while it decides."""
    out_dir = Path(settings.dataset.prepared_dir)
    check_prepared_dir(out_dir)
    with hold_dir_lock(out_dir, "prepare (plan)"):
        check_prepared_dir(out_dir)
        return make_plan(settings, out_dir, force)


def make_plan(settings, out_dir: Path, force: bool) -> dict:
    """The plan, under `out_dir`'s lock (see `plan_prepare`)."""
    return plan_with_tokenizer(settings, out_dir, force)[0]


def plan_with_tokenizer(settings, out_dir: Path, force: bool) -> tuple[dict, object]:
    """`make_plan`, and the tokenizer it saved in the staging dir (None when reused): a prepare in one
    process tokenises with it rather than loading the saved copy again (~0.15-0.3 s for a Hub tokenizer)."""
    dcfg = settings.dataset
    remove_stale_staging(out_dir)
    source = plan_source(dcfg)
    used = settings_used(settings)
    fingerprint = input_fingerprint(used, source.sha256)
    existing = read_manifest(out_dir)
    recorded = ((existing or {}).get("source") or {}).get("files")
    if not force and reusable(existing, fingerprint, out_dir) and same_content(recorded, source.fingerprint):
        return {"reused": existing, "source": {"units": [[]]}}, None
    tok = build_tokenizer(settings, _training_texts(settings, source))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tok.save_pretrained(str(staging / "tokenizer"))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    plan = {
        "reused": None,
        "out_dir": str(out_dir),
        "staging": str(staging),
        "fingerprint": fingerprint,
        "source": source.to_dict(),
        "shards_per_unit": max(1, math.ceil(dcfg.task_rows / dcfg.shard_size)),
        "manifest": {
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "seq_length": dcfg.seq_length,
            "tokenizer": tokenizer_facts(settings, tok),
            "settings": used,
        },
    }
    return plan, tok


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove what an earlier prepare of `out_dir` left beside it when it was killed: its staging dir
    (`.<name>.tmp-*`) and a swap's old copy (`.<name>.old-*`). Called holding the dir's lock, so no
    one-process prepare is writing them; a fan-out whose plan is superseded by this one fails its join
    naming its staging dir (one writer per prepared dir)."""
    removed = []
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for p in out_dir.parent.glob(pattern) if out_dir.parent.is_dir() else ():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _training_texts(settings, source: SourcePlan):
    """The texts of the training rows (after `limit`), streamed; only a trained BPE reads them. No
    training row at all is the same error as before any tokenising."""
    if settings.tokenizer.name_or_path or settings.model.pretrained_model_name_or_path:
        return iter(())
    dcfg, seen = settings.dataset, ChatSource(rows=[])
    train = 0
    for unit in source.units:
        for row in iter_unit(dcfg, unit, seen):
            if split_of(split_key(row), dcfg.eval_fraction) != "train":
                continue
            if dcfg.limit is not None and train >= dcfg.limit:
                break
            train += 1
            yield from row_texts(row)
    if not train:
        _check_columns(dcfg, seen.columns)  # a mapping to a missing column says so, not "no rows"
        dropped = Counter(seen.dropped) + Counter(source.dropped)
        check_usable(settings, source_name(dcfg), [], 0, dropped, source.examples + seen.examples)


# ---- one unit ----------------------------------------------------------------------------------------


def run_unit(settings, plan: dict, k: int, tok=None) -> dict | None:
    """Tokenise unit `k` into its shards in the staging dir; returns (and writes) its record."""
    if plan["reused"] is not None:
        return None
    dcfg, staging = settings.dataset, Path(plan["staging"])
    tok = tok if tok is not None else load_tokenizer(staging)
    unit = SourcePlan.from_dict(plan["source"]).units[k]
    first = k * plan["shards_per_unit"]
    writers = {s: ShardWriter(staging / s, first, dcfg.shard_size) for s in SPLITS}
    stats = ChatSource(rows=[])
    rec = {"unit": k, "splits": {s: {"rows": 0, "kept": 0} for s in SPLITS}, "prompt_min": None,
           "train_max": 0, "train_sum": 0}  # fmt: skip
    train_seen = 0
    with Progress(f"prepare unit {k}", sum(seg.count for seg in unit), unit="rows") as bar:
        rows_iter = iter_unit(dcfg, unit, stats)
        while True:
            with gc_paused():
                if not (chunk := list(islice(rows_iter, CHUNK_ROWS))):
                    break
                picked = []
                for row in chunk:
                    split = split_of(split_key(row), dcfg.eval_fraction)
                    if split == "train" and dcfg.limit is not None:
                        if train_seen >= dcfg.limit:
                            continue
                        train_seen += 1
                    picked.append((split, row))
                for (split, row), (ids, mask) in zip(picked, encode_rows(tok, [r for _, r in picked], dcfg)):
                    _keep(rec, writers[split], split, row, ids, mask, dcfg)
            bar.advance(len(chunk))
    files = {}
    for w in writers.values():
        files.update(w.close())
    rec.update(files=files, num_read=stats.num_read, dropped=dict(stats.dropped), examples=stats.examples,
               columns={f: sorted(c) for f, c in stats.columns.items()})  # fmt: skip
    _write_record(staging, k, rec)
    return rec


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for one chunk of rows. A chunk allocates some 10^5 lists
    and dicts (ids, words, renders) that refcounting frees and that form no cycles, yet they set off a
    collection every 700, each also walking the young survivors (the word cache, the shard's rows):
    ~10% of prepare's CPU, more in a process holding a large heap. Back on after the chunk, whose
    leftovers the next allocation's collection sees, so a cycle waits one chunk at most."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_units(settings, plan: dict, workers: int = 1, tok=None) -> None:
    """Every unit of `plan`: in this process (with `tok`, the tokenizer the plan saved, when the caller
    has it), or `workers` spawned processes (each loads the plan's tokenizer once per unit; a unit is
    large, so that is cheap)."""
    n = len(plan["source"]["units"])
    if workers <= 1 or n == 1:
        tok = tok if tok is not None else load_tokenizer(plan["staging"])
        for k in range(n):
            run_unit(settings, plan, k, tok)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    data = settings.to_dict()
    ctx = multiprocessing.get_context("spawn")  # no fork after the tokenizer's threads started
    with ProcessPoolExecutor(min(workers, n), mp_context=ctx) as pool:
        futures = [pool.submit(_run_unit_dict, data, plan, k) for k in range(n)]
        for k, f in enumerate(futures):
            try:
                f.result()
            except BrokenProcessPool:  # a worker killed (OOM killer, kill -9): its traceback says nothing
                raise PrepareWorkerError(
                    f"a prepare worker died while tokenising unit {k} of {n} (killed, or out of memory: "
                    f"--workers {workers}); nothing was published to {plan['out_dir']}: prepare again, "
                    "with fewer --workers if memory is short"
                ) from None


def _run_unit_dict(settings: dict, plan: dict, k: int) -> None:
    from dllmflow.settings import Settings

    run_unit(Settings.coerce(settings), plan, k)


def encode_rows(tok, rows: list[dict], dcfg) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per row, in order: the chats in one batched call, the text rows in another."""
    out: list = [None] * len(rows)
    chats = [i for i, r in enumerate(rows) if "text" not in r]
    for i, enc in zip(chats, encode_chats(tok, [rows[i]["messages"] for i in chats], dcfg.mask_history)):
        out[i] = enc
    texts = [i for i, r in enumerate(rows) if "text" in r]
    for i, ids in zip(texts, encode_texts(tok, [rows[i]["text"] for i in texts])):
        ids = ids + [tok.eos_token_id]
        out[i] = (ids, [1] * len(ids))
    return out


def _keep(rec: dict, writer: ShardWriter, split: str, row: dict, ids, mask, dcfg) -> None:
    rec["splits"][split]["rows"] += 1
    out = fit_row(row, ids, mask, dcfg.seq_length, dcfg.drop_truncated)
    if out is None:
        length = mask.index(1) if any(mask) else len(ids)
        rec["prompt_min"] = length if rec["prompt_min"] is None else min(rec["prompt_min"], length)
        return
    writer.add(out)
    rec["splits"][split]["kept"] += 1
    if split == "train":
        rec["train_max"] = max(rec["train_max"], len(out["input_ids"]))
        rec["train_sum"] += len(out["input_ids"])


def _write_record(staging: Path, k: int, rec: dict) -> None:
    d = staging / UNITS_DIR
    d.mkdir(exist_ok=True)
    tmp = d / f".unit-{k:06d}.json.tmp"
    tmp.write_text(json.dumps(rec, sort_keys=True))
    tmp.replace(d / f"unit-{k:06d}.json")


# ---- join --------------------------------------------------------------------------------------------


def join_prepare(settings, plan: dict, *, locked: bool = False) -> dict:
    """Check every unit's record and files, write the manifest, swap the staging dir into place (under
    the dir's lock unless the caller holds it). Refuses (PrepareJoinError) naming what is missing."""
    if plan["reused"] is not None:
        return plan["reused"]
    out_dir = Path(plan["out_dir"])
    if locked:
        return _join(settings, plan)
    with hold_dir_lock(out_dir, "prepare (join)"):
        check_prepared_dir(out_dir)
        return _join(settings, plan)


def _join(settings, plan: dict) -> dict:
    staging, out_dir = Path(plan["staging"]), Path(plan["out_dir"])
    source = SourcePlan.from_dict(plan["source"])
    check_source_unchanged(source)  # what the units read is what the plan fingerprinted
    records = [_read_record(staging, k, seg) for k, seg in enumerate(source.units)]
    files = _check_files(staging, records)
    manifest = _merge(settings, plan, source, records, files)
    manifest["content_hash"] = content_hash(staging, manifest)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    swap_into_place(staging, out_dir)
    return manifest


def _read_record(staging: Path, k: int, unit) -> dict:
    path = staging / UNITS_DIR / f"unit-{k:06d}.json"
    if not path.is_file():
        what = ", ".join(f"{s.path or s.kind}[{s.start}:{s.stop}]" for s in unit) or "no rows"
        raise PrepareJoinError(
            f"{staging}: unit {k} ({what}) has no record: its task did not finish; rerun it "
            "(run_unit(settings, plan, k)) before the join"
        )
    return json.loads(path.read_text())


def _check_files(staging: Path, records: list[dict]) -> dict[str, dict]:
    files: dict[str, dict] = {}
    for rec in records:
        for rel, meta in rec["files"].items():
            path = staging / rel
            if not path.is_file():
                raise PrepareJoinError(f"{path}: shard of unit {rec['unit']} is missing; rerun that unit")
            if sha256_file(path) != meta["sha256"]:
                raise PrepareJoinError(
                    f"{path}: shard of unit {rec['unit']} does not match its checksum; rerun that unit"
                )
            files[rel] = meta
    for split in SPLITS:  # a killed attempt's temporary files, or shards no record names
        for p in (staging / split).iterdir() if (staging / split).is_dir() else ():
            if f"{split}/{p.name}" not in files:
                p.unlink()
    shutil.rmtree(staging / UNITS_DIR)
    return files


def _merge(settings, plan: dict, source: SourcePlan, records: list[dict], files: dict) -> dict:
    dcfg = settings.dataset
    reasons = Counter(source.dropped)
    examples = list(source.examples)
    for rec in records:
        reasons.update(rec["dropped"])
        examples += rec["examples"][: MAX_EXAMPLES - len(examples)]
    columns: dict[str, set] = {}
    for rec in records:
        for f, cols in rec["columns"].items():
            columns.setdefault(f, set()).update(cols)
    _check_columns(dcfg, columns)
    split_rows = {s: sum(r["splits"][s]["rows"] for r in records) for s in SPLITS}
    kept = {s: sum(r["splits"][s]["kept"] for r in records) for s in SPLITS}
    truncated = {s: split_rows[s] - kept[s] for s in SPLITS}
    dropped = Counter({"malformed": 0, "empty": 0, "truncated": sum(truncated.values())})
    for reason, n in reasons.items():
        dropped[reason.split(":")[0]] += n
    if not split_rows["train"]:
        check_usable(settings, source_name(dcfg), [], 0, Counter(reasons), examples)
    mins = [r["prompt_min"] for r in records if r["prompt_min"] is not None]
    check_splits(settings, examples, split_rows, kept, [min(mins)] if mins else [], dropped)
    shards = {s: [f for f in files if f.startswith(f"{s}/") and f.endswith(".parquet")] for s in SPLITS}
    total = sum(r["train_sum"] for r in records)
    return {
        **plan["manifest"],
        "source": {"path_or_dataset_id": source_name(dcfg), "sha256": source.sha256,
                   "rows_read": sum(r["num_read"] for r in records), "files": source.fingerprint},
        "dropped": dict(dropped),
        "dropped_reasons": dict(sorted(reasons.items())),
        "dropped_examples": examples,
        "splits": {s: {"rows": kept[s], "truncated": truncated[s], "shards": sorted(shards[s])} for s in SPLITS},
        "train_lengths": {"max": max(r["train_max"] for r in records), "mean": round(total / kept["train"], 2)},
        "units": len(records),
        "files": dict(sorted(files.items())),
    }  # fmt: skip


def _check_columns(dcfg, columns: dict[str, set]) -> None:
    """A mapped column absent from a whole JSONL file (every unit that read part of it agrees)."""
    if dcfg.mixture is not None:
        return
    from .stream import spec_of

    spec = spec_of(dcfg)
    for f, cols in columns.items():
        if cols:
            spec.check_columns(cols, f)
