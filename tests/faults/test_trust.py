"""What a checkpoint may not decide for itself, and what a served model may not be asked: a checkpoint
whose config.json names its own code (`auto_map`) is refused unless the caller passes
`--trust-remote-code` (its own settings.json saying `trust_remote_code: true` does not count); a
checkpoint without tokenizer files, or with a tokenizer that is not the model's, is refused where it
enters; the pyfunc refuses a sampler that does not fit the registered mode and a generation beyond the
model's positions or vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.cli import main
from dllmflow.data.tokenizer import check_tokenizer_fits, load_tokenizer, train_bpe_tokenizer
from dllmflow.errors import UserError
from dllmflow.inference.generate import load_for_generation
from dllmflow.settings import load_settings

TEXT = ["What is 2 + 3? The answer is 5. #### 5"] * 5

# Imported by transformers only when the checkpoint's code is trusted: its trace is the marker file.
MARKER_MODULE = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedModel
class MarkerConfig(PretrainedConfig):
    model_type = "dllmflow_marker"
class MarkerModel(PreTrainedModel):
    config_class = MarkerConfig
"""


def _tokenizer():
    return train_bpe_tokenizer(TEXT, 300, "<mask>", "<pad>", "<eos>")


def _save_model(path: Path, vocab_size: int, max_positions: int = 64) -> None:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64,
                      max_position_embeddings=max_positions)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def _checkpoint(out: Path, **settings) -> Path:
    """A consolidated checkpoint with its tokenizer and the settings.json of `settings`."""
    tok = _tokenizer()
    _save_model(out, len(tok))
    tok.save_pretrained(out)
    load_settings(**settings).write_json(out / "settings.json")
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A consolidated checkpoint with its tokenizer and (mdlm) settings.json."""
    return _checkpoint(tmp_path_factory.mktemp("good") / "consolidated")


@pytest.fixture
def remote(tmp_path) -> tuple[Path, Path]:
    """A checkpoint whose model type exists only in its own module (marker.py), whose settings.json
    asks for trust: -> (checkpoint dir, marker path the module writes when imported)."""
    ckpt, marker = tmp_path / "remote", tmp_path / "MARKER"
    ckpt.mkdir()
    _tokenizer().save_pretrained(ckpt)
    (ckpt / "marker.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    config = {
        "model_type": "dllmflow_marker",
        "architectures": ["MarkerModel"],
        "auto_map": {"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerModel"},
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    load_settings(model={"tiny": {}, "trust_remote_code": True}).write_json(ckpt / "settings.json")
    return ckpt, marker


# ---- 1) a checkpoint does not switch on its own code -------------------------------------------------


def test_generate_refuses_a_checkpoint_with_its_own_code(remote, capsys):
    ckpt, marker = remote
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--raw"]) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and "auto_map" in err and str(ckpt) in err
    assert not marker.exists()  # its module never ran


def test_evaluate_and_the_pyfunc_refuse_it_too(remote, tmp_path):
    from dllmflow.evaluation.protocol import build_eval_runner
    from dllmflow.tracking.pyfunc import DllmGenerator

    ckpt, marker = remote
    with pytest.raises(UserError, match="--trust-remote-code"):
        build_eval_runner(ckpt)  # no settings passed: the checkpoint's own do not count
    gen = tmp_path / "generation.json"
    gen.write_text(json.dumps({"sampler": "llada", "sampler_settings": {}, "mode": "mdlm"}))
    with pytest.raises(UserError, match="--trust-remote-code"):
        DllmGenerator().load_context(
            SimpleNamespace(artifacts={"checkpoint": str(ckpt), "generation": str(gen)})
        )
    assert not marker.exists()


def test_the_flag_is_the_callers_way_in(remote, tmp_path):
    """With --trust-remote-code transformers imports the module (the marker appears); the model class
    here is a stub, so the load itself fails after that: the point is who decided."""
    ckpt, marker = remote
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    code = "from dllmflow.cli import main; import sys; sys.exit(main(sys.argv[1:]))"
    args = ["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--raw", "--trust-remote-code"]
    subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, timeout=300)
    assert marker.exists()


def test_a_recorded_trust_is_not_consent_in_the_pyfunc(remote, tmp_path, monkeypatch):
    """A registered version whose generation.json says `trust_remote_code: true` loads only when the
    caller consents (a load argument, or the env var for `mlflow models serve`); without it, one line
    naming both, and the checkpoint's module never ran."""
    from dllmflow.tracking.pyfunc import DllmGenerator
    from dllmflow.tracking.pyfunc_runtime import TRUST_ENV

    ckpt, marker = remote
    gen = tmp_path / "generation.json"
    gen.write_text(
        json.dumps({"sampler": "llada", "sampler_settings": {}, "mode": "mdlm", "trust_remote_code": True})
    )
    artifacts = {"checkpoint": str(ckpt), "generation": str(gen)}
    monkeypatch.delenv(TRUST_ENV, raising=False)
    for config in (None, {}, {"trust_remote_code": False}):
        with pytest.raises(
            UserError, match=f'model_config=.*"trust_remote_code": True.*{TRUST_ENV}=1'
        ) as info:
            DllmGenerator().load_context(SimpleNamespace(artifacts=artifacts, model_config=config))
        assert "\n" not in str(info.value)
    assert not marker.exists()
    # with consent transformers imports the module (a subprocess: its modules cache under tmp_path);
    # the stub model class cannot load after that: the point is who decided
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    code = (
        "import sys, json; from types import SimpleNamespace; from dllmflow.tracking.pyfunc import DllmGenerator; "
        "DllmGenerator().load_context(SimpleNamespace(artifacts=json.loads(sys.argv[1]), "
        "model_config={'trust_remote_code': True}))"
    )
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(artifacts)], env=env, capture_output=True, timeout=300
    )
    assert marker.exists()


def test_evaluate_takes_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    assert "--trust-remote-code" in capsys.readouterr().out


# ---- 2) tokenizer files present and the model's ------------------------------------------------------


def test_missing_tokenizer_files_are_refused_not_an_empty_tokenizer(tmp_path, capsys):
    ckpt = tmp_path / "no_tokenizer"
    _save_model(ckpt, 300)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--raw"]) == 2
    err = capsys.readouterr().err
    assert str(ckpt) in err and "no tokenizer files" in err and "tokenizer.json" in err


def test_prepared_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UserError, match="no tokenizer files.*dllmflow prepare"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_larger_than_the_embedding_is_not_the_models(tmp_path):
    ckpt = tmp_path / "mismatch"
    tok = _tokenizer()
    _save_model(ckpt, len(tok))
    tok.add_tokens([f"<extra_{i}>" for i in range(50)])
    tok.save_pretrained(ckpt)
    with pytest.raises(UserError, match=rf"{len(tok)} tokens but the model's embedding only {len(tok) - 50}"):
        load_for_generation(ckpt)


def test_special_ids_must_be_rows_of_the_embedding():
    tok = _tokenizer()
    check_tokenizer_fits(tok, len(tok), "ckpt")  # fits
    with pytest.raises(UserError, match="tokens but the model's embedding only"):
        check_tokenizer_fits(tok, len(tok) - 1, "ckpt")
    tok.add_special_tokens({"pad_token": "<pad2>"})  # a new row the model does not have
    with pytest.raises(UserError, match=r"ckpt.*(tokens|pad_token_id)"):
        check_tokenizer_fits(tok, len(tok) - 1, "ckpt")


def test_dflash_pair_checks_the_tokenizer_files_first(tmp_path):
    from dllmflow.evaluation.acceptance import load_dflash_pair

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no tokenizer files"):
        load_dflash_pair(tmp_path)


# ---- 3) + 4) the pyfunc: sampler fits the mode, generation fits the model ----------------------------


@pytest.fixture(scope="module")
def generator(good, tmp_path_factory):
    from dllmflow.tracking.pyfunc import DllmGenerator

    gen = tmp_path_factory.mktemp("gen") / "generation.json"
    gen.write_text(json.dumps({"sampler": "llada", "sampler_settings": {"steps": 2, "max_new_tokens": 4,
                                                                        "block_size": 4}, "mode": "mdlm"}))  # fmt: skip
    model = DllmGenerator()
    model.load_context(SimpleNamespace(artifacts={"checkpoint": str(good), "generation": str(gen)}))
    return model


def test_pyfunc_refuses_a_sampler_that_does_not_fit_the_mode(generator):
    with pytest.raises(UserError, match=r"dllm.mode=mdlm; sampler 'gemma'.*Samplers that fit: llada, llada2"):
        generator.predict(None, ["hi"], params={"sampler": "gemma"})
    with pytest.raises(UserError, match="'acceptance' decodes a DFlash draft"):
        generator.predict(None, ["hi"], params={"sampler": "acceptance"})
    assert len(generator.predict(None, ["hi"], params={"sampler": "llada2"})) == 1  # fits mdlm


def test_generate_texts_refuses_by_the_checkpoints_mode(generator):
    from dllmflow.tracking.pyfunc_runtime import generate_texts

    with pytest.raises(UserError, match="sampler 'idlm' does not fit"):
        generate_texts(
            generator.model, generator.tokenizer, ["hi"], sampler="idlm", trained=generator.trained
        )


def test_pyfunc_generation_must_fit_positions_and_vocabulary(generator):
    with pytest.raises(UserError, match="max_position_embeddings \\(64\\)"):
        generator.predict(None, ["hi"], params={"max_new_tokens": 1000, "block_size": 8})
    model = generator.model
    good_mask = model.config.mask_token_id
    model.config.mask_token_id = 10_000
    try:
        with pytest.raises(UserError, match="outside the model's vocabulary"):
            generator.predict(None, ["hi"])
    finally:
        model.config.mask_token_id = good_mask


# ---- 5) evaluate decodes with a sampler of the checkpoint's mode ---------------------------------------


@pytest.fixture(scope="module")
def idlm_ckpt(tmp_path_factory) -> Path:
    """A consolidated checkpoint whose settings.json records dllm.mode=idlm (what an idlm run exports)."""
    return _checkpoint(
        tmp_path_factory.mktemp("idlm") / "consolidated", dllm={"mode": "idlm", "mask_token_id": 2}
    )


def test_evaluate_defaults_to_a_sampler_of_the_checkpoints_mode(idlm_ckpt, tmp_path):
    """`evaluate --checkpoint <an idlm run> --params <its recipe>` decoded with llada (EM 0.000 in 4 min;
    idlm: 0.562 in 13 s): the default comes from the checkpoint's mode and the recipe's eval.samplers."""
    from dllmflow.evaluation.protocol import default_eval_sampler

    recipe = load_settings(dllm={"mode": "idlm", "mask_token_id": 2}, eval={"samplers": ["idlm"]})
    assert default_eval_sampler(idlm_ckpt, recipe) == "idlm"
    assert default_eval_sampler(idlm_ckpt) == "idlm"  # no recipe: the checkpoint's mode
    mdlm_recipe = load_settings(eval={"samplers": ["llada2", "llada"]})  # another mode's recipe
    with pytest.raises(
        UserError, match=r"eval.samplers \['llada2', 'llada'\]: none decodes .*idlm.*fit: idlm"
    ):
        default_eval_sampler(idlm_ckpt, mdlm_recipe)


def test_evaluate_refuses_a_sampler_that_does_not_fit_before_loading(idlm_ckpt, capsys):
    code = main(["evaluate", "--checkpoint", str(idlm_ckpt), "--sampler", "llada", "--limit", "1"])
    err = capsys.readouterr().err
    assert (
        code == 2 and "dllm.mode=idlm; sampler 'llada' does not fit it" in err and "Traceback" not in err
    ), err
