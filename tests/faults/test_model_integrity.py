"""Damaged model files are refused where they are loaded, in one line naming the tensor or file (no
random fill, no silent cast, no empty NaN output, no traceback): `dllmflow generate` / `evaluate` / the
pyfunc (`load_for_generation`) and training from a pretrained dir (`build_model`). A good checkpoint,
with a tied head absent from its file, still loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import main as cli_main
from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.inference.generate import load_for_generation
from dllmflow.settings import load_settings

WEIGHTS = "model.safetensors"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "good"
    tok = train_bpe_tokenizer(["What is 2 + 3? The answer is 5. #### 5"] * 5, 300, "<mask>", "<pad>", "<eos>")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
                      tie_word_embeddings=True, mask_token_id=tok.mask_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    load_settings().write_json(out / "settings.json")
    assert "lm_head.weight" not in load_file(out / WEIGHTS)  # tied: the head is not stored
    return out


def _damaged(good: Path, tmp_path: Path, weights=None, config=None) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(good, ckpt)
    if weights is not None:
        sd = load_file(ckpt / WEIGHTS)
        weights(sd)
        save_file(sd, ckpt / WEIGHTS, metadata={"format": "pt"})
    if config is not None:
        data = json.loads((ckpt / "config.json").read_text())
        config(data)
        (ckpt / "config.json").write_text(json.dumps(data))
    return ckpt


def _generate(ckpt: Path, capsys) -> tuple[int, str]:
    code = cli_main(["generate", "--checkpoint", str(ckpt), "--prompt", "What is 2 + 3?",
                     "--max-new-tokens", "8", "--steps", "8"])  # fmt: skip
    captured = capsys.readouterr()
    return code, captured.err


def _set(name, value):
    return lambda sd: sd.__setitem__(name, value)


CASES = {
    "missing": (dict(weights=lambda sd: sd.pop("model.layers.0.mlp.up_proj.weight")),
                r"tensor model\.layers\.0\.mlp\.up_proj\.weight is missing"),
    "unexpected": (dict(weights=_set("model.layers.0.extra.weight", torch.zeros(4))),
                   r"tensor model\.layers\.0\.extra\.weight .*has no place in the model"),
    "wrong shape": (dict(weights=lambda sd: sd.__setitem__(EMBED, sd[EMBED][:200].clone())),
                    rf"tensor {EMBED} has shape \[200, 32\] .*expects \[\d+, 32\]"),
    "vocab_size": (dict(config=lambda c: c.__setitem__("vocab_size", c["vocab_size"] + 50)),
                   rf"tensor {EMBED} has shape .*vocab_size=\d+, the weights have \d+ rows"),
    "int64": (dict(weights=_set("model.norm.weight", torch.ones(32, dtype=torch.int64))),
              r"tensor model\.norm\.weight is stored as I64"),
    "nan": (dict(weights=lambda sd: [t.fill_(float("nan")) for t in sd.values()]),
            r"tensor \S+ holds non-finite values"),
    "inf": (dict(weights=lambda sd: sd["model.layers.0.self_attn.o_proj.weight"].__setitem__((0, 0), float("inf"))),
            r"tensor model\.layers\.0\.self_attn\.o_proj\.weight holds non-finite"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_weights_refused_naming_the_tensor(good, tmp_path, capsys, case):
    damage, message = CASES[case]
    ckpt = _damaged(good, tmp_path, **damage)
    with pytest.raises(UserError, match=message):
        load_for_generation(ckpt, device="cpu")
    code, err = _generate(ckpt, capsys)
    assert code == 2 and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("dllmflow generate: error:")]) == 1


@pytest.mark.parametrize("how", ["truncated", "header"])
def test_truncated_or_corrupt_file_is_one_line(good, tmp_path, capsys, how):
    ckpt = _damaged(good, tmp_path)
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(
        data[: len(data) // 2] if how == "truncated" else data[:8] + b"\x00garbage" * 64
    )
    with pytest.raises(UserError, match=rf"{WEIGHTS}: (truncated|corrupt)"):
        load_for_generation(ckpt, device="cpu")
    code, err = _generate(ckpt, capsys)
    assert code == 2 and "Traceback" not in err and WEIGHTS in err


def test_tokenizer_without_special_tokens_is_refused_naming_them(good, tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    ckpt = _damaged(good, tmp_path)
    for f in ckpt.glob("tokenizer*"):
        f.unlink()
    one = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0}, unk_token="a")))
    one.save_pretrained(ckpt)
    with pytest.raises(UserError, match=r"tokenizer.*no eos_token.*mask"):
        load_for_generation(ckpt, device="cpu")
    code, err = _generate(ckpt, capsys)
    assert code == 2 and "Traceback" not in err and "eos_token" in err


def test_good_checkpoint_with_a_tied_head_loads(good):
    model, tok, _ = load_for_generation(good, device="cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("case", ["missing", "nan", "int64"])
def test_training_from_a_damaged_pretrained_dir_is_refused(good, tmp_path, case):
    from dllmflow.models.build import build_model

    damage, message = CASES[case]
    ckpt = _damaged(good, tmp_path, **damage)
    settings = load_settings(model={"pretrained_model_name_or_path": str(ckpt), "tiny": None})
    tok = load_for_generation(good, device="cpu")[1]
    with pytest.raises(UserError, match=message):
        build_model(settings, tok)


@pytest.mark.parametrize("case", ["missing", "wrong shape", "nan"])
def test_serving_a_damaged_causal_lm_is_refused(good, tmp_path, case):
    """`dllmflow serve` loads through ChatEngine: the same checks, before the port opens."""
    from dllmflow.inference.engine import ChatEngine

    damage, message = CASES[case]
    ckpt = _damaged(good, tmp_path, **damage)
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((ckpt / "tokenizer_config.json").read_text()), "chat_template": "{{ 'x' }}"})
    )
    with pytest.raises(UserError, match=message):
        ChatEngine(ckpt)
