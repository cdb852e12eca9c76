"""Checkpoints mirrored to object storage (`checkpoint.remote_dir: s3://bucket/runs/<name>`), so a run
that loses its local disk (a rescheduled pod, a node without a shared volume) resumes from the bucket.

    mirror_checkpoint(remote, ckpt_root, step, info, keep_last, run_dir)  # collective, after save_checkpoint (Checkpointer.save)
    restore_run(remote, ckpt_root, info, run_dir)                # collective, before resume reads LATEST (Checkpointer.find)
    download_export(remote, "step_000004", ckpt_root)            # one process: only the step dir's export, verified
    download_run_file(remote, run_dir, "metrics.jsonl", upto_step=4)   # the loss log the trainer mirrored

Remote layout (the local one of `dllmflow.runs`, with LATEST as an object holding the step dir name):

    s3://bucket/runs/<name>/step_000004/model/__0_0.distcp, .metadata, consolidated/...
    s3://bucket/runs/<name>/step_000004/trainer_state.json   uploaded last by rank 0: marks it complete
    s3://bucket/runs/<name>/LATEST                            "step_000004", written after every rank uploaded
    s3://bucket/runs/<name>/metrics.jsonl, settings.json      the run dir's own files (rank 0, before LATEST)

Each rank uploads the files it wrote itself (its DCP shards `__<rank>_*`, its `rng/rank_<rank>.safetensors`), from
its own disk; rank 0 then uploads the rest (DCP metadata, the export, manifest.json listing every rank's
files), trainer_state.json last, then the run dir's metrics.jsonl and settings.json (one PUT each,
skipped when the bucket holds those bytes already: settings.json goes up once), and LATEST. So
multi-node training needs no shared volume, and a crash or an unreachable endpoint at any point leaves
the remote LATEST on the last complete step dir. On resume, a node whose disk lacks the chosen step dir
(or holds only its own ranks' part of it) downloads the whole remote step dir and verifies it against
rank 0's manifest (`checkpointer.resume_checkpoint` with `fetch=`), so every rank reads whatever DCP
plans for it; rank 0's disk gets the remote metrics.jsonl back too, so the log stays whole. The flow
steps after training (evaluate, register, end) take only the export and those run files
(`download_export`, `download_run_file`; workflow/restore.py decides what a pod lacks). Any fsspec URL
works (s3://, gs://, a local path); for S3 the endpoint comes from DLLMFLOW_S3_ENDPOINT_URL or
AWS_ENDPOINT_URL (MinIO, moto).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dllmflow.common.files import atomic_write_bytes
from dllmflow.common.store import endpoint_url, remote_fs, retried
from dllmflow.errors import UserError
from dllmflow.runs import (
    CONSOLIDATED,
    HF_CONFIG,
    LATEST,
    MANIFEST,
    METRICS_JSONL,
    MODEL,
    SETTINGS_JSON,
    export_dir,
    latest_target,
    step_dir_name,
    write_latest,
)
from dllmflow.training.checkpoint import (  # TRAINER_STATE: written and uploaded last, marks completeness
    TRAINER_STATE,
    CheckpointError,
    file_owner,
    verify_checkpoint,
)
from dllmflow.training.distributed import DistInfo, barrier, shares_rank0_disk

_STEP_RE = re.compile(r"^step_(\d{6,})$")
# The run dir's own files the steps after training read beside the export (the loss log, what ran)
RUN_FILES = (METRICS_JSONL, SETTINGS_JSON)
T = TypeVar("T")


# ---- upload ------------------------------------------------------------------------------------------


def mirror_checkpoint(
    remote: str,
    ckpt_root: str | os.PathLike,
    step: int,
    info: DistInfo,
    keep_last: int | None = None,
    run_dir: str | os.PathLike | None = None,
) -> str:
    """Collective, after `save_checkpoint(ckpt_root, step, ...)` returned on every rank: upload this
    rank's files of the step dir, then (rank 0) the shared files, `run_dir`'s RUN_FILES and LATEST, then
    prune old remote step dirs beyond `keep_last`. An unreachable store raises a UserError on the rank
    that saw it, before LATEST moves. Returns the remote step dir."""
    ckpt_root = Path(ckpt_root)
    # save_checkpoint published the step dir on every disk (a node without rank 0's disk holds its own part)
    name = step_dir_name(step)
    local = ckpt_root / name
    mirror_step_dir(local, remote, name, rank=info.rank, world_size=info.world_size, part="own")
    barrier()
    if info.is_main:
        mirror_step_dir(local, remote, name, rank=0, world_size=info.world_size, part="shared")
        if run_dir is not None:  # the loss log up to this step: the remote one never trails LATEST
            mirror_run_files(run_dir, remote)
        publish_latest(remote, name, keep_last)
    barrier()
    return f"{remote.rstrip('/')}/{name}"


def mirror_step_dir(
    local_step_dir: str | os.PathLike,
    remote: str,
    name: str | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    part: str = "all",
) -> list[str]:
    """Upload files of a local step dir to `remote/<name>`: `part="own"` those rank `rank` wrote,
    `"shared"` everything no rank owns (DCP metadata, export, trainer_state.json last), `"all"` both
    (one process). Returns the uploaded relative paths."""
    local = Path(local_step_dir)
    name = name or local.name
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    owned = {f for f in files if file_owner(f, world_size) is not None}
    if part == "own":
        chosen = [f for f in files if file_owner(f, world_size) == rank]
    elif part == "shared":
        chosen = [f for f in files if f not in owned]
    else:
        chosen = [f for f in files if f in owned] + [f for f in files if f not in owned]
    # The state file marks the step dir complete: it goes up after everything else.
    chosen.sort(key=lambda f: f == TRAINER_STATE)
    fs, base = remote_fs(remote)
    target = f"{base}/{name}"
    try:
        for rel in chosen:
            fs.put_file(str(local / rel), f"{target}/{rel}")
    except Exception as e:
        raise _store_error(remote, f"upload of {name}", e) from None
    return chosen


def mirror_run_files(run_dir: str | os.PathLike, remote: str) -> list[str]:
    """Rank 0, before LATEST moves: the run dir's RUN_FILES to `remote/<name>`, each in one PUT (atomic:
    a reader sees the previous object or this one; the trainer's saves are sequential, so the last save
    writes last), skipped when the object already holds these bytes. Returns the names uploaded."""
    fs, base = remote_fs(remote, single_try=True)
    uploaded = []
    for name in RUN_FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        data, target = path.read_bytes(), f"{base}/{name}"
        try:
            if _retried(remote, f"upload of {name}", lambda t=target, d=data: _holds(fs, t, d)):
                continue
            _retried(remote, f"upload of {name}", lambda t=target, d=data: fs.pipe_file(t, d))
        except UserError:
            raise
        except Exception as e:  # an answer from the store (no access, a refused PUT): one line too
            raise _store_error(remote, f"upload of {name}", e) from None
        uploaded.append(name)
    return uploaded


def _holds(fs: Any, path: str, data: bytes) -> bool:
    """Whether the object at `path` is `data`: by size, then by S3's ETag (the MD5 of a one-part PUT),
    else (another store, a multipart ETag) by its bytes."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return False
    if info.get("size") != len(data):
        return False
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if etag and "-" not in etag:
        return etag == hashlib.md5(data, usedforsecurity=False).hexdigest()
    return fs.cat_file(path) == data


def publish_latest(remote: str, name: str, keep_last: int | None = None) -> None:
    """Point the remote LATEST at `remote/<name>` (one object PUT: atomic) and prune older step dirs."""
    fs, base = remote_fs(remote)
    try:
        fs.pipe_file(f"{base}/{LATEST}", (name + "\n").encode())
        if keep_last:
            steps = _remote_steps(fs, base)
            for _, old in steps[:-keep_last]:
                if old != name:
                    fs.rm(f"{base}/{old}", recursive=True)
    except Exception as e:
        raise _store_error(remote, f"publishing LATEST={name}", e) from None


# ---- download ----------------------------------------------------------------------------------------


def remote_latest(remote: str) -> str | None:
    """The complete remote step dir to resume from: the one LATEST names, else (LATEST lost) the newest
    holding trainer_state.json; None when the remote holds none."""
    fs, base = remote_fs(remote)
    try:
        if fs.exists(f"{base}/{LATEST}"):
            name = fs.cat_file(f"{base}/{LATEST}").decode().strip()
            if fs.exists(f"{base}/{name}/{TRAINER_STATE}"):
                return name
        for _, name in reversed(_remote_steps(fs, base)):
            if fs.exists(f"{base}/{name}/{TRAINER_STATE}"):
                return name
    except Exception as e:
        raise _store_error(remote, "reading LATEST", e) from None
    return None


def restore_run(
    remote: str,
    ckpt_root: str | os.PathLike,
    info: DistInfo | None = None,
    run_dir: str | os.PathLike | None = None,
) -> Path | None:
    """Collective, before a resume reads the local LATEST: when this node has no complete local
    checkpoint, download the remote's latest complete step dir into `ckpt_root` and point the local
    LATEST at it (one process per disk downloads: rank 0, and local rank 0 of a node that does not see
    rank 0's disk). Rank 0 also gets the remote metrics.jsonl into `run_dir` when its disk lost it: the
    resumed run appends to (and mirrors) the whole log, not the steps after the resume alone. Returns
    the restored step dir, or None when nothing was restored (a local checkpoint exists, or the remote
    is empty)."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    restored = None
    downloads = True
    if info is not None:
        shared = shares_rank0_disk(ckpt_root, info)  # collective: every rank asks
        downloads = info.is_main or (info.local_rank == 0 and not shared)
    if downloads and latest_target(ckpt_root) is None:
        name = remote_latest(remote)
        if name is not None:
            restored = download_step_dir(remote, name, ckpt_root)
    main = info is None or info.is_main
    if (
        restored is not None
        and main
        and run_dir is not None
        and not (Path(run_dir) / METRICS_JSONL).is_file()
    ):
        download_run_file(remote, run_dir, METRICS_JSONL, upto_step=_step_of_name(restored.name))
    if info is not None:
        barrier()
    return restored


def download_step_dir(remote: str, name: str, ckpt_root: str | os.PathLike) -> Path:
    """`remote/<name>` -> `ckpt_root/<name>` through a tmp dir (renamed when complete), then LATEST.
    A UserError when the remote holds no complete `<name>` (its trainer_state.json goes up last)."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".{name}.{os.getpid()}.download.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    fs, base = remote_fs(remote)
    try:
        complete = fs.exists(f"{base}/{name}/{TRAINER_STATE}")
    except Exception as e:
        raise _store_error(remote, f"download of {name}", e) from None
    if not complete:
        raise UserError(
            f"checkpoint.remote_dir {remote}: holds no complete {name} (no {TRAINER_STATE}); its LATEST is "
            f"{remote_latest(remote)}. A node without that step dir on its disk cannot resume from it"
        )
    try:
        fs.get(f"{base}/{name}/", str(tmp) + "/", recursive=True)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _store_error(remote, f"download of {name}", e) from None
    final = ckpt_root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_latest(ckpt_root, name)
    return final


_RERUN = (
    "check that the store is reachable (AWS_ENDPOINT_URL / DLLMFLOW_S3_ENDPOINT_URL, credentials) and rerun"
)


def download_export(remote: str, name: str, ckpt_root: str | os.PathLike) -> int:
    """Only the consolidated export (and trainer_state.json) of the complete `remote/<name>` into
    `ckpt_root/<name>`, each file checked against the remote manifest's sha256 before the dir is renamed
    into place; then LATEST. No DCP shards, no optimizer state: what reads an export needs none. The dir
    holds no manifest.json (it is not a checkpoint to resume from). Returns the bytes downloaded."""
    ckpt_root = Path(ckpt_root)
    fs, base = remote_fs(remote, single_try=True)
    try:
        manifest = json.loads(
            _retried(
                remote, f"reading {name}/{MANIFEST}", lambda: fs.cat_file(f"{base}/{name}/{MANIFEST}"), _RERUN
            )
        )
    except FileNotFoundError:
        raise UserError(f"checkpoint.remote_dir {remote}: holds no complete {name} (no {MANIFEST})") from None
    prefix = f"{MODEL}/{CONSOLIDATED}/"
    files = {r: m for r, m in manifest.get("files", {}).items() if r.startswith(prefix) or r == TRAINER_STATE}
    if f"{prefix}{HF_CONFIG}" not in files:
        raise UserError(
            f"checkpoint.remote_dir {remote}: {name} holds no consolidated export ({prefix}{HF_CONFIG}); "
            "train with checkpoint.save_consolidated: final (the default)"
        )
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".{name}.{os.getpid()}.export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel in sorted(files):
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            _retried(
                remote,
                f"download of {name}/{rel}",
                lambda rel=rel, dest=dest: fs.get_file(f"{base}/{name}/{rel}", str(dest)),
                _RERUN,
            )
        verify_checkpoint(tmp, {"files": files})
    except (CheckpointError, FileNotFoundError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"checkpoint.remote_dir {remote}: {name}'s export does not match its {MANIFEST} ({e})"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = ckpt_root / name
    if (export_dir(final) / HF_CONFIG).is_file():  # another process of this machine published it first
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    write_latest(ckpt_root, name)
    return len(json.dumps(manifest)) + sum(int(m["bytes"]) for m in files.values())


def fetch_model_export(remote: str, export: str | os.PathLike) -> int:
    """The consolidated export `export` (`<ckpt_root>/<step dir>/model/consolidated`: a run's, mirrored to
    `remote`, that run's `checkpoint.remote_dir`) onto this disk when it is not here: `download_export`
    of that step dir, one process per machine (the other ranks wait, then find it). Returns the bytes
    downloaded (0: already here). `model.remote_dir` asks it of every trainer (`Trainer.build`), so an
    adapter's trainers load the AR control's export without a shared volume."""
    from dllmflow.common.outputs import wait_beside

    export = Path(export)
    if (export / HF_CONFIG).is_file():
        return 0
    step_dir = export.parent.parent
    if export_dir(step_dir) != export or not (_STEP_RE.match(step_dir.name) or step_dir.name == LATEST):
        raise UserError(
            f"model.remote_dir {remote}: model.pretrained_model_name_or_path {export} is not a run's export "
            f"(<run>/checkpoints/<step_NNNNNN or {LATEST}>/{MODEL}/{CONSOLIDATED}), what it fetches from there"
        )
    with wait_beside(step_dir, "fetch"):
        if (export / HF_CONFIG).is_file():  # another rank of this machine fetched it meanwhile
            return 0
        name = step_dir.name if step_dir.name != LATEST else remote_latest(remote)
        if name is None:
            raise UserError(
                f"model.remote_dir {remote}: holds no checkpoint (no {LATEST}) to fetch {export} from"
            )
        return download_export(remote, name, step_dir.parent)


def download_run_file(
    remote: str, run_dir: str | os.PathLike, name: str, upto_step: int | None = None
) -> int | None:
    """`remote/<name>` (one of RUN_FILES) -> `run_dir/<name>`, written atomically; metrics records after
    `upto_step` dropped (a save that died between its upload and LATEST). None when the remote has none.
    Returns the bytes downloaded."""
    fs, base = remote_fs(remote, single_try=True)
    try:
        data = _retried(remote, f"download of {name}", lambda: fs.cat_file(f"{base}/{name}"), _RERUN)
    except FileNotFoundError:
        return None
    size = len(data)
    if upto_step is not None:
        data = b"".join(line for line in data.splitlines(keepends=True) if _record_step(line) <= upto_step)
    atomic_write_bytes(Path(run_dir) / name, data)
    return size


def _record_step(line: bytes) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a cut or foreign line: not kept


def _step_of_name(name: str) -> int:
    return int(name.rsplit("_", 1)[-1])


def _retried(remote: str, what: str, fn: Callable[[], T], then: str | None = None) -> T:
    """`fn()`, retried with backoff while the store is unreachable (common/store.py `retried`; then the
    one-line UserError naming `checkpoint.remote_dir`, ending with `then`)."""
    return retried(fn, lambda e: _store_error(remote, what, e, then))


def _remote_steps(fs: Any, base: str) -> list[tuple[int, str]]:
    if not fs.exists(base):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    return sorted((int(m.group(1)), n) for n in names if (m := _STEP_RE.match(n)))


def _store_error(remote: str, what: str, e: Exception, then: str | None = None) -> UserError:
    endpoint = endpoint_url() or "the default endpoint"
    then = then or (
        "the remote LATEST still names the last complete step dir and the local checkpoint is intact. "
        "Check that the store is reachable (AWS_ENDPOINT_URL / DLLMFLOW_S3_ENDPOINT_URL, credentials) and resume"
    )
    return UserError(
        f"checkpoint.remote_dir {remote}: {what} failed ({type(e).__name__}: {str(e)[:200]}) at {endpoint}; {then}"
    )
