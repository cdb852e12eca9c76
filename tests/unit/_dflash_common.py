"""Shared tiny fixtures of the DFlash tests: a word-level tokenizer, settings, a tiny target and draft."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.settings import load_settings

NUM_WORDS = 60


def make_tokenizer(with_mask: bool = True) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(NUM_WORDS)}
    vocab.update({"<pad>": NUM_WORDS, "<eos>": NUM_WORDS + 1})
    specials = {"pad_token": "<pad>", "eos_token": "<eos>"}
    if with_mask:
        vocab["<mask>"] = NUM_WORDS + 2
        specials["mask_token"] = "<mask>"
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, **specials)


def make_settings(target_dir: Path, dllm: dict | None = None, **dflash):
    section = {"target_model_id": f"tiny:{target_dir}", "target_torch_dtype": "float32", "block_size": 4}
    section.update(dflash)
    return load_settings(dllm={"mode": "dflash", **(dllm or {})}, dflash=section, dataset={"seq_length": 32})


def make_strategy(target_dir: Path, tokenizer=None, seed: int = 0, **dflash):
    """A set-up strategy and its fresh draft (target built once per dir, then reused)."""
    tokenizer = tokenizer or make_tokenizer()
    strategy = build_strategy(make_settings(target_dir, **dflash))
    torch.manual_seed(seed)
    draft = build_mode_model(strategy.settings, tokenizer)
    strategy.setup(draft, tokenizer, torch.device("cpu"))
    return strategy, draft


def make_batch(bsz: int = 2, seq_len: int = 24, seed: int = 0, prompt: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, NUM_WORDS, (bsz, seq_len), generator=g)
    attn = torch.ones(bsz, seq_len, dtype=torch.long)
    attn[-1, seq_len - 4 :] = 0  # a right-padded row
    loss_mask = torch.zeros(bsz, seq_len)
    loss_mask[:, prompt:] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
