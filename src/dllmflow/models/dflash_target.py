"""The DFlash frozen target (docs/strategies.md §2.5): where it lives, the tiny test target, settings resolved on it.

Block size, target layer ids and the mask id are resolved against the draft, the target and the
tokenizer, in that order of precedence after the settings.

    draft = build_dflash_draft(settings, tokenizer)     # the trainable draft (the dflash mode's builder)
    path = resolve_target_path("tiny:<dir>" | hub id | local dir, tokenizer)    # tiny: built once, seeded
    mask_id = resolve_mask_token_id(configured, tokenizer, path)
    bs = resolve_block_size(configured, draft); ids = resolve_target_layer_ids(configured, draft, n_layers)

`tiny:<dir>` builds (once, seeded) a tiny random Qwen3 target from the run tokenizer in <dir>
(`build_tiny_target`); anything else is a hub id or a local dir loaded with `AutoModelForCausalLM`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from dllmflow.common.outputs import check_output_dir
from dllmflow.errors import UserError
from dllmflow.models.dflash_draft import (
    DFlashDraftModel,
    build_draft_config,
    build_target_layer_ids,
    load_draft,
)
from dllmflow.models.mask_id import find_mask_id
from dllmflow.models.meta import off_meta
from dllmflow.models.shipped_configs import planned_from_shipped, resolve_config

TINY_TARGET_PREFIX = "tiny:"
MASK_TOKEN = "<|MASK|>"


def resolve_block_size(configured: int, draft: nn.Module) -> int:
    """`dflash.block_size`, or (when 0) the draft's `block_size` / config; must end up >= 2."""
    bs = configured
    if bs <= 0:
        cfg = getattr(draft, "config", None)
        extra = getattr(cfg, "dflash_config", None) or {}
        bs = getattr(draft, "block_size", None) or getattr(cfg, "block_size", None) or extra.get("block_size")
    if bs is None:
        raise UserError(
            "dflash.block_size is 0 and the draft config has no block_size; set dflash.block_size >= 2"
        )
    if int(bs) < 2:
        raise UserError(f"dflash block size {bs} < 2: a block needs its anchor plus >= 1 predicted token")
    return int(bs)


def resolve_target_layer_ids(
    configured: list[int] | None, draft: nn.Module, num_target_layers: int
) -> list[int]:
    """`dflash.target_layer_ids` > the draft's own ids > evenly spaced (spec helper)."""
    cfg = getattr(draft, "config", None)
    extra = getattr(cfg, "dflash_config", None) or {}
    ids = configured or getattr(cfg, "target_layer_ids", None) or extra.get("target_layer_ids")
    if not ids:
        ids = build_target_layer_ids(num_target_layers, getattr(cfg, "num_hidden_layers", 1))
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise UserError(
            f"dflash.target_layer_ids {list(ids)}: {bad} outside the target's {num_target_layers} layers"
        )
    return [int(i) for i in ids]


def build_tiny_target(
    out_dir: str | Path, tokenizer, hidden_size: int = 64, num_layers: int = 4, seed: int = 0
) -> Path:
    """Write a tiny random Qwen3 causal LM (vocab = len(tokenizer)) + the tokenizer to `out_dir`,
    once: an existing dir is reused. Seeded and written via a temp dir + rename, so every rank and
    every later run (training, evaluation) sees the same target."""
    from dllmflow.models.build import build_tiny_model
    from dllmflow.settings.sections import TinyModelConfig

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    check_output_dir(out, marker="config.json", kind="tiny DFlash target")  # a file / a dir not ours: refused
    tiny = TinyModelConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        tie_word_embeddings=True,
    )
    # A real CPU model even when the caller builds its own model on the meta device.
    with torch.random.fork_rng(devices=[]), off_meta():
        torch.manual_seed(seed)
        model = build_tiny_model(tiny, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-target-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another rank won the race: its target is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_target_path(target_model_id: str, tokenizer) -> str:
    if target_model_id.startswith(TINY_TARGET_PREFIX):
        return str(build_tiny_target(target_model_id[len(TINY_TARGET_PREFIX) :], tokenizer))
    looks_local = target_model_id.startswith((".", "/", "~")) or Path(target_model_id).exists()
    if (
        looks_local
        and not Path(target_model_id).expanduser().is_dir()
        and not planned_from_shipped(target_model_id)
    ):
        raise UserError(f"dflash.target_model_id={target_model_id!r}: no such directory")
    return target_model_id


def resolve_mask_token_id(configured: int | None, tokenizer, target_path: str | None = None) -> int:
    """settings > the run tokenizer's mask > the target tokenizer's mask > add `<|MASK|>` to the run
    tokenizer (Qwen3: id 151669, a row the target embedding already has)."""
    found = find_mask_id(configured, tokenizer=tokenizer)
    if found is not None:
        return found
    if target_path is not None:
        try:
            from transformers import AutoTokenizer

            target_tok = AutoTokenizer.from_pretrained(target_path)
            if target_tok.mask_token_id is not None:
                return int(target_tok.mask_token_id)
        except (OSError, ValueError):  # no tokenizer saved with the target: fall through to adding one
            pass
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return int(tokenizer.mask_token_id)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_dflash_draft(settings, tokenizer) -> nn.Module:
    """The trainable DFlash draft (the mode's model builder): a draft checkpoint
    (`model.pretrained_model_name_or_path`) or a fresh draft of ours shaped like the target with
    `dflash.num_draft_layers` layers, its mask id resolved as the strategy resolves it."""
    dcfg, mcfg = settings.dflash, settings.model
    path = resolve_target_path(dcfg.target_model_id, tokenizer)
    mask_id = resolve_mask_token_id(settings.dllm.mask_token_id, tokenizer, path)
    if mcfg.pretrained_model_name_or_path:
        return load_draft(
            mcfg.pretrained_model_name_or_path, mcfg.trust_remote_code, _DTYPES[mcfg.torch_dtype]
        )
    if dcfg.block_size <= 0:
        raise UserError(
            "dflash.block_size is 0 (read from the draft config) but there is no draft checkpoint "
            "(model.pretrained_model_name_or_path); set dflash.block_size >= 2"
        )
    tcfg = resolve_config(path, trust_remote_code=mcfg.trust_remote_code)
    vocab = (tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg).vocab_size
    cfg = build_draft_config(
        tcfg,
        num_draft_layers=dcfg.num_draft_layers,
        block_size=dcfg.block_size,
        target_layer_ids=dcfg.target_layer_ids,
        mask_token_id=mask_id,
        target_model_id=dcfg.target_model_id,
        own_mask_embedding=mask_id >= vocab,
    )
    return DFlashDraftModel(cfg).to(_DTYPES[mcfg.torch_dtype])


__all__ = [
    "MASK_TOKEN",
    "TINY_TARGET_PREFIX",
    "build_dflash_draft",
    "build_tiny_target",
    "resolve_block_size",
    "resolve_mask_token_id",
    "resolve_target_layer_ids",
    "resolve_target_path",
]
