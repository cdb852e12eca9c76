"""Every GPU recipe in params/ trains on CPU with its real architecture at tiny width, in-process.

For each recipe: its model's shipped config (src/dllmflow/models/configs: the config class the recipe
builds) shrunk to hidden 64, 2 layers, 4 heads, vocab of a 512-token BPE, saved with random weights as
a local pretrained dir; the recipe then runs unchanged except for that model path, the tokenizer, the
sizes that follow from the width (mask / vocab ids of the tiny tokenizer, canvas and padding blocks,
sequence length) and a two-step schedule: mode, LoRA targets and parts, freezes, dllm knobs, attention,
dtypes stay the recipe's. So a recipe that cannot build or step fails here before a GPU is rented.

What CPU cannot run is replaced and said so: DFlash's flex_attention (no backward on CPU) by sdpa.
LLaDA and Nemotron-Labs-Diffusion are remote code on the hub (not available offline): their shipped
configs build a same-shape Llama / Mistral decoder, the stand-in the planner also counts
(docs/memory_planner.md); their real classes are not exercised here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dllmflow.settings import deep_merge, load_settings

ROOT = Path(__file__).resolve().parents[2]
SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
SEQ = 128


@pytest.fixture(scope="module")
def tokenizer():
    """A 512-token byte-level BPE with <mask>/<pad>/<eos> (the tiny recipes' kind) on 64 GSM8K rows."""
    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.tokenizer import default_chat_template, train_bpe_tokenizer

    rows = load_gsm8k_rows()[:64]
    texts = (m["content"] for r in rows for m in r["messages"])
    tok = train_bpe_tokenizer(texts, 512, "<mask>", "<pad>", "<eos>")
    tok.chat_template = default_chat_template()
    return tok


def _shrunk_config(name: str, tokenizer, trust_remote_code: bool):
    """The config class the recipe's model ships with, at tiny width, vocab = the tiny tokenizer."""
    from transformers import AutoConfig, Gemma4VisionConfig

    from dllmflow.models.shipped_configs import resolve_config, shipped_fallback

    with shipped_fallback():
        real = resolve_config(name, trust_remote_code=trust_remote_code)
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    if real.model_type == "diffusion_gemma":
        text = {
            k: v
            for k, v in real.text_config.to_dict().items()
            if k not in ("per_layer_config", "layer_types", "sliding_window")
        }
        text.update(SHRINK, **ids, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        text.update(global_head_dim=32, num_global_key_value_heads=1, sliding_window=32)
        tiny_vision = Gemma4VisionConfig(
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=8,
            position_embedding_size=16,
            patch_size=2,
        )
        top = {k: v for k, v in real.to_dict().items() if k not in ("text_config", "vision_config")}
        return type(real)(**{**top, "text_config": text, "vision_config": tiny_vision.to_dict()})
    per_layer = ("layer_types", "max_window_layers")  # sized by the real depth
    own = {k: v for k, v in real.to_dict().items() if k not in per_layer}
    return AutoConfig.for_model(**{**own, **SHRINK, **ids})


def _save_tiny_model(name: str, out: Path, tokenizer, trust_remote_code: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, DiffusionGemmaForBlockDiffusion

    config = _shrunk_config(name, tokenizer, trust_remote_code)
    torch.manual_seed(0)
    if config.model_type == "diffusion_gemma":
        model = DiffusionGemmaForBlockDiffusion(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _save_tiny_dflash_draft(name: str, out: Path, target: Path) -> Path:
    """The published draft format (model_type qwen3, `dflash_config`, `block_size`) at tiny width, with
    our class's weights: loads the way a z-lab checkpoint does (trust_remote_code false)."""
    import json

    from dllmflow.models.dflash_draft import DFlashDraftModel, draft_config_from_dict
    from dllmflow.models.shipped_configs import config_dict, shipped_fallback

    with shipped_fallback():
        raw = config_dict(name)
    target_cfg = json.loads((target / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("layer_types", "max_window_layers")}
    raw.update(SHRINK, vocab_size=target_cfg["vocab_size"], num_hidden_layers=1, num_target_layers=2)
    raw["dflash_config"] = {"mask_token_id": None, "target_layer_ids": [1]}
    DFlashDraftModel(draft_config_from_dict(raw)).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(raw))  # the published layout, not ours
    return out


def _tiny_settings(recipe: str, tmp: Path, tokenizer, **extra):
    """The recipe, pointed at a tiny local model of its architecture; two steps on 8 GSM8K rows."""
    from dllmflow.data.prepare import prepare

    base = load_settings(ROOT / f"params/{recipe}.yaml")
    name = base.model.pretrained_model_name_or_path
    model_dir = tmp / "model"
    if base.dllm.mode == "dflash":
        target = _save_tiny_model(base.dflash.target_model_id, tmp / "target", tokenizer)
        _save_tiny_dflash_draft(name, model_dir, target)
        extra = deep_merge(
            {
                "tokenizer": {"name_or_path": str(target)},
                "dflash": {
                    "target_model_id": str(target),
                    "target_torch_dtype": "float32",  # CPU bf16 matmuls are slow here, and no numerics differ
                    "attention_backend": "sdpa",  # flex_attention has no backward on CPU
                    "num_blocks_per_sample": 2,
                },
            },
            extra,
        )
    else:
        _save_tiny_model(name, model_dir, tokenizer, base.model.trust_remote_code)
        extra = deep_merge({"tokenizer": {"name_or_path": str(model_dir)}}, extra)
    overrides = {
        "name": f"tiny_{recipe}",
        "model": {"pretrained_model_name_or_path": str(model_dir)},
        "dataset": {
            "path_or_dataset_id": "embedded:gsm8k",
            "split": "train",
            "limit": 8,
            "seq_length": SEQ,
            "drop_truncated": False,
            "prepared_dir": str(tmp / "prepared"),
        },
        "train": {"max_steps": 2, "global_batch_size": 2, "local_batch_size": 2, "warmup_steps": 0},
        "checkpoint": {"every_steps": 2, "save_consolidated": "false"},
        "launch": {"nproc_per_node": 1},
    }
    settings = load_settings(ROOT / f"params/{recipe}.yaml", **deep_merge(overrides, extra))
    prepare(settings)
    return settings


def _mask(tokenizer) -> dict:
    return {"mask_token_id": tokenizer.mask_token_id}


RECIPES = {
    "llada_lora": lambda tok: {"dllm": _mask(tok)},
    "llada_scdd": lambda tok: {"dllm": {**_mask(tok), "vocab_size": len(tok), "chunk_size": 32}},
    "nemotron_labs_diffusion": lambda tok: {
        "dllm": {**_mask(tok), "pad_block_size": 16, "pad_seq_len_divisible": 32},
        "model": {"block_size": 16},
    },
    "diffusion_gemma_sft": lambda tok: {
        "dllm": {"vocab_size": len(tok), "block_size": 16, "pad_block_size": 16, "pad_seq_len_divisible": 16},
        "model": {"canvas_length": 16},
    },
    "diffusion_gemma_lora": lambda tok: RECIPES["diffusion_gemma_sft"](tok),
    "qwen3_8b_idlm": lambda tok: {"dllm": _mask(tok)},
    "dflash_sft": lambda tok: {},
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_gpu_recipe_trains_at_tiny_width(recipe, tokenizer, tmp_path):
    from dllmflow.training.trainer import run_training

    settings = _tiny_settings(recipe, tmp_path, tokenizer, **RECIPES[recipe](tokenizer))
    recipe_settings = load_settings(ROOT / f"params/{recipe}.yaml")
    # what makes the recipe this recipe is untouched
    assert settings.dllm.mode == recipe_settings.dllm.mode
    assert settings.peft == recipe_settings.peft
    assert settings.train.dtype == recipe_settings.train.dtype
    result = run_training(settings, tmp_path / "run")
    assert result.final_step == 2
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses), result.losses
