"""Pretrained safetensors weights read straight into a sharded model: each rank reads only its rows.

FSDP2 places every parameter as `Shard(0)`: rank r holds rows [r·c, (r+1)·c) with c = ceil(rows / W).
Instead of rank 0 loading the whole model and broadcasting it (which needs the full model in rank 0's
host memory), every rank opens the checkpoint's safetensors files and reads, per parameter, the slice
its local shard covers (`safe_open(...).get_slice(name)[rows]`): the per-rank peak is about the shard,
not the model. Unsharded (DDP, one process) parameters are read whole.

    loader = sharded_loader(model, ckpt_dir)   # None: use the rank-0 path (resized vocabulary, a class
                                               #       with checkpoint key conversions, no safetensors)
    errors = loader.load(device)               # collective-free; then agree_on_errors(errors) on all ranks

A tensor the model needs that the files (or their index) lack, one stored with another shape, an
integer tensor where the model holds floats, and a non-finite value in any rank's slice are collected
and turned into one UserError naming the tensor on every rank (`agree_on_errors`), so no rank waits in
a collective for one that failed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dllmflow.models.integrity import (
    FLOAT_DTYPES,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointFileError,
    check_checkpoint_files,
)

_ADAPTER_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


@dataclass
class ShardedLoader:
    """Which file holds each checkpoint tensor the model reads, and the model's tensors to fill."""

    ckpt: Path
    files: dict[str, Path]  # checkpoint key -> safetensors file
    header: dict[str, tuple[str, list[int]]]  # checkpoint key -> (dtype, shape)
    targets: dict[str, str]  # model tensor name -> checkpoint key
    errors: list[str]  # found from the headers alone (identical on every rank)

    def load(self, model: nn.Module) -> list[str]:
        """Fill every target of the materialised `model` with its slice; the errors met (this rank's),
        never raises for a tensor."""
        from safetensors import safe_open

        errors = list(self.errors)
        state = _unique_state(model)
        by_file: dict[Path, list[tuple[str, Tensor]]] = {}
        for name, key in self.targets.items():
            by_file.setdefault(self.files[key], []).append((key, state[name]))
        for path, items in by_file.items():
            with safe_open(path, framework="pt") as f:
                for key, dst in items:
                    try:
                        _fill(dst, f.get_slice(key))
                    except Exception as e:  # noqa: BLE001 - any read failure becomes that tensor's error
                        errors.append(f"{key}: cannot read it ({type(e).__name__}: {e})")
                        continue
                    if dst.is_floating_point() and not bool(torch.isfinite(_local(dst)).all()):
                        errors.append(f"{key}: holds non-finite values (NaN or inf)")
        return errors


def sharded_loader(model: nn.Module, ckpt: str | os.PathLike) -> ShardedLoader | None:
    """The plan to load `ckpt` into `model` (built on meta, possibly sharded), or None when this path
    does not apply and the rank-0 path must: no safetensors, a class whose checkpoint keys transformers
    converts, or a vocabulary resized beyond the checkpoint's rows (its new rows are drawn as the eager
    build draws them)."""
    ckpt = Path(ckpt)
    if not ((ckpt / SAFETENSORS).is_file() or (ckpt / SAFETENSORS_INDEX).is_file()):
        return None
    root, prefix = _hf_root(model)
    if root is None or _converts_keys(root):
        return None
    header = check_checkpoint_files(ckpt)  # every file whole (headers only); CheckpointFileError else
    files = _tensor_files(ckpt, header)
    header = {k: v for k, v in header.items() if k in files}  # what the index does not list is not there
    targets, errors = {}, []
    embeddings = _embedding_names(model, root)
    aliases = _aliases(model)
    for name, tensor in _unique_state(model).items():
        if "lora_" in name or not name.startswith(prefix):
            continue  # adapters: initialised by their owner, not read
        # a tied tensor (head = embedding, DiffusionGemma's shared encoder/decoder layers) is saved once,
        # under any one of its names
        keys = (_checkpoint_key(alias[len(prefix) :], header, root) for alias in aliases[name])
        key = next((k for k in keys if k is not None), None)
        if key is None:
            if not _ignored(name[len(prefix) :], root, "_keys_to_ignore_on_load_missing"):
                errors.append(f"{name[len(prefix) :]}: missing from {_where(ckpt)}")
            continue
        dtype, shape = header[key]
        if list(tensor.shape) != list(shape):
            if name in embeddings and tensor.shape[0] > shape[0] and list(tensor.shape[1:]) == shape[1:]:
                return None  # a tokenizer that gained tokens: resized rows, the rank-0 path
            errors.append(
                f"{key}: shape {list(shape)} in the checkpoint, the model expects {list(tensor.shape)}"
            )
            continue
        if tensor.is_floating_point() and dtype not in FLOAT_DTYPES:
            errors.append(f"{key}: stored as {dtype} where the model holds floats")
            continue
        targets[name] = key
    return ShardedLoader(ckpt, files, header, targets, errors)


def agree_on_errors(errors: list[str], where: str) -> None:
    """Collective when distributed: every rank raises the same UserError if any rank met an error."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors)  # our own ranks' strings: pickling is fine
        errors = [e for rank_errors in gathered for e in rank_errors]
    errors = sorted(set(errors))
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CheckpointFileError(f"{where}: {errors[0]}{more}")


# ---- helpers ----------------------------------------------------------------------------------------


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "device_mesh") else t.data


def _fill(dst: Tensor, source) -> None:
    """Copy the slice of `source` (a safetensors slice of the full tensor) that `dst` holds locally."""
    local = _local(dst)
    if hasattr(dst, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
        if 0 in shape:  # a rank past the last row holds nothing
            return
        rows = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    else:
        rows = tuple(slice(0, s) for s in dst.shape)
    part = source[rows] if rows else source[:]
    with torch.no_grad():
        local.copy_(part.to(local.dtype))


def _unique_state(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and persistent buffers by their first name (a tied head is its embedding's slot)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """First name of each tensor -> all its names (in state-dict order)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return {group[0]: group for group in names.values()}


def _hf_root(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The outermost transformers model inside `model` (a wrapper's `.model`) and its name prefix."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return module, f"{name}." if name else ""
    return None, ""


def _converts_keys(root: nn.Module) -> bool:
    from transformers.conversion_mapping import get_model_conversion_mapping

    return bool(get_model_conversion_mapping(root, add_legacy=False))


def _embedding_names(model: nn.Module, root: nn.Module) -> set[str]:
    """Full names of the input / output embedding weights (the rows a tokenizer's new tokens add)."""
    wanted = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(root, get)()
        except (AttributeError, NotImplementedError):  # a model without embeddings (a DFlash draft)
            continue
        if module is not None:
            wanted.add(id(module))
    return {f"{name}.weight" for name, m in model.named_modules() if id(m) in wanted}


def _checkpoint_key(name: str, header: dict, root: nn.Module) -> str | None:
    """The checkpoint's key for the model's tensor `name`: adapter wrappers dropped; saved with or
    without the base model prefix (`model.`)."""
    key = _ADAPTER_PARTS.sub("", name)
    base = f"{getattr(root, 'base_model_prefix', '')}."
    for candidate in (key, key[len(base) :] if key.startswith(base) else base + key):
        if candidate in header:
            return candidate
    return None


def _ignored(name: str, root: nn.Module, attr: str) -> bool:
    return any(re.search(p, name) for p in getattr(root, attr, None) or ())


def _tensor_files(ckpt: Path, header: dict) -> dict[str, Path]:
    index = ckpt / SAFETENSORS_INDEX
    if not index.is_file():
        return dict.fromkeys(header, ckpt / SAFETENSORS)
    weight_map = json.loads(index.read_text())["weight_map"]
    # a tensor the index lists but no file holds is "missing from the index's files" for the model
    return {k: ckpt / f for k, f in weight_map.items() if k in header}


def _where(ckpt: Path) -> str:
    return SAFETENSORS_INDEX if (ckpt / SAFETENSORS_INDEX).is_file() else str(ckpt / SAFETENSORS)


def pretrained_dir(name: str) -> Path | None:
    """A local dir holding `name`'s safetensors: the dir itself, or the HF cache's snapshot (never a
    download: an uncached hub id takes the rank-0 path, which downloads)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached / not a repo id
        return None


__all__ = ["ShardedLoader", "agree_on_errors", "pretrained_dir", "sharded_loader"]
