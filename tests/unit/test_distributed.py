"""training/distributed.py's teardown: `shutdown()` frees a DDP model still alive in a reference cycle
before it destroys the process group (a one-rank gloo group over a file store under tmp_path)."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch import nn

from dllmflow.training.distributed import apply_ddp, shutdown


def test_shutdown_frees_the_ddp_model_before_it_destroys_the_process_group(tmp_path, monkeypatch):
    """Freed after the group is destroyed, a DDP Reducer drops the group's last reference and the group's
    destructor joins gloo's worker threads holding the GIL; a rank of test_two_processes_match_one hung
    at exit so. With the collector off, only shutdown() can free the model before the destroy."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    collecting = gc.isenabled()
    gc.disable()
    try:

        def train() -> weakref.ref:
            model = apply_ddp(nn.Linear(4, 4), torch.device("cpu"))
            model(torch.randn(2, 4)).sum().backward()
            # DDP's own cycles depend on its features and the process's state (a full run freed it at
            # return); this one stands for them.
            model.__dict__["cycle"] = model
            return weakref.ref(model)

        ref = train()
        assert ref() is not None  # the reference cycle keeps it past its function
        freed_first, destroy = [], dist.destroy_process_group
        monkeypatch.setattr(
            dist,
            "destroy_process_group",
            lambda *a, **kw: (freed_first.append(ref() is None), destroy(*a, **kw)),
        )
        shutdown()
        assert freed_first == [True]
        assert not dist.is_initialized()
    finally:
        if collecting:
            gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
