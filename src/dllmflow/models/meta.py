"""Build a model on the meta device, then materialise it: seeded random init or pretrained weights.

A model built under `build_on_meta` holds no storage, so it can be parallelised (FSDP2 shards, AC,
compile) before any rank allocates a weight; `materialize` then allocates each rank's part and fills it:

    torch.manual_seed(seed)
    with build_on_meta():                         # builders see on_meta(); from_pretrained reads no weights
        model = build(settings, tokenizer)
    rng = torch.get_rng_state()                   # the state the eager build would have started from
    ...apply_ac / fully_shard / DDP-free transforms...
    materialize(model, device, rng=rng)                       # random init: the eager build's weights
    materialize(model, device, state_dict=sd_on_rank0)        # pretrained: rank 0's tensors, broadcast

Random init replays the eager build's random draws in the eager order (`apply_seeded_init`), so the
same seed gives bit-identical weights to `build(settings, tokenizer)` on CPU, while only one module's
full tensors exist at a time. The eager order of a transformers model: each module's construction
draws (`reset_parameters` of Linear/Embedding, children first, in registration order), and at the end
of every `PreTrainedModel.__init__` its `post_init` -> `init_weights` (children first, modules already
initialised by an inner `post_init` skipped) -> `tie_weights`. Tied targets (e.g. `lm_head.weight`)
draw like the eager build did but keep their source's values. Non-persistent buffers (rotary
`inv_freq`) are recomputed by the same `_init_weights` pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

_ON_META: ContextVar[bool] = ContextVar("dllmflow_on_meta", default=False)


@contextlib.contextmanager
def build_on_meta() -> Iterator[None]:
    """Every parameter registered inside lives on the meta device (no storage; construction-time
    draws on it are no-ops). Buffers stay real CPU tensors: they are small and some hold constants
    no init function recomputes (accelerate's `init_empty_weights(include_buffers=False)`)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if _ON_META.get() and param is not None and not param.is_meta:
            kwargs = {**module._parameters[name].__dict__, "requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    token = _ON_META.set(True)
    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        _ON_META.reset(token)


@contextlib.contextmanager
def off_meta() -> Iterator[None]:
    """Inside `build_on_meta`: build a real model (a tiny target written to disk, for one)."""
    token = _ON_META.set(False)
    try:
        yield
    finally:
        _ON_META.reset(token)


def on_meta() -> bool:
    return _ON_META.get()


def pretrained_kwargs() -> dict[str, Any]:
    """Extra `from_pretrained` kwargs: under `build_on_meta`, the skeleton only (no weight is read)."""
    return {"device_map": "meta"} if on_meta() else {}


def materialize(
    model: nn.Module,
    device: torch.device,
    rng: Tensor | None = None,
    state_dict: dict[str, Tensor] | None = None,
    buffers: dict[str, Tensor] | None = None,
    skip: Callable[[str], bool] | None = None,
    fill: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Allocate the (possibly sharded) meta model on `device` and fill it: `fill(model)` when given (each
    rank reads its own shards: models/sharded_load.py), else the full `state_dict` (rank 0's under a
    process group, broadcast to the others; `buffers` = rank 0's non-persistent buffers) or, when it is
    None, the seeded eager init replayed from the RNG state `rng`."""
    shared = _shared_parameters(model)
    kept = {n: b.clone() for n, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    for name, buf in model.named_buffers():  # to_empty wipes buffers too: their construction values
        if name in kept:
            buf.copy_(kept[name])
    for (owner, name), rest in shared.items():  # to_empty gives each module its own copy: re-tie
        for module, other in rest:
            setattr(module, other, getattr(owner, name))
    if fill is not None:
        fill(model)
        return model
    if state_dict is None:
        apply_seeded_init(model, rng, skip)
        return model
    load_full_state_dict(model, state_dict, buffers or {})
    return model


def _shared_parameters(model: nn.Module) -> dict[tuple[nn.Module, str], list[tuple[nn.Module, str]]]:
    """Tied parameters: (first owner, name) -> the other (module, name) slots holding the same tensor."""
    first: dict[int, tuple[nn.Module, str]] = {}
    shared: dict[tuple[nn.Module, str], list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first and first[id(p)] != (module, name):
                shared.setdefault(first[id(p)], []).append((module, name))
            first.setdefault(id(p), (module, name))
    return shared


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
    """Collective: load a full state dict held by rank 0 into the (sharded) model on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, state_dict, options=options)
    # Non-persistent buffers (rotary tables) are not in a state dict: rank 0's values.
    for name, buf in non_persistent_buffers(model).items():
        if name in buffers:
            buf.copy_(buffers[name].to(buf.device, buf.dtype))
        if distributed:
            dist.broadcast(buf, src=0)


def load_frozen(load: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """A frozen, replicated model (no grads, eval) from `load()` (a `from_pretrained` call that merges
    `pretrained_kwargs()`): under a process group rank 0 reads the weights and broadcasts them into
    the meta-built skeleton of the other ranks; alone, `load()` as is."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        model = load().to(device)
    else:
        state, buffers = {}, {}
        if dist.get_rank() == 0:
            eager = load()
            state, buffers = eager.state_dict(), non_persistent_buffers(eager)
        with build_on_meta():
            model = load()
        materialize(model, device, state_dict=state, buffers=buffers)
        del state, buffers
    return model.eval().requires_grad_(False)


def non_persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    persistent = set(model.state_dict())
    return {n: b for n, b in model.named_buffers() if n not in persistent}


# ---- the seeded eager init, replayed ---------------------------------------------------------------


@torch.no_grad()
def apply_seeded_init(
    model: nn.Module, rng: Tensor | None = None, skip: Callable[[str], bool] | None = None
) -> None:
    """Fill a materialised model with the weights its eager build draws from the global RNG in state
    `rng` (default: the current state); leaves the global RNG where the eager build leaves it.
    `skip(child_name)`: submodules added after the eager build (LoRA adapters), left for their owner
    to fill, so they do not shift the base model's draws."""
    skip = skip or (lambda name: False)
    from transformers import PreTrainedModel

    if rng is not None:
        torch.set_rng_state(rng)
    tied = _tied_targets(model)
    for module in model.modules():  # a fresh init: nothing counts as initialised yet
        module.__dict__.pop("_is_hf_initialized", None)
    constructed: set[int] = set()

    def construct(module: nn.Module, prefix: str) -> None:
        if id(module) in constructed:  # one object registered twice was constructed once
            return
        constructed.add(id(module))
        for name, child in module._modules.items():
            if child is not None and not skip(name):
                construct(child, f"{prefix}{name}.")
        if _own_reset(module):
            _on_full_tensors(module, prefix, tied, lambda m: m.reset_parameters())
        if isinstance(module, PreTrainedModel):
            _post_init_weights(module, prefix, tied, skip)

    construct(model, "")


@torch.no_grad()
def recompute_buffers(model: nn.Module, names: set[str]) -> None:
    """Recompute the buffers `names` (ones a `from_pretrained` skeleton left on meta, e.g. rotary
    `inv_freq`, an embedding's `embed_scale`, garbage after `to_empty`) with the owning transformers
    model's `_init_weights` on their module alone. A module that also owns parameters gets them drawn
    too: call this before the checkpoint fills them (and reset the RNG after, as `_fill_sharded` does)."""
    from transformers import PreTrainedModel
    from transformers import initialization as init

    owners = {n: m for n, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    with init.guard_torch_init_functions():
        for prefix, module in model.named_modules():
            own = {f"{prefix}.{b}" if prefix else b for b in module._buffers}
            if not own & names:
                continue
            owner_name = max((o for o in owners if prefix.startswith(o)), key=len)
            owner = owners[owner_name]
            module.__dict__.pop("_is_hf_initialized", None)
            _on_full_tensors(
                module, f"{prefix}.", set(), lambda m, o=owner: o._initialize_weights(m, o.is_custom_code())
            )


def _own_reset(module: nn.Module) -> bool:
    # Leaf modules that draw in their constructor (nn.Linear, nn.Embedding, convolutions, norms).
    return hasattr(module, "reset_parameters") and not module._modules and bool(module._parameters)


def _post_init_weights(root: nn.Module, prefix: str, tied: set[str], skip: Callable[[str], bool]) -> None:
    """`root.init_weights()` (transformers' smart_apply: children first, each sub-model with its own
    `_initialize_weights`), run on full CPU copies of each module's tensors."""
    from transformers import PreTrainedModel
    from transformers import initialization as init

    def visit(module: nn.Module, fn: Callable, prefix: str) -> None:
        for name, child in module.named_children():
            if skip(name):
                continue
            sub = child._initialize_weights if isinstance(child, PreTrainedModel) else fn
            visit(child, sub, f"{prefix}{name}.")
        if getattr(module, "_is_hf_initialized", False):  # done by an inner post_init: eager skips it too
            return
        _on_full_tensors(module, prefix, tied, lambda m: fn(m, root.is_custom_code()))

    with init.guard_torch_init_functions():
        visit(root, root._initialize_weights, prefix)


def _on_full_tensors(module: nn.Module, prefix: str, tied: set[str], fn: Callable[[nn.Module], Any]) -> None:
    """Run `fn(module)` with the module's own parameters and buffers swapped for zeroed full-size fp32
    CPU tensors (the eager build's device and dtype, so the same draws give the same values), then copy
    each result into the real (possibly sharded) tensor. Tied targets draw but keep their source."""
    real = {**module._parameters, **module._buffers}
    real = {k: v for k, v in real.items() if v is not None}
    if not real:
        return fn(module)
    # parameters start from zeros (every one is drawn or set below); buffers from their current value
    scratch = {
        k: v.detach().to("cpu", _init_dtype(v), copy=True)
        if k in module._buffers
        else torch.zeros(v.shape, dtype=_init_dtype(v), device="cpu")
        for k, v in real.items()
    }
    for k, t in scratch.items():
        if k in module._parameters:
            module._parameters[k] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[k] = t
    try:
        fn(module)
        done = {k: module._parameters[k] if k in module._parameters else module._buffers[k] for k in real}
    finally:
        for k, v in real.items():
            (module._parameters if k in module._parameters else module._buffers)[k] = v
    for k, v in real.items():
        if prefix + k not in tied:
            copy_full(v, done[k])


def _init_dtype(t: Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype


def copy_full(dst: Tensor, full: Tensor) -> None:
    """Write a full tensor into `dst`: its local shard for an FSDP2 DTensor, else the whole."""
    if hasattr(dst, "device_mesh"):  # DTensor: every rank holds the same full value, no comms
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None)
        dst.to_local().copy_(local.to_local())
    else:
        dst.data.copy_(full)


def _tied_targets(model: nn.Module) -> set[str]:
    """Full names of parameters the eager build overwrote by tying them to a source (`lm_head.weight`)."""
    targets: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        keys = getattr(module, "all_tied_weights_keys", None) or {}
        targets.update(f"{prefix}.{k}" if prefix else k for k in keys)
    return targets
