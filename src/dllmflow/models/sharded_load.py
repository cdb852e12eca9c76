"""Pretrained safetensors weights read straight into a sharded model: each rank reads only its rows.

FSDP2 places every parameter as `Shard(0)`: rank r holds rows [r·c, (r+1)·c) with c = ceil(rows / W).
Instead of rank 0 loading the whole model and broadcasting it (which needs the full model in rank 0's
host memory), every rank opens the checkpoint's safetensors files and reads, per parameter, the rows
its local shard covers: one contiguous byte range of the file, read in 1 MB chunks straight into the
shard (no file mapping whose pages would stay resident, no full-tensor copy; other placements go
through safetensors' `get_slice`). The per-rank peak is about the shard, not the model (bench/memory.py:
0.52x the fp32 model at 2 ranks). Unsharded (DDP, one process) parameters are read whole.

    loader = sharded_loader(model, ckpt_dir)   # None: use the rank-0 path (resized vocabulary, a class
                                               #       with checkpoint key conversions, no safetensors)
    loader = agree_on_loader(loader, None)          # collective: the same path on every rank
    agree_on_errors(loader.load(model), where)      # collective: one UserError on every rank, or none

A tensor the model needs that the files (or their index) lack, one stored with another shape, an
integer tensor where the model holds floats, and a non-finite value in any rank's slice are collected
and turned into one UserError naming the tensor on every rank (`agree_on_errors`), so no rank waits in
a collective for one that failed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dllmflow.errors import UserError
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
        errors = list(self.errors)
        state = _unique_state(model)
        for name, key in self.targets.items():
            dst = state[name]
            try:
                finite = _fill(dst, self.files[key], key, self._offsets(self.files[key]))
            except Exception as e:  # noqa: BLE001 - any read failure becomes that tensor's error
                errors.append(f"{key}: cannot read it ({type(e).__name__}: {e})")
                continue
            if not finite:
                errors.append(f"{key}: holds non-finite values (NaN or inf)")
        return errors

    def _offsets(self, path: Path) -> tuple[int, dict]:
        """(where the data starts, the file's header) of a safetensors file, read once."""
        cache = self.__dict__.setdefault("_headers", {})
        if path not in cache:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                cache[path] = (8 + length, json.loads(f.read(length)))
        return cache[path]


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


def agree_on_loader(loader: ShardedLoader | None, error: UserError | None) -> ShardedLoader | None:
    """Collective when distributed: the sharded path only if every rank can take it (nodes may differ:
    one has the hub id cached, another does not), and a rank's header error raised on every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        votes: list = [None] * dist.get_world_size()
        dist.all_gather_object(votes, (loader is not None, None if error is None else str(error)))
        errors = sorted({e for _, e in votes if e is not None})
        if errors:
            raise CheckpointFileError(errors[0] if error is None else str(error))
        return loader if all(ok for ok, _ in votes) else None
    if error is not None:
        raise error
    return loader


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


TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
CHUNK_BYTES = 1 << 20  # bytes read per call: bounds the transients (dtype conversion, finiteness check)


def _fill(dst: Tensor, path: Path, key: str, offsets: tuple[int, dict]) -> bool:
    """Copy into `dst` the rows of tensor `key` that it holds locally (all of them unless it is an
    FSDP2 `Shard(0)` DTensor); whether they are all finite. The rows are one contiguous byte range of the
    file, read in chunks with plain reads straight into the shard (no mapping of the file, no full-tensor
    copy, each chunk checked as it lands); anything else (another placement, a dtype torch cannot view)
    goes through safetensors' `get_slice`."""
    local = _local(dst)
    start = 0
    if hasattr(dst, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
        if 0 in shape:  # a rank past the last row holds nothing
            return True
        if list(offset[1:]) != [0] * (len(offset) - 1) or list(shape[1:]) != list(dst.shape[1:]):
            return _fill_by_slice(local, path, key, offset, shape)
        start = offset[0]
    base, header = offsets
    dtype = header[key]["dtype"]
    if local.dim() == 0 or dtype not in TORCH_DTYPES or not local.is_contiguous():
        return _fill_by_slice(local, path, key, [start] + [0] * (local.dim() - 1), list(local.shape))
    src = TORCH_DTYPES[dtype]
    row_bytes = math.prod(local.shape[1:]) * src.itemsize
    first = base + header[key]["data_offsets"][0] + start * row_bytes
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    finite = True
    with open(path, "rb", buffering=0) as f, torch.no_grad():
        for r in range(0, local.shape[0], step):
            rows = local[r : r + step]
            f.seek(first + r * row_bytes)
            if rows.dtype == src:
                _read_exactly(f, rows.view(-1).view(torch.uint8).numpy(), path)
            else:
                buf = bytearray(rows.shape[0] * row_bytes)
                _read_exactly(f, memoryview(buf), path)
                rows.copy_(torch.frombuffer(buf, dtype=src).view(rows.shape))
            finite = finite and (not rows.is_floating_point() or bool(torch.isfinite(rows).all()))
    return finite


def _read_exactly(f, buf, path: Path) -> None:
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{path}: ends before the tensor's bytes")
        done += n


def _fill_by_slice(local: Tensor, path: Path, key: str, offset, shape) -> bool:
    from safetensors import safe_open

    rows = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    with safe_open(path, framework="pt") as f, torch.no_grad():  # one mapping per tensor: its pages go
        source = f.get_slice(key)
        local.copy_((source[rows] if rows else source[:]).to(local.dtype))
    return not local.is_floating_point() or bool(torch.isfinite(local).all())


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

        snapshot = Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached / not a repo id
        return None
    index = snapshot / SAFETENSORS_INDEX
    if index.is_file():  # a snapshot cached in part (config only, some shards): the rank-0 path downloads
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if not all((snapshot / f).is_file() for f in shards):
            return None
    return snapshot


__all__ = ["ShardedLoader", "agree_on_errors", "agree_on_loader", "pretrained_dir", "sharded_loader"]
