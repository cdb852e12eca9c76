"""The Checkpointer: the one owner of a run's checkpoints (DCP save/load, manifest, LATEST, remote mirror).

    ckpt = Checkpointer.from_settings(settings, RunLayout(run_dir), info)
    state = ckpt.resume(model, optimizer, scheduler)   # None: nothing to resume; else trainer_state.json
    ckpt.save(step, model, optimizer, scheduler, extra_state={"samples_seen": n}, export=write_hf_dir)

It knows nothing of diffusion or of the loop that drives it: it saves a model, an optimizer, an
optional LR scheduler and a JSON-able extra state, so the supervised Trainer and a later RL loop share
it. What a step dir holds and how it is read safely is `training/checkpoint.py`; the object store is
`training/storage.py`; names and the LATEST pointer are `dllmflow.runs`.

Save (collective): a step dir is written under `.step_XXXXXX.tmp`; each rank hashes (and fsyncs) the
files it wrote, rank 0 gathers those entries, adds trainer_state.json and the other shared files and
writes the manifest, fsyncs every dir, renames it into place, replaces LATEST atomically, then prunes
step dirs beyond `keep_last`; with `remote`, the step dir is then mirrored (storage.py), with the run dir's
metrics.jsonl and settings.json before the remote LATEST moves. A crash at any
point leaves LATEST on a complete checkpoint. Nodes need not share a disk: a node that does not see
rank 0's files (`shares_rank0_disk`) publishes its own part the same way, with rank 0's manifest.

Resume (collective): with `remote`, a node without a local checkpoint first restores the remote's
latest step dir. Rank 0 takes LATEST or, when LATEST is missing, dangling, garbage or fails
verification, the newest complete step dir that verifies; that fallback is a CheckpointWarning, also
printed as one `warning:` line on rank 0's stdout (which `dllmflow train` relays to the terminal). It
never silently starts over, and it refuses a checkpoint written with other settings (the
fingerprint, naming the fields). A step dir that fails on a disk (a node's partial copy) is fetched
from the remote and verified again, on every disk, against rank 0's manifest, so each rank finds
whatever DCP plans for it to read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dllmflow.common.files import atomic_write_json
from dllmflow.errors import UserError
from dllmflow.runs import (
    MANIFEST,
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
from dllmflow.training import storage
from dllmflow.training.checkpoint import (
    OPTIM,
    TRAINER_STATE,
    CheckpointError,
    CheckpointWarning,
    SafeFileSystemReader,
    SafeLoadPlanner,
    file_owner,
    hash_files,
    list_files,
    load_rng,
    publish_dir,
    read_dcp_metadata,
    read_json,
    rng_file,
    rng_state,
    save_rng,
    set_rng_state,
    verify_checkpoint,
    write_manifest,
)
from dllmflow.training.distributed import DistInfo, barrier, shares_rank0_disk
from dllmflow.training.fingerprint import check_fingerprint, settings_fingerprint


class Checkpointer:
    """A run's checkpoints under `root` (RUN/checkpoints). `fingerprint` (`settings_fingerprint`) is
    stored with every save and checked on every load; `remote` (an fsspec URL) mirrors every save and
    serves a resume that lacks local files, with `run_dir`'s metrics.jsonl and settings.json (what the
    steps after training read beside the export). Every method is collective: all ranks call it."""

    def __init__(
        self,
        root: str | os.PathLike,
        info: DistInfo,
        *,
        every_steps: int,
        keep_last: int = 2,
        remote: str | None = None,
        fingerprint: dict[str, Any] | None = None,
        run_dir: str | os.PathLike | None = None,
    ) -> None:
        self.root, self.info, self.run_dir = Path(root), info, run_dir
        self.every_steps, self.keep_last = every_steps, keep_last
        self.remote, self.fingerprint = remote, fingerprint

    @classmethod
    def from_settings(cls, settings, run: RunLayout, info: DistInfo) -> Checkpointer:
        c = settings.checkpoint
        return cls(
            run.checkpoints,
            info,
            every_steps=c.every_steps,
            keep_last=c.keep_last,
            remote=c.remote_dir,
            fingerprint=settings_fingerprint(settings),
            run_dir=run.root,
        )

    def due(self, step: int, last: bool = False) -> bool:
        """Whether completed step `step` saves (every `every_steps`, and always the last one)."""
        return last or step % self.every_steps == 0

    def find(self) -> Path | None:
        """The verified step dir a resume starts from (restored or fetched from `remote` where a disk
        lacks it); None when there is no checkpoint at all. Fallbacks warn on rank 0's stdout too."""
        if self.remote:  # a run that lost its local disk resumes from the object store
            storage.restore_run(self.remote, self.root, self.info, self.run_dir)
        with relay_warnings(self.info):
            return resume_checkpoint(self.root, self.info, self._fetch if self.remote else None)

    def load(self, step_dir: Path, model: nn.Module, optimizer, scheduler=None) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG from `step_dir` in place; trainer_state.json."""
        with relay_warnings(self.info):
            return load_checkpoint(step_dir, model, optimizer, scheduler, self.info, self.fingerprint)

    def resume(self, model: nn.Module, optimizer, scheduler=None) -> dict[str, Any] | None:
        """`find` + `load`: trainer_state.json (its "step" is where to continue, "dir" the step dir
        it came from), or None when there is nothing to resume from."""
        step_dir = self.find()
        if step_dir is None:
            return None
        return {**self.load(step_dir, model, optimizer, scheduler), "dir": step_dir}

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer,
        scheduler=None,
        extra_state: dict[str, Any] | None = None,
        export: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write, publish (LATEST) and mirror step dir `step`; `export(model_dir)` (collective) adds
        the consolidated HF dir before it is published. Returns the local step dir."""
        extra = dict(extra_state or {})
        if self.fingerprint is not None:
            extra["settings_fingerprint"] = self.fingerprint
        final = save_checkpoint(
            self.root, step, model, optimizer, scheduler, self.info, self.keep_last, extra, export
        )
        if self.remote:
            storage.mirror_checkpoint(self.remote, self.root, step, self.info, self.keep_last, self.run_dir)
        return final

    def _fetch(self, name: str) -> Path:
        return storage.download_step_dir(self.remote, name, self.root)


@contextlib.contextmanager
def relay_warnings(info: DistInfo) -> Iterator[None]:
    """CheckpointWarnings raised in the block, also printed as `warning: ...` on rank 0's stdout: the
    stream `dllmflow train` relays from the trainers (their stderr stays in the per-rank logs)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        yield
    for w in caught:
        if info.is_main and issubclass(w.category, CheckpointWarning):
            print(f"warning: {w.message}", flush=True)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


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
                None if found is None or not (found / MANIFEST).is_file() else read_json(found / MANIFEST)
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
    step_dir: Path, fetch: Callable[[str], Any] | None, listed: dict[str, Any] | None = None
) -> None:
    """`verify_checkpoint`; when it fails and `fetch` is set, `fetch(name)` replaces the dir (a download
    of the remote copy) and that is verified, its problem named if it fails too."""
    try:
        verify_checkpoint(step_dir, listed=listed)
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
            _verify_or_fetch(target, fetch)
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
    save_rng(rng_file(tmp, info.rank), rng_state())
    if export is not None:
        export(tmp / MODEL)
    # 3) manifest: each rank hashes (and fsyncs) its own files; rank 0 adds the shared ones
    own = hash_files(tmp, [f for f in list_files(tmp) if file_owner(f, info.world_size) == info.rank])
    manifest = None
    if info.is_main:
        sched = None if scheduler is None else scheduler.state_dict()
        state = {"step": step, "world_size": info.world_size, "scheduler": sched}
        state.update(extra_state or {})
        atomic_write_json(tmp / TRAINER_STATE, state)
        files = {k: v for entries in _gather_to_main(own, info) for k, v in entries.items()}
        files.update(hash_files(tmp, [f for f in list_files(tmp) if file_owner(f, info.world_size) is None]))
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
    write_manifest(tmp, manifest)
    publish_dir(tmp, final)
    write_latest(root, final.name)
    prune_checkpoints(root, keep_last)


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
    state = read_json(ckpt_dir / TRAINER_STATE)
    if fingerprint is not None:
        check_fingerprint(state, fingerprint, ckpt_dir)
    for part in (MODEL, OPTIM):  # a clear error here, before DCP wraps it in its own
        read_dcp_metadata(ckpt_dir / part)
    with _single_process_ok():
        model_sd = get_model_state_dict(model)
        dcp.load(model_sd, storage_reader=SafeFileSystemReader(ckpt_dir / MODEL), planner=SafeLoadPlanner())
        set_model_state_dict(model, model_sd)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        dcp.load(optim_sd, storage_reader=SafeFileSystemReader(ckpt_dir / OPTIM), planner=SafeLoadPlanner())
    set_optimizer_state_dict(model, optimizer, optim_sd)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = load_rng(ckpt_dir, info.rank)
    if rng is not None:  # absent when resuming on more ranks than were saved
        set_rng_state(rng)
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
