"""Build the trainable model on the meta device and parallelise it before any weight is allocated.

    torch.manual_seed(settings.train.seed)
    model = build_parallel_model(strategy, tokenizer, settings, dist_info)   # the one call of the trainer
    with compute_context(settings, dist_info): loss = strategy.loss(model, batch)

Order (torchtitan's): build on meta -> `apply_ac` -> `apply_compile` -> `apply_fsdp` (per decoder block,
then the root; `train.dtype: bfloat16` -> `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`)
-> materialise (`to_empty`) -> fill: a seeded random init bit-equal to the eager build (`models.meta`),
or pretrained weights read by rank 0 and broadcast into the shards -> DDP for `distributed.strategy:
ddp` (it replicates, so it wraps the materialised model). No rank holds the whole fp32 model it does not
need; only rank 0 reads a pretrained checkpoint in full, and a GGUF file (no meta loader) is read eagerly.

Mixed precision (`train.dtype`, float32 by default): FSDP2 casts parameters to bf16 for compute and
reduces gradients in fp32; DDP and a single process use autocast (CPU autocast supports bf16). The sharded
or replicated master weights, gradients and optimizer state stay in `model.torch_dtype` (fp32 default).
`train.autocast_dtype` is the older GPU-only knob: it still applies on CUDA when `train.dtype` is float32.

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
from torch import nn

from dllmflow.diffusion.modes import build_mode_model
from dllmflow.errors import UserError
from dllmflow.models import meta
from dllmflow.models.lora import apply_lora, init_lora_weights, is_adapter_module
from dllmflow.training.distributed import DistInfo, apply_ddp, decoder_blocks

if TYPE_CHECKING:
    from dllmflow.settings import Settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parallel_model(strategy: Any, tokenizer: Any, settings: Settings, info: DistInfo) -> nn.Module:
    """`build_mode_model(settings, tokenizer)` built on meta, transformed, sharded/replicated, materialised on
    `info.device` and filled. Seed the global RNG first: a random init is drawn from it, as eagerly."""
    check_dtype(settings, info.device)
    rng = torch.get_rng_state()  # where the eager build would start drawing
    if settings.model.gguf_file:  # transformers has no meta loader for GGUF: the eager build, as before
        eager = apply_lora(build_mode_model(settings, tokenizer).to(info.device), settings)
        return _wrap(_transform(eager, settings, info), settings, info)
    # 1) pretrained: rank 0 reads the checkpoint (seeded, so resized embedding rows match the eager build)
    state = buffers = None
    if settings.model.pretrained_model_name_or_path is not None:
        state, buffers = {}, {}
        if info.is_main:
            eager = apply_lora(build_mode_model(settings, tokenizer), settings)
            state, buffers = eager.state_dict(), meta.non_persistent_buffers(eager)
            del eager
    # 2) the skeleton, transforms and shards, no storage yet
    with meta.build_on_meta():
        model = apply_lora(build_mode_model(settings, tokenizer), settings)  # adapters before any sharding
    model = _transform(model, settings, info)
    # 3) allocate this rank's part and fill it
    meta.materialize(model, info.device, rng=rng, state_dict=state, buffers=buffers, skip=is_adapter_module)
    if state is None:
        init_lora_weights(model)  # after the base draws, as an eager build then apply_lora draws them
    del state, buffers
    return _wrap(model, settings, info)


def _transform(model: nn.Module, settings: Settings, info: DistInfo) -> nn.Module:
    t = settings.train
    apply_ac(model, t.activation_checkpointing)
    if t.compile:
        apply_compile(model, t.compile_backend)
    if info.distributed and settings.distributed.strategy == "fsdp2":
        apply_fsdp(model, param_dtype=DTYPES[t.dtype] if t.dtype != "float32" else None)
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
    """`train.dtype: bfloat16` on a device that cannot compute in it -> UserError naming the field."""
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
    """Autocast for DDP / one process under `train.dtype: bfloat16` (FSDP2 casts through its policy),
    or the legacy GPU `train.autocast_dtype` when `train.dtype` is float32; else nothing."""
    t = settings.train
    fsdp = info.distributed and settings.distributed.strategy == "fsdp2"
    if t.dtype != "float32":
        if fsdp:
            return contextlib.nullcontext()
        return torch.autocast(info.device.type, dtype=DTYPES[t.dtype])
    if info.device.type == "cuda" and t.autocast_dtype != "none":
        return torch.autocast("cuda", dtype=DTYPES[t.autocast_dtype])
    return contextlib.nullcontext()
