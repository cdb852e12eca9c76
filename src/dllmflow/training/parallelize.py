"""Build the trainable model on the meta device and parallelise it before any weight is allocated.

    torch.manual_seed(settings.train.seed)
    model = build_parallel_model(tokenizer, settings, dist_info)   # the one call of the trainer
    with compute_context(settings, dist_info): loss = strategy.loss(model, batch)

Order (torchtitan's): build on meta -> `apply_ac` -> `apply_compile` -> `apply_fsdp` (per decoder block,
then the root; `train.dtype: bfloat16` -> `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`)
-> materialise (`to_empty`) -> fill: a seeded random init bit-equal to the eager build (`models.meta`),
or pretrained weights -> DDP for `distributed.strategy: ddp` (it replicates, so it wraps the materialised
model). Pretrained safetensors (a local dir or the HF cache) are read by every rank, each only the rows
its shards hold (`models.sharded_load`; peak ~0.5x the fp32 model per rank at 2 ranks, bench/memory.py),
adapters drawn as peft draws them. The rank-0 path (rank 0 loads the whole model and broadcasts it)
stays for what that cannot read: a vocabulary resized past the checkpoint's rows, a class whose keys
transformers converts, a hub id not in the cache (downloaded there); a GGUF file is read eagerly.

Mixed precision (`train.dtype`, float32 by default): FSDP2 casts parameters to bf16 for compute and
reduces gradients in fp32; DDP and a single process use autocast (CPU autocast supports bf16). The sharded
or replicated master weights, gradients and optimizer state stay in `model.torch_dtype` (fp32 default).
`train.dtype: float64` (CPU only) is the reference mode of the golden trajectories: the skeleton is cast
to float64 on meta, so weights, gradients and optimizer state are float64; the seeded init still draws
in fp32 (the same values as a float32 run), and the corruption noise is untouched. `compute_context`
then keeps every float32 upcast of a float64 value in float64 (`KeepFloat64`: HF's RMSNorm and rotary,
`softmax(dtype=float32)`, the losses' `.float()`), so no float32 reduction, whose rounding depends on
the CPU's SIMD width, enters the reference run.

Activation checkpointing (`train.activation_checkpointing`): `full` recomputes every decoder block in
backward, `selective` every other block (blocks 0, 2, 4, ...: about half the activation memory saved
for about half the recompute); applied per block before sharding, so FSDP2's per-block unshard covers
the recompute. `train.compile` compiles each block (`nn.Module.compile`, parameter names unchanged).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dllmflow.diffusion.modes import build_mode_model
from dllmflow.errors import UserError
from dllmflow.models import meta
from dllmflow.models.lora import apply_lora, init_lora_weights, is_adapter_module
from dllmflow.models.sharded_load import agree_on_errors, agree_on_loader, pretrained_dir, sharded_loader
from dllmflow.training.distributed import DistInfo, apply_ddp, decoder_blocks

if TYPE_CHECKING:
    from dllmflow.settings import Settings

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def build_parallel_model(tokenizer: Any, settings: Settings, info: DistInfo) -> nn.Module:
    """`build_mode_model(settings, tokenizer)` built on meta, transformed, sharded/replicated, materialised on
    `info.device` and filled. Seed the global RNG first: a random init is drawn from it, as eagerly."""
    check_dtype(settings, info.device)
    rng = torch.get_rng_state()  # where the eager build would start drawing
    if settings.model.gguf_file:  # transformers has no meta loader for GGUF: the eager build, as before
        eager = apply_lora(_master(build_mode_model(settings, tokenizer), settings).to(info.device), settings)
        return _wrap(_transform(eager, settings, info), settings, info)
    # 1) the skeleton, transforms and shards, no storage yet
    with meta.build_on_meta():
        # pre-shard; _master after the adapters: peft makes them float32 even on a float64 base
        model = _master(apply_lora(build_mode_model(settings, tokenizer), settings), settings)
    model = _transform(model, settings, info)
    # 2) pretrained: every rank reads its own shards from the safetensors (the same decision on every
    #    rank: it reads only file headers), else rank 0 reads the whole checkpoint and broadcasts it
    name = settings.model.pretrained_model_name_or_path
    local = pretrained_dir(name) if name is not None else None
    loader, error = None, None
    try:
        loader = sharded_loader(model, local) if local is not None else None
    except UserError as e:  # a damaged file header: raised on every rank, not only where it was read
        error = e
    loader = agree_on_loader(loader, error)  # collective: one path for all ranks
    state = buffers = None
    if name is not None and loader is None:
        state, buffers = {}, {}
        if info.is_main:
            torch.set_rng_state(rng)  # seeded, so resized embedding rows and adapters match the eager build
            eager = apply_lora(build_mode_model(settings, tokenizer), settings)
            state, buffers = eager.state_dict(), meta.non_persistent_buffers(eager)
            del eager
    # 3) allocate this rank's part and fill it
    on_meta = {n for n, b in model.named_buffers() if b.is_meta}  # from_pretrained's rotary tables
    fill = None
    if loader is not None:
        fill = functools.partial(_fill_sharded, loader=loader, rng=rng, where=name, buffers=on_meta)
    meta.materialize(
        model, info.device, rng=rng, state_dict=state, buffers=buffers, skip=is_adapter_module, fill=fill
    )
    if state is None and fill is None:
        init_lora_weights(model)  # after the base draws, as an eager build then apply_lora draws them
    del state, buffers
    return _wrap(model, settings, info)


def _fill_sharded(model: nn.Module, loader: Any, rng: Tensor, where: str, buffers: set[str]) -> None:
    """Each rank recomputes the skeleton's meta buffers and reads its shards; any rank's bad tensor is one
    UserError on every rank; then the adapters, drawn from the seeded state as peft draws them."""
    meta.recompute_buffers(model, buffers)
    agree_on_errors(loader.load(model), f"model.pretrained_model_name_or_path={where}")
    torch.set_rng_state(rng)
    init_lora_weights(model, like_peft=True)  # the adapters the rank-0 path's eager build held


def _master(model: nn.Module, settings: Settings) -> nn.Module:
    """`train.dtype: float64`: the whole model in float64, adapters included (call it after `apply_lora`:
    peft makes them float32 whatever the base's dtype)."""
    if settings.train.dtype != "float64":
        return model
    for module in model.modules():  # torch's grouped_mm has no float64 kernel: loop over the experts
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return model.to(torch.float64)


def _transform(model: nn.Module, settings: Settings, info: DistInfo) -> nn.Module:
    t = settings.train
    apply_ac(model, t.activation_checkpointing)
    if t.compile:
        apply_compile(model, t.compile_backend)
    if info.distributed and settings.distributed.strategy == "fsdp2":
        apply_fsdp(model, param_dtype=DTYPES[t.dtype] if t.dtype == "bfloat16" else None)
    return model


def _wrap(model: nn.Module, settings: Settings, info: DistInfo) -> nn.Module:
    if info.distributed and settings.distributed.strategy == "ddp":
        return apply_ddp(model, info.device)
    return model


# ---- the transforms ---------------------------------------------------------------------------------


def apply_fsdp(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: shard each decoder block (or the model's `fsdp_units()` groups, for blocks that share
    weights), then the root. `param_dtype` (bf16) = compute dtype; gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    units = model.fsdp_units() if hasattr(model, "fsdp_units") else decoder_blocks(model)
    for unit in units:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Activation checkpointing per decoder block: `full` (every block), `selective` (every other
    block, starting with the first), `none`. The block keeps its name and parameters (its `forward`
    is wrapped), so state dicts and checkpoints are unchanged. A model whose blocks have side effects
    lists the safe ones in `checkpoint_blocks()` (DiffusionGemma: the decoder, not the cache-writing encoder)."""
    if mode == "none":
        return model
    blocks = model.checkpoint_blocks() if hasattr(model, "checkpoint_blocks") else decoder_blocks(model)
    for i, block in enumerate(blocks):
        if mode == "full" or i % 2 == 0:
            block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # non-reentrant: takes kwargs, works under no_grad and composes with FSDP2 and compile
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """`torch.compile` each decoder block in place (repeated blocks share one compiled graph)."""
    for block in decoder_blocks(model):
        block.compile(backend=backend)
    return model


# ---- mixed precision ---------------------------------------------------------------------------------


def check_dtype(settings: Settings, device: torch.device) -> None:
    """`train.dtype: bfloat16` on a device that cannot compute in it, or float64 off the CPU -> UserError
    naming the field."""
    if settings.train.dtype == "float64" and device.type != "cpu":
        raise UserError(
            f"train.dtype=float64 is the CPU reference mode (golden tests); on {device.type} set "
            "train.dtype: bfloat16 or float32"
        )
    dflash = getattr(settings, "dflash", None)
    if (
        settings.train.dtype == "float64"
        and settings.dllm.mode == "dflash"
        and dflash.target_torch_dtype != "float64"
    ):
        raise UserError(
            "train.dtype=float64 needs the frozen target in float64: set dflash.target_torch_dtype: float64"
        )
    if settings.train.dtype != "bfloat16":
        return
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
    else:
        try:
            x = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
            ok = bool(torch.isfinite(x @ x).all())
        except RuntimeError:
            ok = False
    if not ok:
        raise UserError(
            f"train.dtype=bfloat16: this {device.type} device cannot compute in bfloat16; set train.dtype: float32"
        )


def compute_context(settings: Settings, info: DistInfo) -> contextlib.AbstractContextManager:
    """Autocast for DDP / one process under `train.dtype: bfloat16` (FSDP2 casts through its policy);
    `KeepFloat64` under float64; else nothing. Reusable: the trainer enters it once per micro-batch."""
    fsdp = info.distributed and settings.distributed.strategy == "fsdp2"
    if settings.train.dtype == "bfloat16" and not fsdp:
        return torch.autocast(info.device.type, dtype=torch.bfloat16)
    if settings.train.dtype == "float64":
        return KeepFloat64()
    return contextlib.nullcontext()


class KeepFloat64(TorchFunctionMode):
    """A float32 cast or compute dtype asked of a float64 tensor gives float64 instead (`x.float()`,
    `x.to(torch.float32)`, `softmax(x, dtype=torch.float32)`, `x.new_zeros(.., dtype=torch.float32)`).
    Model code upcasts low-precision activations this way; on a float64 model it would downcast. Values
    that are float32 to begin with (the seeded noise, `t`, `p_mask`) stay as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            if func is Tensor.float:
                return args[0]
            if func in (Tensor.to, Tensor.type):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)
