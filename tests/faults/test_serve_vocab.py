"""Token ids and lengths a dLLM server cannot honour are refused (diffusion/samplers/asked.py,
inference/serve_cli.py): an `eos_token_id` outside the vocabulary (-5, 10^6) in a request's `dllmflow`
overrides is HTTP 400 naming it, in `--sampler-setting` it stops the server at start, and a served
`max_new_tokens` that leaves the model no position for a prompt stops it at start, in one line each."""

from __future__ import annotations

import argparse
import json

import pytest

from _serving import tiny_dllm_export
from dllmflow.diffusion.samplers.asked import build_asked_config
from dllmflow.diffusion.samplers.configs import SamplerSettingError
from dllmflow.errors import UserError
from dllmflow.inference.serve_cli import add_cli_args, app_from_args


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_dllm_export(tmp_path_factory.mktemp("dllm") / "export")


def _serve(*flags: str):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return app_from_args(p.parse_args(list(flags)))


def test_an_asked_eos_outside_the_vocabulary_is_refused():
    from dllmflow.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["what is two plus two", "four"] * 20, 280, "<mask>", "<pad>", "<eos>")
    with pytest.raises(
        SamplerSettingError, match=r"^eos_token_id: -5 is outside the vocabulary the token ids"
    ):
        build_asked_config("llada", {"eos_token_id": -5})  # no tokenizer yet: >= 0 still holds
    with pytest.raises(
        SamplerSettingError, match=rf"^eos_token_id: 1000000 is outside the vocabulary \[0, {len(tok)}\)"
    ):
        build_asked_config("llada", {"eos_token_id": 10**6}, tok)
    assert build_asked_config("llada", {"eos_token_id": len(tok) - 1}, tok).eos_token_id == len(tok) - 1
    assert build_asked_config("llada", {"eos_token_id": "tokenizer"}, tok).eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("eos", [-5, 10**6])
def test_a_server_eos_setting_outside_the_vocabulary_is_refused_at_start(export, eos):
    with pytest.raises(UserError) as err:
        _serve("--model", str(export), "--sampler-setting", f"eos_token_id={eos}")
    msg = str(err.value)
    assert msg.startswith("--sampler-setting") and f"eos_token_id: {eos} is outside the vocabulary" in msg
    assert "\n" not in msg


def test_a_request_eos_outside_the_vocabulary_is_400_naming_it(export):
    from dllmflow.inference.dllm_engine import DllmEngine, served_from_path
    from dllmflow.inference.requests import RequestError

    engine = DllmEngine(served_from_path(export), max_tokens_cap=1024)
    for eos in (-5, 10**6):
        with pytest.raises(RequestError, match=f"eos_token_id: {eos} is outside the vocabulary") as err:
            engine.request([1, 2, 3], {"eos_token_id": eos}, 8, stream=False, steps_cap=1024)
        assert err.value.param == "dllmflow.eos_token_id"
    engine.request([1, 2, 3], {"eos_token_id": 5}, 8, stream=False, steps_cap=1024)  # an id it has: fine


def test_a_served_max_new_tokens_past_the_positions_is_refused_at_start(export, tmp_path):
    import shutil

    with pytest.raises(
        UserError, match=r"^max_new_tokens 2048 \(--sampler-setting\) leaves no room for a prompt"
    ):
        _serve("--model", str(export), "--max-tokens-cap", "4096", "--sampler-setting", "max_new_tokens=2048")
    short = tmp_path / "short"  # the same model with 64 positions: its recorded setting does not fit
    shutil.copytree(export, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(
        UserError,
        match=r"\(the setting recorded with .*short\) leaves no room for a prompt in the model's max_position_embeddings \(64\)",
    ):
        _serve("--model", str(short))
    _serve("--model", str(short), "--sampler-setting", "max_new_tokens=32", "--sampler-setting", "steps=8")
