"""`build_model`: the tiny random decoders used by tests and the demo, and bad model paths."""

from __future__ import annotations

import pytest
import torch

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.models.build import build_model
from dllmflow.settings import load_settings

TEXTS = ["Tom has 3 apples and buys 4 more. 3 + 4 = 7", "#### 7", "How many now?"] * 20


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS, 300, "<mask>", "<pad>", "<eos>")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_model_matches_the_tokenizer(tok, arch):
    tiny = {"architecture": arch, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
    model = build_model(load_settings(model={"tiny": tiny}), tok)
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert model.get_input_embeddings().weight.shape == (len(tok), 32)
    cfg = model.config
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.mask_token_id) == (
        tok.pad_token_id, tok.eos_token_id, tok.mask_token_id,
    )  # fmt: skip
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert 10_000 < sum(p.numel() for p in model.parameters()) < 300_000
    logits = model(input_ids=torch.tensor([[1, 5, 7]])).logits
    assert logits.shape == (1, 3, len(tok)) and torch.isfinite(logits).all()


def test_same_seed_same_initial_weights(tok):
    s = load_settings()
    torch.manual_seed(3)
    a = build_model(s, tok).state_dict()
    torch.manual_seed(3)
    b = build_model(s, tok).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # every rank builds the same replica


def test_missing_local_model_dir_names_the_field(tok, tmp_path):
    s = load_settings(model={"pretrained_model_name_or_path": str(tmp_path / "nope"), "tiny": None})
    with pytest.raises(UserError, match="model.pretrained_model_name_or_path"):
        build_model(s, tok)


def test_dir_without_a_model_names_the_field(tok, tmp_path):
    s = load_settings(model={"pretrained_model_name_or_path": str(tmp_path), "tiny": None})
    with pytest.raises(UserError, match="model.pretrained_model_name_or_path"):
        build_model(s, tok)
