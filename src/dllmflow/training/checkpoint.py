"""Resumable, atomic checkpoints and the consolidated Hugging Face export.

Layout under `RUN/checkpoints/` (names and the LATEST pointer owned by `dllmflow.runs`):

    step_000020/model/            torch.distributed.checkpoint (DCP): sharded under FSDP2, whole under DDP
    step_000020/optim/            DCP optimizer state
    step_000020/rng/rank_00000.pt per-rank RNG states
    step_000020/trainer_state.json step (= data position: the sampler is stateless), scheduler, world size
    step_000040/model/consolidated/  HF dir (config, safetensors, tokenizer, settings.json)
    LATEST -> step_000040         relative symlink (LATEST.txt holding the name where symlinks fail)

A step dir is written under `.step_XXXXXX.tmp` and renamed when complete, then LATEST is replaced
atomically (tmp name + os.replace), then old step dirs beyond `checkpoint.keep_last` are pruned. A
crash at any point leaves LATEST on a complete checkpoint.

    save_checkpoint(root, step, model, optimizer, scheduler, info, keep_last=2, export=None)
    state = load_checkpoint(latest_checkpoint(root), model, optimizer, scheduler, info)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
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
from dllmflow.runs import (
    MODEL,
    TMP_STEP_GLOB,
    checkpoint_steps,
    latest_target,
    step_dir_name,
    tmp_step_dir_name,
    write_latest,
)
from dllmflow.training.parallel import DistInfo, barrier

# The layout (step dir names, LATEST) belongs to dllmflow.runs; this name stays for callers.
update_latest = write_latest


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The step dir LATEST points at, or None when there is no complete checkpoint."""
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
    consolidated HF dir inside the step dir before it is published. Returns the final step dir."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / tmp_step_dir_name(step)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # 1) sharded model + optimizer state (DCP writes one file per rank plus metadata)
    with _single_process_ok():
        dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp / MODEL))
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(tmp / "optim"))
    # 2) RNG per rank (dropout etc.; the corruption noise is seeded per sample and needs none)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{info.rank:05d}.pt")
    if export is not None:
        export(tmp / MODEL)
    barrier()
    # 3) publish: state file, rename, LATEST, prune
    if info.is_main:
        state = {"step": step, "world_size": info.world_size, "scheduler": scheduler.state_dict()}
        state.update(extra_state or {})
        atomic_write_json(tmp / "trainer_state.json", state)
        if final.exists():  # left by a run that died between rename and LATEST: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_latest(root, final.name)
        prune_checkpoints(root, keep_last)
    barrier()
    return final


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    info: DistInfo,
) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG in place; return trainer_state.json."""
    ckpt_dir = Path(ckpt_dir)
    with _single_process_ok():
        model_sd = get_model_state_dict(model)
        dcp.load(model_sd, checkpoint_id=str(ckpt_dir / MODEL))
        set_model_state_dict(model, model_sd)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        dcp.load(optim_sd, checkpoint_id=str(ckpt_dir / "optim"))
    set_optimizer_state_dict(model, optimizer, optim_sd)
    state = json.loads((ckpt_dir / "trainer_state.json").read_text())
    scheduler.load_state_dict(state["scheduler"])
    rng_file = ckpt_dir / "rng" / f"rank_{info.rank:05d}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
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


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
