"""Shared fixture body of the evaluation tests: 24 `i + i` chats prepared (half held out) and a tiny
random Qwen3 saved as an export with its tokenizer and settings.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.data.tokenizer import load_tokenizer
from dllmflow.settings import Settings, load_settings


def tiny_eval_export(root: Path) -> tuple[Path, Settings]:
    from dllmflow.data.prepare import prepare

    data = root / "chat.jsonl"
    with data.open("w") as f:
        for i in range(24):
            chat = [{"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": f"{i} + {i} = {2 * i}.\n#### {2 * i:,}"}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")
    settings = load_settings(
        dataset={"path_or_dataset_id": str(data), "prepared_dir": str(root / "prepared"), "eval_fraction": 0.5,
                 "seq_length": 64},
        tokenizer={"train_vocab_size": 300},
        eval={"limit": 3, "max_new_tokens": 8, "steps": 4, "batch_size": 2},
    )  # fmt: skip
    prepare(settings)
    tok = load_tokenizer(root / "prepared")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    ckpt = root / "ckpt"
    Qwen3ForCausalLM(cfg).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    settings.write_json(ckpt / "settings.json")
    return ckpt, settings
