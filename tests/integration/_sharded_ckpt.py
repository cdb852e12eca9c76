"""A tiny pretrained dir (Qwen3, random weights, a BPE with <mask>) and the settings that train from it,
shared by tests/integration/test_sharded_load.py and its torchrun worker."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def save_tiny_checkpoint(out: Path, vocab: int = 300) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.tokenizer import train_bpe_tokenizer

    texts = (m["content"] for r in load_gsm8k_rows()[:32] for m in r["messages"])
    tok = train_bpe_tokenizer(texts, vocab, "<mask>", "<pad>", "<eos>")
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(1)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def pretrained_settings(ckpt: Path, lora: bool, strategy: str = "fsdp2"):
    from dllmflow.settings import load_settings

    recipe = "tiny_mdlm_lora" if lora else "tiny_mdlm"
    return load_settings(
        ROOT / f"params/{recipe}.yaml",
        model={"tiny": None, "pretrained_model_name_or_path": str(ckpt)},
        tokenizer={"name_or_path": str(ckpt)},
        distributed={"strategy": strategy},
    )


def build(ckpt: Path, lora: bool, strategy: str = "fsdp2"):
    """The trainer's model build (`build_parallel_model`) from `ckpt`, seeded as the trainer seeds."""
    import torch

    from dllmflow.data.tokenizer import build_tokenizer
    from dllmflow.training.distributed import init_distributed
    from dllmflow.training.parallelize import build_parallel_model

    settings = pretrained_settings(ckpt, lora, strategy)
    tokenizer = build_tokenizer(settings, [])
    torch.manual_seed(settings.train.seed)
    return build_parallel_model(tokenizer, settings, init_distributed(settings)), settings, tokenizer
