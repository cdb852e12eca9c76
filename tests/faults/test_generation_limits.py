"""`dllmflow generate` / `evaluate` refuse a mask id outside the vocabulary and a prompt + max_new_tokens
beyond the model's positions with one clear error naming the flag, before any forward (no IndexError,
no 40 GB attention mask)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import main
from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.models.limits import check_generation_fits, max_positions, vocab_rows
from dllmflow.settings import load_settings

MAX_POSITIONS = 256


def _model(vocab: int) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64,
                      max_position_embeddings=MAX_POSITIONS)  # fmt: skip
    return Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    out = run / "checkpoints" / "step_000001" / "model" / "consolidated"
    tok = train_bpe_tokenizer(["What is 2 + 3? The answer is 5. #### 5"] * 5, 300, "<mask>", "<pad>", "<eos>")
    _model(len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    load_settings().write_json(out / "settings.json")
    os.symlink("step_000001", run / "checkpoints" / "LATEST")
    return run


def test_check_generation_fits():
    model = _model(100)
    assert vocab_rows(model) == 100 and max_positions(model) == MAX_POSITIONS
    check_generation_fits(model, 56, 200, 99)  # exactly fits
    with pytest.raises(UserError, match=r"--mask-id 100 .*outside the model's vocabulary \(0\.\.99\)"):
        check_generation_fits(model, 10, 10, 100)
    with pytest.raises(UserError, match="--mask-id -1"):
        check_generation_fits(model, 10, 10, -1)
    with pytest.raises(
        UserError, match=r"--max-new-tokens 201 .*\(56 tokens\).*\(256\); use --max-new-tokens 200"
    ):
        check_generation_fits(model, 56, 201, 0)


def test_generate_mask_id_out_of_range(ckpt, capsys):
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hi", "--mask_id", "999999",
                 "--max_new_tokens", "8", "--steps", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--mask-id 999999" in err and "Traceback" not in err


def test_generate_too_many_new_tokens(ckpt, capsys):
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hi", "--max_new_tokens", "100000",
                 "--steps", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--max-new-tokens 100000" in err and "max_position_embeddings (256)" in err


def test_evaluate_too_many_new_tokens(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.evaluation.accuracy import evaluate

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                 {"role": "assistant", "content": f"#### {2 * i}"}]}) + "\n"
        for i in range(12)
    ))  # fmt: skip
    settings = load_settings(
        dataset={"path_or_dataset_id": str(data), "prepared_dir": str(tmp_path / "prepared"),
                 "eval_fraction": 0.5, "seq_length": 64},
        tokenizer={"train_vocab_size": 300}, eval={"limit": 2, "steps": 2, "max_new_tokens": 4096},
    )  # fmt: skip
    prepare(settings)
    tok = load_tokenizer(tmp_path / "prepared")
    _model(len(tok)).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    settings.write_json(tmp_path / "ckpt" / "settings.json")
    with pytest.raises(UserError, match=r"--max-new-tokens 4096 \(or eval\.max_new_tokens\)"):
        evaluate(tmp_path / "ckpt")
    with pytest.raises(UserError, match="--mask-id 5000"):
        evaluate(tmp_path / "ckpt", overrides={"mask_id": 5000, "max_new_tokens": 8})
