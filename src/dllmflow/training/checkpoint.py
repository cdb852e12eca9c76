"""Resumable, atomic, verified checkpoints and the consolidated Hugging Face export.

Layout under `RUN/checkpoints/` (names and the LATEST pointer owned by `dllmflow.runs`):

    step_000020/model/                  torch.distributed.checkpoint (DCP): sharded under FSDP2, whole under DDP
    step_000020/optim/                  DCP optimizer state
    step_000020/rng/rank_00000.safetensors  per-rank RNG: torch/cuda states as uint8 tensors, python and
                                        numpy states as JSON in the safetensors metadata
    step_000020/trainer_state.json      step (= data position: the sampler is stateless), scheduler, world
                                        size, settings fingerprint
    step_000020/manifest.json           sha256 + size of every other file of the step dir (written last)
    step_000040/model/consolidated/     HF dir (config, safetensors, tokenizer, settings.json)
    LATEST -> step_000040               relative symlink (LATEST.txt holding the name where symlinks fail)

Save: a step dir is written under `.step_XXXXXX.tmp`; each rank hashes (and fsyncs) the files it wrote,
rank 0 gathers those entries, adds trainer_state.json and the other shared files and writes the manifest,
fsyncs every dir, renames it into place, replaces LATEST atomically, then prunes step dirs beyond
`checkpoint.keep_last`. A crash at any point leaves LATEST on a complete checkpoint. Nodes need not share
a disk: a node that does not see rank 0's files (`shares_rank0_disk`) publishes its own part the same
way, with rank 0's manifest; `checkpoint.remote_dir` (storage.py) holds the whole step dir.

Load: nothing read from a checkpoint can run code. The manifest is verified first (a flipped byte is
named); DCP `.metadata` goes through an allow-listed unpickler (torch's reader uses plain pickle), DCP
byte items and legacy `.pt` RNG files through `torch.load(weights_only=True)`; the rest is JSON or
safetensors. A resume takes LATEST or, when LATEST is missing, dangling, garbage or fails verification,
the newest complete step dir that verifies (with a CheckpointWarning); it never silently starts over,
and it refuses a checkpoint written with other settings (naming the fields). A step dir that fails on a
disk (a node's partial copy) is fetched from the remote and verified again, on every disk, against rank
0's manifest, so each rank finds whatever DCP plans for it to read.

    save_checkpoint(root, step, model, optimizer, scheduler, info, keep_last=2, export=None)
    ckpt_dir = resume_checkpoint(root, info, fetch)   # None: no checkpoint; CheckpointError: none usable
    state = load_checkpoint(ckpt_dir, model, optimizer, scheduler, info, settings_fingerprint(settings))

Storage I/O stays in a few small functions (`_hash_file`, `_write_manifest`, `_read_json`, `_publish`,
`_save_rng`, `_load_rng`, `_read_dcp_metadata`, the DCP reader) so another backend can replace them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dllmflow.common.files import atomic_write_json, fsync_dir
from dllmflow.errors import UserError
from dllmflow.runs import (
    MANIFEST,
    METRICS_JSONL,
    MODEL,
    TMP_STEP_GLOB,
    RunLayout,
    checkpoint_steps,
    latest_name,
    latest_target,
    step_dir_name,
    tmp_step_dir_name,
    write_latest,
)
from dllmflow.training.distributed import DistInfo, barrier, shares_rank0_disk

OPTIM = "optim"
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"

# The layout (step dir names, LATEST) belongs to dllmflow.runs; this name stays for callers.
update_latest = write_latest


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe to read or from other settings (the
    message names the file or the fields)."""


class CheckpointWarning(UserWarning):
    """A resume that does not take LATEST as is: a fallback, or an unverifiable (pre-manifest) checkpoint."""


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The step dir LATEST points at, or None when there is none (or it is dangling or garbage)."""
    return latest_target(root)


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step dirs (never LATEST's target) and stale tmp dirs."""
    root = Path(root)
    keep = {p for _, p in checkpoint_steps(root)[-keep_last:]}
    latest = latest_checkpoint(root)
    if latest is not None:
        keep.add(latest)
    removed = []
    for _, path in checkpoint_steps(root):
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for tmp in root.glob(TMP_STEP_GLOB):
        shutil.rmtree(tmp, ignore_errors=True)
    return removed


# ---- a fresh run, a resumed run ---------------------------------------------------------------------


def check_fresh_run(run: RunLayout, resume: bool, overwrite: bool) -> None:
    """A fresh run (neither `resume` nor `overwrite`) into a run dir that holds checkpoints would mix
    with that run's state: refuse it, naming the dir and the fix."""
    if not resume and not overwrite and run.has_checkpoints():
        raise UserError(
            f"run dir {run.root} already holds checkpoints ({run.checkpoints}); continue that run with "
            "--resume, start over with --overwrite (deletes its checkpoints and metrics), or pick "
            "another --run-dir"
        )


def clear_run(run: RunLayout) -> None:
    """What `--overwrite` deletes: the old run's checkpoints, metrics and evaluations (logs stay)."""
    shutil.rmtree(run.checkpoints, ignore_errors=True)
    shutil.rmtree(run.eval_dir, ignore_errors=True)
    (run.root / METRICS_JSONL).unlink(missing_ok=True)


def resume_checkpoint(
    root: str | os.PathLike, info: DistInfo, fetch: Callable[[str], Any] | None = None
) -> Path | None:
    """Collective: the step dir to resume from, chosen and verified on rank 0 (`select_checkpoint`)
    and sent to the others. None only when `root` holds no checkpoint at all.

    Nodes need not share a disk: a step dir that fails verification on a disk (it holds only what that
    node's ranks wrote, or nothing) is replaced by `fetch(name)` (a download from
    `checkpoint.remote_dir`) and verified again, on rank 0 while choosing, then on every node with a disk
    of its own against rank 0's manifest. Any node still failing is a CheckpointError on every rank,
    naming that node's file."""
    choice: tuple[str, str | None, dict[str, Any] | None]
    if info.is_main:
        try:
            found = select_checkpoint(root, fetch)
            listed = (
                None if found is None or not (found / MANIFEST).is_file() else _read_json(found / MANIFEST)
            )
            choice = ("ok", None if found is None else str(found), listed)
        except CheckpointError as e:
            choice = ("error", str(e), None)
    else:
        choice = ("ok", None, None)
    choice = _broadcast(choice, info)  # our own ranks over the process group, not a file: pickling is fine
    if choice[0] == "error":
        raise CheckpointError(choice[1])
    if choice[1] is None:
        return None
    chosen = Path(root) / Path(choice[1]).name  # the same name on every disk
    if info.distributed:
        Path(root).mkdir(parents=True, exist_ok=True)
        problem = None
        if _is_disk_publisher(Path(root), info) and not info.is_main and choice[2] is not None:
            problem = _ensure_copy(chosen, choice[2], fetch)
            problem = problem and f"rank {info.rank} (a node with its own disk): {problem}"
        problems = [p for p in _all_gather(problem) if p]
        if problems:
            raise CheckpointError("; ".join(problems))
    return chosen


def _ensure_copy(step_dir: Path, manifest: dict[str, Any], fetch: Callable[[str], Any] | None) -> str | None:
    """None when this node's copy of `step_dir` verifies against rank 0's `manifest` (fetched first if
    need be), else the problem."""
    try:
        _verify_or_fetch(step_dir, fetch, listed=manifest)
    except CheckpointError as e:
        if fetch is None:
            return (
                f"{e} (on a node that does not share rank 0's disk: set checkpoint.remote_dir so that "
                "a resume fetches the step dir there, or give every node one shared run dir)"
            )
        return str(e)
    return None


def _verify_or_fetch(
    step_dir: Path,
    fetch: Callable[[str], Any] | None,
    unverified_ok: bool = False,
    listed: dict[str, Any] | None = None,
) -> None:
    """`verify_checkpoint`; when it fails and `fetch` is set, `fetch(name)` replaces the dir (a download
    of the remote copy) and that is verified, its problem named if it fails too."""
    try:
        verify_checkpoint(step_dir, unverified_ok=unverified_ok, listed=listed)
        return
    except CheckpointError as e:
        if fetch is None:
            raise
        local = str(e)
    try:
        fetch(step_dir.name)
    except UserError as e:
        raise CheckpointError(f"{local}; fetching {step_dir.name} failed: {e}") from None
    verify_checkpoint(step_dir, listed=listed)


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def select_checkpoint(root: str | os.PathLike, fetch: Callable[[str], Any] | None = None) -> Path | None:
    """LATEST's step dir when it verifies; else, with a CheckpointWarning, the newest other step dir that
    does; None when there is no checkpoint at all; else CheckpointError naming each problem. With
    `fetch`, a step dir that fails (e.g. it holds only this node's part) is fetched and verified again
    before it counts as unusable."""
    root = Path(root)
    steps = checkpoint_steps(root)
    name, target = latest_name(root), latest_target(root)
    if name is None and not steps:
        return None
    problems: list[str] = []
    if target is not None:
        try:
            _verify_or_fetch(target, fetch, unverified_ok=True)
            return target
        except CheckpointError as e:
            problems.append(str(e))
            reason = f"LATEST ({target.name}) is unusable"
    elif name is not None:
        reason = f"LATEST points at {name!r}, which is not a step dir under {root}"
    else:
        reason = f"{root} has no LATEST pointer"
    for _, candidate in reversed(steps):
        if candidate == target:
            continue
        try:
            _verify_or_fetch(candidate, fetch)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        detail = f" ({problems[0]})" if problems else ""
        warnings.warn(
            f"{reason}{detail}; resuming from {candidate.name}, the newest complete checkpoint",
            CheckpointWarning,
            stacklevel=2,
        )
        return candidate
    raise CheckpointError(
        f"--resume: {reason}, and no other complete checkpoint under {root} verifies"
        + (": " + "; ".join(problems) if problems else "")
        + ". Restore the files, or start over with --overwrite"
    )


# ---- settings fingerprint ---------------------------------------------------------------------------

# Sections whose values shape the training state. Within them, fields that only set the run length, the
# logging, the throughput or where the prepared data lives may change between a save and its resume.
FINGERPRINT_SECTIONS = ("model", "tokenizer", "dataset", "dllm", "dflash", "peft", "train")
FINGERPRINT_IGNORED = frozenset(
    {
        "train.max_steps",
        "train.log_every",
        "train.peak_tflops",
        "train.num_workers",
        "train.local_batch_size",  # global batch and per-sample noise fix the numbers, not the split
        "train.activation_checkpointing",
        "train.compile",
        "train.compile_backend",
        "dataset.prepared_dir",
    }
)


def settings_fingerprint(settings) -> dict[str, Any]:
    """{"sha256": ..., "fields": {"train.lr": 0.01, ...}}: what a resume must match (stored in the
    checkpoint's trainer_state.json; the fields let a mismatch name what changed)."""
    dump = settings.model_dump(mode="json", include=set(FINGERPRINT_SECTIONS))
    fields = {k: v for k, v in _flatten(dump).items() if k not in FINGERPRINT_IGNORED}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "fields": fields}


def check_fingerprint(state: dict[str, Any], fingerprint: dict[str, Any], ckpt_dir: Path) -> None:
    saved = state.get("settings_fingerprint")
    if saved is None:
        warnings.warn(
            f"{ckpt_dir}: no settings fingerprint (an older checkpoint); not checked",
            CheckpointWarning,
            stacklevel=2,
        )
        return
    if saved.get("sha256") == fingerprint["sha256"]:
        return
    old, new, unset = saved.get("fields", {}), fingerprint["fields"], "<unset>"
    diffs = [
        f"{k}: {old.get(k, unset)!r} -> {new.get(k, unset)!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k, unset) != new.get(k, unset)
    ]
    raise CheckpointError(
        f"{ckpt_dir} was written with other settings ({'; '.join(diffs) or 'fingerprint differs'}); resume "
        "with the settings it was trained with, or start over with --overwrite"
    )


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(obj, dict) or not obj:
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


# ---- save / load ----------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    info: DistInfo,
    keep_last: int,
    extra_state: dict[str, Any] | None = None,
    export: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank calls it. `export(model_dir)` (optional, also collective) writes the
    consolidated HF dir inside the step dir before it is published. Returns the final step dir.

    Nodes need not share a disk: each rank hashes the files it wrote (its DCP shards, its RNG file) on
    its own disk, rank 0 adds the shared files (DCP metadata, trainer state, export) and writes the
    manifest, and a node that does not see rank 0's disk publishes its own part of the step dir with the
    same manifest (local rank 0: rename, LATEST, prune). A resume there fetches the rest (storage.py)."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / tmp_step_dir_name(step)
    root.mkdir(parents=True, exist_ok=True)
    publisher = _is_disk_publisher(root, info)  # rank 0, or local rank 0 of a node with its own disk
    if publisher:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # 1) sharded model + optimizer state (DCP writes one file per rank plus metadata)
    with _single_process_ok():
        dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp / MODEL))
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(tmp / OPTIM))
    # 2) RNG per rank (dropout etc.; the corruption noise is seeded per sample and needs none)
    _save_rng(_rng_file(tmp, info.rank), _rng_state())
    if export is not None:
        export(tmp / MODEL)
    # 3) manifest: each rank hashes (and fsyncs) its own files; rank 0 adds the shared ones
    own = _hash_files(tmp, [f for f in _files(tmp) if file_owner(f, info.world_size) == info.rank])
    manifest = None
    if info.is_main:
        state = {"step": step, "world_size": info.world_size, "scheduler": scheduler.state_dict()}
        state.update(extra_state or {})
        atomic_write_json(tmp / TRAINER_STATE, state)
        files = {k: v for entries in _gather_to_main(own, info) for k, v in entries.items()}
        files.update(_hash_files(tmp, [f for f in _files(tmp) if file_owner(f, info.world_size) is None]))
        manifest = {"format": 1, "files": dict(sorted(files.items()))}
    else:
        _gather_to_main(own, info)
    manifest = _broadcast(manifest, info)
    # 4) publish on every disk: manifest (fsyncs every dir), rename, LATEST, prune (rank 0's disk first)
    if info.is_main:
        _publish_step(root, tmp, final, manifest, keep_last)
    barrier()
    if publisher and not info.is_main:
        _publish_step(root, tmp, final, manifest, keep_last)
    barrier()
    return final


def _publish_step(root: Path, tmp: Path, final: Path, manifest: dict[str, Any], keep_last: int) -> None:
    _write_manifest(tmp, manifest)
    _publish(tmp, final)
    write_latest(root, final.name)
    prune_checkpoints(root, keep_last)


def file_owner(rel: str, world_size: int) -> int | None:
    """The rank that wrote a step dir file (its DCP shards `__<rank>_<i>.distcp`, its
    `rng/rank_<rank>.safetensors`); None for the shared files rank 0 writes."""
    leaf = rel.rsplit("/", 1)[-1]
    m = re.match(r"^__(\d+)_\d+\.distcp$", leaf) or re.match(r"^rank_(\d+)\.(?:safetensors|pt)$", leaf)
    return int(m.group(1)) if m and int(m.group(1)) < world_size else None


def _is_disk_publisher(root: Path, info: DistInfo) -> bool:
    """Collective: the one rank per disk that prepares and publishes step dirs there."""
    shared = shares_rank0_disk(root, info)
    return info.is_main or (info.local_rank == 0 and not shared)


def _gather_to_main(obj: Any, info: DistInfo) -> list[Any]:
    """`obj` of every rank, in rank order, on rank 0 (our own ranks over the process group)."""
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out or []


def _broadcast(obj: Any, info: DistInfo) -> Any:
    if not info.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    info: DistInfo,
    fingerprint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG in place; return trainer_state.json.
    With `fingerprint` (`settings_fingerprint`), a checkpoint of other settings is refused first."""
    ckpt_dir = Path(ckpt_dir)
    state = _read_json(ckpt_dir / TRAINER_STATE)
    if fingerprint is not None:
        check_fingerprint(state, fingerprint, ckpt_dir)
    for part in (MODEL, OPTIM):  # a clear error here, before DCP wraps it in its own
        _read_dcp_metadata(ckpt_dir / part)
    with _single_process_ok():
        model_sd = get_model_state_dict(model)
        dcp.load(model_sd, storage_reader=SafeFileSystemReader(ckpt_dir / MODEL), planner=SafeLoadPlanner())
        set_model_state_dict(model, model_sd)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        dcp.load(optim_sd, storage_reader=SafeFileSystemReader(ckpt_dir / OPTIM), planner=SafeLoadPlanner())
    set_optimizer_state_dict(model, optimizer, optim_sd)
    scheduler.load_state_dict(state["scheduler"])
    rng = _load_rng(ckpt_dir, info.rank)
    if rng is not None:  # absent when resuming on more ranks than were saved
        _set_rng_state(rng)
    return state


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded state dict on CPU (complete on rank 0; empty elsewhere under FSDP2)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every call without a process group; one in-process rank is a supported mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


# ---- manifest: sha256 of every file, fsync, publish ---------------------------------------------------


def verify_checkpoint(
    step_dir: Path, unverified_ok: bool = False, listed: dict[str, Any] | None = None
) -> None:
    """Every file the manifest lists is there with its size and sha256, else CheckpointError naming it.
    `unverified_ok`: a step dir from before manifests (no manifest, but a trainer state) passes with a
    CheckpointWarning. `listed`: check against this manifest (rank 0's) instead of the dir's own."""
    manifest = step_dir / MANIFEST
    if listed is None and not manifest.is_file():
        if unverified_ok and (step_dir / TRAINER_STATE).is_file():
            warnings.warn(
                f"{step_dir}: no {MANIFEST} (an older checkpoint); loading it unverified",
                CheckpointWarning,
                stacklevel=2,
            )
            return
        raise CheckpointError(f"{step_dir}: no {MANIFEST}, so not a complete checkpoint")
    source = manifest if listed is None else f"rank 0's {MANIFEST}"
    files = (listed if listed is not None else _read_json(manifest)).get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{source}: lists no files")
    for rel in sorted(files):  # every file there before any is hashed: a node's partial copy fails fast
        path = step_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not path.is_file():
            raise CheckpointError(f"{path}: listed in {source} but missing")
    for rel, want in sorted(files.items()):
        path = step_dir / rel
        digest, size = _hash_file(path)
        if (digest, size) != (want.get("sha256"), want.get("bytes")):
            raise CheckpointError(
                f"{path}: checksum mismatch with {source} (sha256 {digest[:12]}..., {size} bytes; "
                f"recorded {str(want.get('sha256'))[:12]}..., {want.get('bytes')} bytes): the file is corrupt"
            )


def _write_manifest(step_dir: Path, manifest: dict[str, Any] | None = None) -> None:
    """Write manifest.json (by default: hash and fsync every file under `step_dir`), fsync every dir."""
    if manifest is None:
        manifest = {"format": 1, "files": _hash_files(step_dir, _files(step_dir))}
    atomic_write_json(step_dir / MANIFEST, manifest)
    for d in sorted((p for p in step_dir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_dir(d)
    fsync_dir(step_dir)


def _files(step_dir: Path) -> list[str]:
    """Every file of a step dir but the manifest, relative, sorted."""
    return sorted(
        p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _hash_files(step_dir: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    """{rel: {"sha256", "bytes"}} of files under `step_dir`, each fsynced while it is read."""
    out = {}
    for rel in rels:
        digest, size = _hash_file(step_dir / rel, fsync=True)
        out[rel] = {"sha256": digest, "bytes": size}
    return out


def _hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():  # left by a run that died between rename and LATEST, or a corrupt one: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


# ---- DCP without unpickling arbitrary classes ----------------------------------------------------------

# What a real DCP .metadata holds (logged from find_class on model and optimizer checkpoints).
_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP metadata is made of; anything else (os.system, builtins.eval, ...)
    is an UnpicklingError before it can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == _METADATA_MODULE and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and "." not in name:
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def _read_dcp_metadata(dcp_dir: Path) -> Metadata:
    path = Path(dcp_dir) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so not a complete checkpoint") from None
    except Exception as e:  # any malformed pickle: name the file, never run or trace it further
        raise CheckpointError(
            f"{path}: refused, not plain DCP metadata ({type(e).__name__}: {e}); it may have been "
            "tampered with: restore it from a trusted copy"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: refused, holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items (optimizer param groups) with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- RNG: safetensors + JSON ---------------------------------------------------------------------------


def _rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / "rng" / f"rank_{rank:05d}.safetensors"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_rng(path: Path, state: dict[str, Any]) -> None:
    """torch/cuda states as uint8 tensors, python/numpy states as JSON in the safetensors metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"torch": state["torch"], **{f"cuda.{i}": t for i, t in enumerate(state.get("cuda", []))}}
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    meta = {
        "python": json.dumps([version, list(internal), gauss]),
        "numpy": json.dumps([name, keys.tolist(), int(pos), int(has_gauss), float(cached)]),
    }
    save_file(tensors, str(path), metadata=meta)


def _load_rng(step_dir: Path, rank: int) -> dict[str, Any] | None:
    path = _rng_file(step_dir, rank)
    legacy = path.with_suffix(".pt")  # written before safetensors: tensors and tuples only
    if not path.is_file() and not legacy.is_file():
        return None
    try:
        if not path.is_file():
            return torch.load(legacy, weights_only=True)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        version, internal, gauss = json.loads(meta["python"])
        name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
        state = {
            "torch": tensors["torch"],
            "python": (version, tuple(internal), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        }
        cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
        if cuda:
            state["cuda"] = cuda
        return state
    except Exception as e:  # any malformed file: name it (nothing in either format can run code)
        bad = path if path.is_file() else legacy
        raise CheckpointError(f"{bad}: unreadable RNG state ({type(e).__name__}: {e})") from None
