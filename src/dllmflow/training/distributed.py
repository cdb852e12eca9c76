"""The process group: setup, collectives, and the DDP wrapper for the trainer.

    dist_info = init_distributed(settings)    # torchrun env -> process group; plain python -> world 1
    model = apply_ddp(model, dist_info.device)  # FSDP2 sharding lives in parallelize.apply_fsdp
    with grad_sync(model, enabled=is_last_micro_batch): loss.backward()

Nodes with a disk of their own: `shares_rank0_disk(path, info)` tells each rank whether it sees the files
rank 0 writes under `path` (checkpoints then publish and verify once per disk, not once per run).

Backend: `distributed.backend` (`auto` = nccl when CUDA is available, else gloo). Without torchrun's
env (RANK/WORLD_SIZE) the trainer runs in-process as a single rank and no process group is created.
"""

from __future__ import annotations

import contextlib
import gc
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from dllmflow.settings import Settings


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    distributed: bool  # a process group exists (launched by torchrun)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(settings: Settings) -> DistInfo:
    """Join the process group torchrun set up (env://); pick the device from LOCAL_RANK."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = settings.distributed.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if not launched:
        return DistInfo(0, 0, 1, device, False)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, True)


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: modules whose class the model lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:  # fall back to the children of any `layers` ModuleList
        for name, module in model.named_modules():
            if name.endswith("layers") and isinstance(module, nn.ModuleList):
                blocks.extend(module)
    return blocks


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter for all but the last micro-batch of a step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        ctx = contextlib.nullcontext() if enabled else model.no_sync()
        with ctx:
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place SUM over all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group, after freeing what still holds it. A DDP model lives in a reference
    cycle, so only the garbage collector frees it; run after the group is destroyed (at exit, say), its
    Reducer drops the group's last reference and the group's destructor joins gloo's worker threads while
    holding the GIL, which a worker may need to free a finished collective's tensors: a rank then hangs
    at exit. Collected first, the Reducer only drops a reference the group registry still shares."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def shares_rank0_disk(path: str | os.PathLike, info: DistInfo) -> bool:
    """Collective: whether this rank sees the files rank 0 writes under `path` (rank 0 itself, the ranks
    of its node, every rank when all nodes mount one volume); False on a node with a disk of its own.
    Rank 0 writes a fresh token to a probe file and broadcasts it; each rank reads the file back.
    `path` must exist on every rank."""
    if not info.distributed:
        return True
    probe = Path(path) / ".rank0_disk_probe"
    token = [uuid.uuid4().hex if info.is_main else None]
    if info.is_main:
        probe.write_text(token[0])
    dist.broadcast_object_list(token, src=0)  # sent after the write: a reader opens a closed file
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    barrier()  # every rank has read it before it goes
    if info.is_main:
        probe.unlink(missing_ok=True)
    return seen
