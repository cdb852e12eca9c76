"""Model files checked where they are loaded: a damaged checkpoint is one line naming the file or the
tensor, never random weights, a silent cast, NaN output or a traceback.

    header = check_checkpoint_files(ckpt)                       # before loading: every safetensors file whole
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True,
                                                       ignore_mismatched_sizes=True, ...)
    check_loaded_weights(model, info, header, where=ckpt)        # after: nothing missing, extra, reshaped,
                                                                 # integer or non-finite
    model = load_checked(ckpt, lambda: from_pretrained(...))    # the two around one load (what loaders use)

`check_checkpoint_files` reads only the safetensors headers (8-byte length + JSON): a file cut short, a
header that is not JSON, or a tensor whose byte range does not fit its dtype and shape is a
`CheckpointFileError` naming the file. `check_loaded_weights` reads transformers' load report
(`output_loading_info=True`): a tensor the model expects but the file lacks (transformers fills it with
random values), a tensor the model has no slot for, and one of another shape (`ignore_mismatched_sizes`
turns transformers' size-mismatch traceback into a report entry) are refused by name; the allow-list is
the model class's own `_keys_to_ignore_on_load_missing/unexpected` patterns (tied heads such as
`lm_head.weight` are not reported missing at all). A tensor stored as an integer where the model holds
floats (transformers casts it silently) and a non-finite weight (one `isfinite` pass per tensor) are
refused too. Used by `models.build` (training from a pretrained dir), `inference.generate`
(`load_for_generation`: generate, evaluate, the pyfunc), the chat engine and the DFlash pair loader.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# Bytes per element of each safetensors dtype; a dtype not listed is not size-checked.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # fmt: skip
FINITE_CHUNK = 1 << 24  # elements per isfinite pass
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


class CheckpointFileError(UserError):
    """A model weight file is truncated or corrupt, or its tensors do not fit the model."""


# ---- before loading: the files ------------------------------------------------------------------


def weight_files(ckpt: str | os.PathLike) -> list[Path]:
    """The safetensors files of an HF dir (its index's shards, or model.safetensors); [] if none."""
    ckpt = Path(ckpt)
    index = ckpt / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointFileError(f"{index}: not a safetensors index (no weight_map)") from None
        files = [ckpt / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointFileError(f"{f}: listed in {index.name} but missing")
        return files
    return [ckpt / SAFETENSORS] if (ckpt / SAFETENSORS).is_file() else []


def check_checkpoint_files(ckpt: str | os.PathLike) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (safetensors dtype, shape)} over every weight file of `ckpt`, each header read and
    checked (no weight is read); CheckpointFileError naming the file when one is cut short or corrupt."""
    header: dict[str, tuple[str, list[int]]] = {}
    for f in weight_files(ckpt):
        header.update(read_safetensors_header(f))
    return header


def read_safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointFileError(
                f"{path}: truncated or not a safetensors file ({size} bytes, no whole header)"
            )
        try:
            raw = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointFileError(f"{path}: corrupt safetensors header (not JSON)") from None
    data_bytes = size - 8 - length
    out = {}
    for name, info in raw.items() if isinstance(raw, dict) else ():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFileError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if end > data_bytes:
            raise CheckpointFileError(
                f"{path}: truncated: tensor {name} ends at byte {end} of the data but the file holds {data_bytes}"
            )
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointFileError(
                f"{path}: corrupt: tensor {name} has {end - begin} bytes for {dtype} {shape}"
            )
        out[name] = (dtype, shape)
    if not out and not isinstance(raw, dict):
        raise CheckpointFileError(f"{path}: corrupt safetensors header (not a JSON object)")
    return out


# ---- after loading: the model -------------------------------------------------------------------


def load_checked(
    ckpt: str | os.PathLike | None,
    load: Callable[[], tuple[Any, dict | None]],
    where: str | os.PathLike | None = None,
) -> Any:
    """The model `load()` returns (with transformers' loading info, or None for a loader without one),
    checked both sides of the load: every weight file of `ckpt` whole before (`check_checkpoint_files`;
    None: no local files, e.g. a hub id), what was loaded after (`check_loaded_weights`). `where` names
    it in errors (default `ckpt`)."""
    header = check_checkpoint_files(ckpt) if ckpt is not None else {}  # cut short or corrupt: one line
    model, info = load()
    check_loaded_weights(model, info, header, ckpt if where is None else where)
    return model


def check_loaded_weights(
    model: Any, info: dict | None, header: dict[str, tuple[str, list[int]]], where: str | os.PathLike
) -> None:
    """CheckpointFileError naming the first tensor that was missing (randomly filled), unexpected, of
    another shape, stored as an integer where the model holds floats, or not finite. `info`:
    transformers' loading info (None for a loader that has none: dtype and finiteness only)."""
    if info:
        _check_load_report(model, info, where)
    _check_dtypes(model, header, where)
    check_finite(model, where)


def _check_load_report(model: Any, info: dict, where) -> None:
    def kept(keys, attr: str) -> list[str]:
        allowed = [re.compile(p) for p in getattr(model, attr, None) or ()]  # the class's own allow-list
        return sorted(k for k in keys if not any(p.search(k) for p in allowed))

    missing = kept(info.get("missing_keys", ()), "_keys_to_ignore_on_load_missing")
    if missing:
        raise CheckpointFileError(
            f"{where}: tensor {missing[0]} is missing from the weight files ({len(missing)} missing); "
            "transformers would fill it with random values: the checkpoint is incomplete"
        )
    unexpected = kept(info.get("unexpected_keys", ()), "_keys_to_ignore_on_load_unexpected")
    if unexpected:
        raise CheckpointFileError(
            f"{where}: tensor {unexpected[0]} in the weight files has no place in the model "
            f"({len(unexpected)} unexpected); the weights are not this config's model"
        )
    for key, stored, expected in sorted(info.get("mismatched_keys", ()), key=lambda m: m[0]):
        hint = _vocab_hint(model, list(stored), list(expected))
        raise CheckpointFileError(
            f"{where}: tensor {key} has shape {list(stored)} in the weight files but the model (config.json) "
            f"expects {list(expected)}{hint}"
        )
    errors = [str(e).strip().splitlines()[0] for e in info.get("error_msgs", ()) if str(e).strip()]
    if errors:
        raise CheckpointFileError(f"{where}: the weights do not load: {errors[0]}")


def _vocab_hint(model: Any, stored: list[int], expected: list[int]) -> str:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and expected and expected[0] == vocab and stored and stored[0] != vocab:
        return f" (config.json vocab_size={vocab}, the weights have {stored[0]} rows)"
    return ""


def _check_dtypes(model: Any, header: dict[str, tuple[str, list[int]]], where) -> None:
    stored_int = {n: d for n, (d, _) in header.items() if d not in FLOAT_DTYPES}
    if not stored_int:
        return
    for name, tensor in model.state_dict().items():
        for stored_name, dtype in stored_int.items():
            if tensor.is_floating_point() and (stored_name == name or name.endswith("." + stored_name)
                                               or stored_name.endswith("." + name)):  # fmt: skip
                raise CheckpointFileError(
                    f"{where}: tensor {stored_name} is stored as {dtype} but the model holds floating-point "
                    "weights there (it would be cast silently): the weight file is not this model's"
                )


def check_finite(model: Any, where: str | os.PathLike) -> None:
    """CheckpointFileError naming the first floating weight holding NaN or inf (one pass per tensor;
    tied tensors once; meta tensors skipped)."""
    import torch

    seen: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_meta or not tensor.is_floating_point() or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            # in chunks: the bool mask of a whole embedding would be another large allocation
            if not all(bool(torch.isfinite(c).all()) for c in tensor.reshape(-1).split(FINITE_CHUNK)):
                raise CheckpointFileError(
                    f"{where}: tensor {name} holds non-finite values (NaN or inf); the weights are damaged "
                    "(a diverged run or a corrupt file): use an earlier checkpoint"
                )
