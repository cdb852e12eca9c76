"""`dllmflow generate`: checkpoint path resolution (docs/strategies.md §1.6 order + our run layout), loading, and bad
input (unknown sampler, infill with a sampler that cannot, missing checkpoint, wrong mode, no mask id)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import main
from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.inference.generate import (
    check_sampler_fits,
    encode_prompt,
    load_for_generation,
    resolve_checkpoint,
)
from dllmflow.settings import load_settings


def _hf_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A consolidated checkpoint in our run layout: run/checkpoints/LATEST -> step_000004."""
    run = tmp_path_factory.mktemp("run")
    out = run / "checkpoints" / "step_000004" / "model" / "consolidated"
    tok = train_bpe_tokenizer(["What is 2 + 3? The answer is 5. #### 5"] * 5, 300, "<mask>", "<pad>", "<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    load_settings().write_json(out / "settings.json")
    os.symlink("step_000004", run / "checkpoints" / "LATEST")
    return run


# ---- resolution order ---------------------------------------------------------------------------


def test_resolution_order(tmp_path):
    root = tmp_path / "ckpts"
    step = root / "epoch_0_step_9"
    _hf_dir(step / "model")
    os.symlink("epoch_0_step_9", root / "LATEST")
    assert resolve_checkpoint(root) == root / "LATEST" / "model"  # 4. LATEST/model
    _hf_dir(step / "model" / "consolidated")
    assert resolve_checkpoint(root) == root / "LATEST" / "model" / "consolidated"  # 3. wins over 4
    assert resolve_checkpoint(step) == step / "model" / "consolidated"  # 5. a step dir
    assert resolve_checkpoint(step / "model") == step / "model" / "consolidated"  # 1. path/consolidated
    _hf_dir(root)
    assert resolve_checkpoint(root) == root  # 2. path itself beats LATEST
    _hf_dir(root / "consolidated")
    assert resolve_checkpoint(root) == root / "consolidated"  # 1. first of all


def test_resolution_latest_txt_and_run_dir(tmp_path):
    root = tmp_path / "ckpts"
    _hf_dir(root / "step_000002" / "model")
    (root / "LATEST.txt").write_text("step_000002\n")
    assert resolve_checkpoint(root) == root / "step_000002" / "model"
    run = tmp_path / "run"
    _hf_dir(run / "checkpoints" / "step_000010" / "model" / "consolidated")
    os.symlink("step_000010", run / "checkpoints" / "LATEST")
    assert resolve_checkpoint(run) == run / "checkpoints" / "LATEST" / "model" / "consolidated"


def test_resolution_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        resolve_checkpoint(tmp_path / "empty")


# ---- CLI bad input ------------------------------------------------------------------------------


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert main(["generate", "--checkpoint", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err


def test_unknown_sampler_lists_choices(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--sampler", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "llada" in err and "nemotron" in err


@pytest.mark.parametrize("sampler", ["scdd", "llada2", "nemotron", "gemma"])
def test_infill_refused_before_loading(tmp_path, capsys, sampler):
    # the checkpoint does not even exist: the infill check must come first (no model load)
    code = main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "a [MASK]", "--infill",
                 "--sampler", sampler])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "cannot infill" in err and "llada" in err and "does not exist" not in err


@pytest.mark.parametrize("flag,value", [("--threshold", "1.5"), ("--steps", "0"), ("--temperature", "-1")])
def test_bad_sampler_value_names_the_flag(tmp_path, capsys, flag, value):
    assert main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "does not exist" not in err


def test_wrong_mode_warns_with_fitting_samplers():
    s = load_settings(dllm={"mode": "idlm", "mask_token_id": 2})
    with pytest.warns(UserWarning, match="Samplers that fit: idlm"):
        assert "idlm" in check_sampler_fits("llada", s)
    assert check_sampler_fits("llada", load_settings()) is None  # mdlm fits llada
    assert check_sampler_fits("llada", None) is None


# ---- loading and generating for real --------------------------------------------------------------


def test_load_for_generation(ckpt):
    model, tok, settings = load_for_generation(ckpt)
    assert settings.dllm.mode == "mdlm" and model.config.mask_token_id == tok.mask_token_id
    assert not model.training
    model, _, _ = load_for_generation(ckpt, mask_id=7)
    assert model.config.mask_token_id == 7


def test_prompt_encoding(ckpt):
    _, tok, _ = load_for_generation(ckpt)
    chat = encode_prompt(tok, "What is 2 + 3?")
    assert chat[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert encode_prompt(tok, "What is 2 + 3?", raw=True) == tok.encode("What is 2 + 3?")
    filled = encode_prompt(tok, "2 + 3 = [MASK].", infill=True)
    assert filled.count(tok.mask_token_id) == 20 and filled[-1] != tok.convert_tokens_to_ids("<|assistant|>")


def test_generate_cli_end_to_end(ckpt, capsys):
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "What is 2 + 3?", "--prompt", "Hi",
                 "--max_new_tokens", "8", "--steps", "4", "--threshold", "0.9"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.count(">>> ") == 2 and "[llada]" in out.err and "forwards" in out.err
    code = main(
        ["generate", "--checkpoint", str(ckpt), "--prompt", "2 + 3 = [MASK].", "--infill", "--steps", "4"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "2 + 3 =" in out.out


# ---- --cache ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["nemotron", "llada2", "gemma"])
def test_a_cache_the_sampler_cannot_use_exits_2_naming_sampler_and_field(tmp_path, capsys, sampler):
    code = main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "hi", "--sampler", sampler,
                 "--cache", "dual"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"sampler {sampler}" in err and "cache" in err and "does not exist" not in err  # before any load
    # cache none asks for no cache: every sampler honours it (the next error is the missing checkpoint)
    assert main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "hi", "--sampler", sampler,
                 "--cache", "none"]) == 2  # fmt: skip
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("sampler", "takes"), [("llada2", True), ("llada", False)])
def test_cache_exact_is_a_choice_of_the_flag_checked_per_sampler(tmp_path, capsys, sampler, takes):
    assert main(["generate", "--checkpoint", str(tmp_path / "x"), "--prompt", "hi", "--sampler", sampler,
                 "--cache", "exact"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    # llada2 takes it (the next error is the missing checkpoint); llada's cache is approximate only
    assert ("does not exist" in err) is takes and ("sampler llada takes cache" in err) is not takes, err


def test_cache_flag_reaches_a_sampler_that_takes_it(ckpt, capsys, monkeypatch):
    from _cache_config import with_llada_cache

    from dllmflow.diffusion.samplers.base import build_sampler_config

    with_llada_cache(monkeypatch)
    assert build_sampler_config("llada", {"cache": "dual"}).cache == "dual"
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "What is 2 + 3?", "--max-new-tokens", "4",
                 "--steps", "2", "--cache", "dual"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: an invalid choice, exit 2
        main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--cache", "full"])
    assert e.value.code == 2 and "--cache" in capsys.readouterr().err
