"""`unwrap(model)`: the model a training wrapper holds, for code that needs its class, config or forward.

DDP (and DataParallel) keep it in `.module`, `torch.compile` in `._orig_mod`; FSDP2 shards the model in
place, so there is nothing to unwrap. Wrappers may nest (a compiled DDP model): unwrap all of them.

    config = unwrap(model).config
"""

from __future__ import annotations

from torch import nn

_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    while True:
        if isinstance(model, _DATA_PARALLEL):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
