"""The settings fingerprint a checkpoint carries, so a resume never continues another run's state.

fingerprint = settings_fingerprint(settings)      # stored in trainer_state.json by the Checkpointer
check_fingerprint(state, fingerprint, ckpt_dir)   # CheckpointError naming every field that changed
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dllmflow.training.checkpoint import CheckpointError

# Sections whose values shape the training state. Within them, fields that only set the run length, the
# logging, the throughput or where the prepared data lives may change between a save and its resume.
FINGERPRINT_SECTIONS = ("model", "tokenizer", "dataset", "dllm", "dflash", "peft", "train")
FINGERPRINT_IGNORED = frozenset(
    {
        "train.max_steps",
        "train.log_every",
        "train.peak_tflops",
        "train.num_workers",
        "train.local_batch_size",  # global batch and per-sample noise fix the numbers, not the split
        "train.activation_checkpointing",
        "train.compile",
        "train.compile_backend",
        "dataset.prepared_dir",
        "dataset.remote_dir",  # where the data is fetched from; its identity is checked by content hash
        "dataset.content_hash",
        "rl.eval_every",  # the in-run held-out evaluation changes no training number
        "rl.eval_limit",
        "rl.max_reward_failures",
    }
)


def settings_fingerprint(settings) -> dict[str, Any]:
    """{"sha256": ..., "fields": {"train.lr": 0.01, ...}}: what a resume must match (stored in the
    checkpoint's trainer_state.json; the fields let a mismatch name what changed)."""
    # `rl` (a GRPO run) only when present, so a supervised run's fingerprint is what it always was.
    rl = {"rl"} if getattr(settings, "rl", None) is not None else set()
    dump = settings.model_dump(mode="json", include=set(FINGERPRINT_SECTIONS) | rl)
    # A GRPO run's parent is `rl.init_from`; where its export was downloaded to may differ on a retry.
    ignored = FINGERPRINT_IGNORED | ({"model.pretrained_model_name_or_path"} if rl else set())
    fields = {k: v for k, v in _flatten(dump).items() if k not in ignored}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "fields": fields}


def check_fingerprint(state: dict[str, Any], fingerprint: dict[str, Any], ckpt_dir: Path) -> None:
    saved = state.get("settings_fingerprint") or {}
    if saved.get("sha256") == fingerprint["sha256"]:
        return
    old, new, unset = _upgraded(saved.get("fields", {})), fingerprint["fields"], "<unset>"
    if old == new:  # recorded by an older dllmflow under a mode's old layout: the same run
        return
    diffs = [
        f"{k}: {old.get(k, unset)!r} -> {new.get(k, unset)!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k, unset) != new.get(k, unset)
    ]
    raise CheckpointError(
        f"{ckpt_dir} was written with other settings ({'; '.join(diffs) or 'fingerprint differs'}); resume "
        "with the settings it was trained with, or start over with --overwrite"
    )


def _upgraded(fields: dict[str, Any]) -> dict[str, Any]:
    """Saved fingerprint fields with their `dllm` section as its mode reads a recorded one today
    (`upgrade_recorded`: causal blocks trained as `block_causal` resume as `causal_blocks`)."""
    from dllmflow.settings import MODE_CONFIGS

    dllm = {k[len("dllm.") :]: v for k, v in fields.items() if k.startswith("dllm.")}
    config = MODE_CONFIGS.get(dllm.get("mode"))
    upgraded = config.upgrade_recorded(dllm) if config is not None else dllm
    if upgraded == dllm:
        return fields
    rest = {k: v for k, v in fields.items() if not k.startswith("dllm.")}
    return {**rest, **{f"dllm.{k}": v for k, v in upgraded.items()}}


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(obj, dict) or not obj:
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out
