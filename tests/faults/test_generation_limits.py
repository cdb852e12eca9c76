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


# What a caller asks of a sampler (a served request's overrides, `serve --sampler-setting`, `generate`'s
# flags, the pyfunc's params) goes through one check, `diffusion.samplers.asked`: strict, then capped.
ASKED_BAD = {
    "steps as a string": ("llada", {"steps": "1000000000"}, "steps", "valid integer"),
    "steps as a float": ("llada", {"steps": 1e9}, "steps", "valid integer"),
    "steps as a bool": ("llada", {"steps": True}, "steps", "valid integer"),
    "steps past the cap": ("llada", {"steps": 10**9}, "steps", r"cap of 1024 \(--max-tokens-cap\)"),
    "steps past the generation": ("llada", {"steps": 129}, "steps", r"generation length \(max_new_tokens = 128\)"),
    "llada2 steps past its block": ("llada2", {"steps": 33}, "steps", r"the block size = 32"),
    "block past the cap": ("llada", {"block_size": 1025}, "block_size", "--max-tokens-cap"),
    "threshold as a string": ("llada", {"threshold": "0.9"}, "threshold", "valid number"),
    "temperature inf": ("llada", {"temperature": float("inf")}, "temperature", "finite"),
    "temperature 3": ("llada", {"temperature": 3}, "temperature", r"outside \[0, 2\]"),
    "scdd shape inf": ("scdd", {"schedule_shape": float("inf")}, "schedule_shape", "finite"),
    "seed 2^70": ("llada", {"seed": 2**70}, "seed", "int64"),
    "seed as a bool": ("llada", {"seed": False}, "seed", "valid integer"),
    "max_new_tokens past the cap": ("llada", {"max_new_tokens": 100000}, "max_new_tokens", "--max-tokens-cap"),
    "causal_context as a string": ("nemotron", {"causal_context": "yes"}, "causal_context", "valid boolean"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ASKED_BAD))
def test_an_asked_sampler_value_is_parsed_strictly_and_capped(case):
    from dllmflow.diffusion.samplers.asked import AskLimits, build_asked_config
    from dllmflow.diffusion.samplers.configs import SamplerSettingError

    sampler, asked, field, why = ASKED_BAD[case]
    with pytest.raises(SamplerSettingError, match=f"^{field}: .*{why}") as info:
        build_asked_config(sampler, asked, limits=AskLimits(1024))
    assert info.value.field == field


def test_asked_values_at_their_bounds_are_taken():
    from dllmflow.diffusion.samplers.asked import AskLimits, build_asked_config

    cfg = build_asked_config(
        "llada", {"steps": 128, "temperature": 2, "seed": -(2**63)}, limits=AskLimits(128)
    )
    assert (cfg.steps, cfg.temperature, cfg.seed) == (128, 2.0, -(2**63))
    # the recorded values are the run's own, not the caller's: a recorded 64 steps for 8 tokens stays
    assert (
        build_asked_config("llada", {"threshold": 0.9}, defaults={"steps": 64, "max_new_tokens": 8}).steps
        == 64
    )


def test_generate_steps_past_the_generation_are_refused_naming_the_flag(ckpt, capsys):
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "Hi", "--max-new-tokens", "8",
                 "--steps", "1000"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--steps 1000 is above the generation length" in err, err
    assert "Traceback" not in err
