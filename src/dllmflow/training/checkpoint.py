"""What a checkpoint step dir holds on disk, and reading it without running anything it contains.

Layout under `RUN/checkpoints/` (names and the LATEST pointer owned by `dllmflow.runs`; written and
published only by `training/checkpointer.py`):

    step_000020/model/                  torch.distributed.checkpoint (DCP): sharded under FSDP2, whole under DDP
    step_000020/optim/                  DCP optimizer state
    step_000020/rng/rank_00000.safetensors  per-rank RNG: torch/cuda states as uint8 tensors, python and
                                        numpy states as JSON in the safetensors metadata
    step_000020/trainer_state.json      step (= data position: the sampler is stateless), scheduler, world
                                        size, extra state (settings fingerprint, samples seen)
    step_000020/manifest.json           sha256 + size of every other file of the step dir (written last)
    step_000040/model/consolidated/     HF dir (config, safetensors, tokenizer, settings.json)
    LATEST -> step_000040               relative symlink (LATEST.txt holding the name where symlinks fail)

Nothing read from a checkpoint can run code: `verify_checkpoint` checks the manifest first (a flipped
byte is named); DCP `.metadata` goes through an allow-listed unpickler (torch's reader uses plain
pickle: `SafeFileSystemReader`), DCP byte items through `torch.load(weights_only=True)`
(`SafeLoadPlanner`); the rest is JSON or safetensors.

    verify_checkpoint(step_dir)                 # CheckpointError naming the first bad file
    write_manifest(step_dir)                    # hash + fsync every file, then every dir

Storage I/O stays in a few small functions (`hash_file`, `write_manifest`, `read_json`, `publish_dir`,
`save_rng`, `load_rng`, `read_dcp_metadata`, the DCP reader) so another backend can replace them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dllmflow.common.files import atomic_write_json, fsync_dir
from dllmflow.errors import UserError
from dllmflow.runs import MANIFEST

OPTIM = "optim"
TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe to read or from other settings (the
    message names the file or the fields)."""


class CheckpointWarning(UserWarning):
    """A resume that does not take LATEST as is: a fallback to an older complete checkpoint."""


def file_owner(rel: str, world_size: int) -> int | None:
    """The rank that wrote a step dir file (its DCP shards `__<rank>_<i>.distcp`, its
    `rng/rank_<rank>.safetensors`); None for the shared files rank 0 writes."""
    leaf = rel.rsplit("/", 1)[-1]
    m = re.match(r"^__(\d+)_\d+\.distcp$", leaf) or re.match(r"^rank_(\d+)\.safetensors$", leaf)
    return int(m.group(1)) if m and int(m.group(1)) < world_size else None


# ---- manifest: sha256 of every file, fsync, publish a dir ---------------------------------------------------


def verify_checkpoint(step_dir: Path, listed: dict[str, Any] | None = None) -> None:
    """Every file the manifest lists is there with its size and sha256, else CheckpointError naming it.
    `listed`: check against this manifest (rank 0's) instead of the dir's own."""
    manifest = step_dir / MANIFEST
    if listed is None and not manifest.is_file():
        raise CheckpointError(f"{step_dir}: no {MANIFEST}, so not a complete checkpoint")
    source = manifest if listed is None else f"rank 0's {MANIFEST}"
    files = (listed if listed is not None else read_json(manifest)).get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{source}: lists no files")
    for rel in sorted(files):  # every file there before any is hashed: a node's partial copy fails fast
        path = step_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not path.is_file():
            raise CheckpointError(f"{path}: listed in {source} but missing")
    for rel, want in sorted(files.items()):
        path = step_dir / rel
        digest, size = hash_file(path)
        if (digest, size) != (want.get("sha256"), want.get("bytes")):
            raise CheckpointError(
                f"{path}: checksum mismatch with {source} (sha256 {digest[:12]}..., {size} bytes; "
                f"recorded {str(want.get('sha256'))[:12]}..., {want.get('bytes')} bytes): the file is corrupt"
            )


def write_manifest(step_dir: Path, manifest: dict[str, Any] | None = None) -> None:
    """Write manifest.json (by default: hash and fsync every file under `step_dir`), fsync every dir."""
    if manifest is None:
        manifest = {"format": 1, "files": hash_files(step_dir, list_files(step_dir))}
    atomic_write_json(step_dir / MANIFEST, manifest)
    for d in sorted((p for p in step_dir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_dir(d)
    fsync_dir(step_dir)


def list_files(step_dir: Path) -> list[str]:
    """Every file of a step dir but the manifest, relative, sorted."""
    return sorted(
        p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def hash_files(step_dir: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    """{rel: {"sha256", "bytes"}} of files under `step_dir`, each fsynced while it is read."""
    out = {}
    for rel in rels:
        digest, size = hash_file(step_dir / rel, fsync=True)
        out[rel] = {"sha256": digest, "bytes": size}
    return out


def hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def publish_dir(tmp: Path, final: Path) -> None:
    if final.exists():  # left by a run that died between rename and LATEST, or a corrupt one: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


# ---- DCP without unpickling arbitrary classes ----------------------------------------------------------

# What a real DCP .metadata holds (logged from find_class on model and optimizer checkpoints).
_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP metadata is made of; anything else (os.system, builtins.eval, ...)
    is an UnpicklingError before it can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == _METADATA_MODULE and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and "." not in name:
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    path = Path(dcp_dir) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so not a complete checkpoint") from None
    except Exception as e:  # any malformed pickle: name the file, never run or trace it further
        raise CheckpointError(
            f"{path}: refused, not plain DCP metadata ({type(e).__name__}: {e}); it may have been "
            "tampered with: restore it from a trusted copy"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: refused, holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` with the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items (optimizer param groups) with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- RNG: safetensors + JSON ---------------------------------------------------------------------------


def rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / "rng" / f"rank_{rank:05d}.safetensors"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(path: Path, state: dict[str, Any]) -> None:
    """torch/cuda states as uint8 tensors, python/numpy states as JSON in the safetensors metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"torch": state["torch"], **{f"cuda.{i}": t for i, t in enumerate(state.get("cuda", []))}}
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    meta = {
        "python": json.dumps([version, list(internal), gauss]),
        "numpy": json.dumps([name, keys.tolist(), int(pos), int(has_gauss), float(cached)]),
    }
    save_file(tensors, str(path), metadata=meta)


def load_rng(step_dir: Path, rank: int) -> dict[str, Any] | None:
    path = rng_file(step_dir, rank)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        version, internal, gauss = json.loads(meta["python"])
        name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
        state = {
            "torch": tensors["torch"],
            "python": (version, tuple(internal), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        }
        cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
        if cuda:
            state["cuda"] = cuda
        return state
    except Exception as e:  # any malformed file: name it (safetensors runs no code)
        raise CheckpointError(f"{path}: unreadable RNG state ({type(e).__name__}: {e})") from None
