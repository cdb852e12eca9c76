"""A pretrained checkpoint whose tokenizer has no mask token: the mask is added and the embedding
resized; full fine-tuning trains the new row, LoRA must train the embedding (`peft.modules_to_save`)
or is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from dllmflow.errors import UserError
from dllmflow.settings import load_settings

VOCAB = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 saved with a word-level tokenizer that has eos/pad but no mask token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("nomask") / "model"
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _build(checkpoint, peft):
    from dllmflow.data.tokenizer import build_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.models.lora import apply_lora

    settings = load_settings(
        "params/tiny_mdlm_lora.yaml",
        model={"tiny": None, "pretrained_model_name_or_path": str(checkpoint)},
        tokenizer={"name_or_path": str(checkpoint)},
        peft=peft,
    )
    tokenizer = build_tokenizer(settings, [])
    return apply_lora(build_model(settings, tokenizer), settings), tokenizer


def test_full_fine_tuning_adds_a_trainable_mask_row(checkpoint):
    model, tok = _build(checkpoint, {"enabled": False})
    assert tok.mask_token == "<mask>" and tok.mask_token_id == VOCAB  # added after the 40 words
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tok) == VOCAB + 1 and emb.requires_grad
    ids = torch.tensor([[tok.mask_token_id, 3, 4]])
    model(input_ids=ids).logits.sum().backward()
    assert emb.grad[tok.mask_token_id].abs().sum() > 0  # the new row learns


def test_lora_without_the_embedding_is_refused_naming_the_field(checkpoint):
    with pytest.raises(UserError, match=r"peft.modules_to_save: .*'<mask>'.*add 'embed_tokens'"):
        _build(checkpoint, {"r": 4, "alpha": 8})


def test_lora_with_the_embedding_trains_the_mask_row(checkpoint):
    model, tok = _build(checkpoint, {"r": 4, "alpha": 8, "modules_to_save": ["embed_tokens"]})
    trained = [n for n, p in model.named_parameters() if p.requires_grad and "embed_tokens" in n]
    assert trained, "the embedding's trained copy"
    ids = torch.tensor([[tok.mask_token_id, 3, 4]])
    model(input_ids=ids).logits.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if n in trained]
    assert any(g is not None and g[tok.mask_token_id].abs().sum() > 0 for g in grads)


def _tokenizer(checkpoint, mask_token_id):
    from dllmflow.data.tokenizer import build_tokenizer

    settings = load_settings(
        "params/tiny_mdlm.yaml",
        model={"tiny": None, "pretrained_model_name_or_path": str(checkpoint)},
        tokenizer={"name_or_path": str(checkpoint)},
        dllm={"mode": "mdlm", "mask_token_id": mask_token_id},
    )
    return build_tokenizer(settings, [])


def test_mask_id_at_the_next_free_id_adds_the_token_there(checkpoint):
    # Qwen3's I-DLM recipe names 151669 = len(tokenizer): the mask is added and takes exactly that id.
    tok = _tokenizer(checkpoint, VOCAB)
    assert tok.mask_token_id == VOCAB and len(tok) == VOCAB + 1


def test_mask_id_past_the_next_free_id_is_refused_naming_the_field(checkpoint):
    with pytest.raises(
        UserError, match=rf"dllm.mask_token_id={VOCAB + 1} is outside .* {VOCAB} \(the next free"
    ):
        _tokenizer(checkpoint, VOCAB + 1)
