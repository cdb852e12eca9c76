"""`dllmflow.tracking.pyfunc.DllmGenerator`, the MLflow model consumers load: `load_context` on a tiny
exported checkpoint, `predict` generating with the recorded sampler and settings, `params` overriding
them (MLflow's "unset" sentinels ignored), list or DataFrame input. No MLflow store involved."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dllmflow.settings import load_settings

TEXTS = ["Natalia sold 48 clips in April and half as many in May. #### 72", "What is 2 + 3? The answer is 5."]
RECORDED = {"steps": 4, "max_new_tokens": 4, "block_size": 4}
PROMPTS = ["What is 2 + 3?", "Natalia sold 48 clips"]


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.tracking.pyfunc import DllmGenerator

    tmp = tmp_path_factory.mktemp("pyfunc")
    tok = train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")
    settings = load_settings(
        model={"tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}}
    )
    torch.manual_seed(0)
    ckpt = tmp / "consolidated"
    build_model(settings, tok).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    settings.write_json(ckpt / "settings.json")
    gen_json = tmp / "generation.json"
    gen_json.write_text(json.dumps({"sampler": "llada", "sampler_settings": RECORDED, "mode": "mdlm"}))
    model = DllmGenerator()
    model.load_context(SimpleNamespace(artifacts={"checkpoint": str(ckpt), "generation": str(gen_json)}))
    return model, tok


def test_load_context_reads_the_checkpoint_and_the_recorded_generation(generator):
    model, tok = generator
    assert model.generation == {"sampler": "llada", "sampler_settings": RECORDED, "mode": "mdlm"}
    assert model.model.config.mask_token_id == tok.mask_token_id
    assert not model.model.training and model.tokenizer.get_vocab() == tok.get_vocab()


def test_predict_generates_with_the_recorded_sampler_and_settings(generator):
    from dllmflow.tracking.pyfunc_runtime import generate_texts

    model, _ = generator
    out = model.predict(None, PROMPTS)
    assert isinstance(out, list) and len(out) == 2 and all(isinstance(t, str) for t in out)
    assert out == generate_texts(
        model.model, model.tokenizer, PROMPTS, sampler="llada", trained=model.trained, **RECORDED
    )
    assert model.predict(None, PROMPTS) == out  # seeded: the same text again


def test_predict_accepts_a_dataframe_or_a_single_string(generator):
    import pandas as pd

    model, _ = generator
    want = model.predict(None, PROMPTS)
    assert model.predict(None, pd.DataFrame({"prompt": PROMPTS})) == want
    assert model.predict(None, pd.DataFrame({0: PROMPTS})) == want  # the first column otherwise
    assert model.predict(None, PROMPTS[0]) == want[:1]


def test_params_override_the_recorded_settings_and_sentinels_are_ignored(generator, monkeypatch):
    from dllmflow.tracking import pyfunc_runtime

    model, _ = generator
    calls = []
    monkeypatch.setattr(
        pyfunc_runtime,
        "generate_texts",
        # the effective options: recorded settings, then the caller's own overrides
        lambda m, t, prompts, sampler, overrides=None, trained=None, **kw: (
            calls.append((sampler, {**kw, **(overrides or {})})) or []
        ),
    )
    model.predict(None, PROMPTS, params={"steps": 2, "threshold": -1.0, "remasking": "", "seed": -1})
    model.predict(None, PROMPTS, params={"sampler": "llada2", "temperature": 0.5, "block_size": -1})
    model.predict(None, PROMPTS, params={"not_a_sampler_knob": 3})
    assert calls == [
        ("llada", {**RECORDED, "steps": 2}),  # -1 / -1.0 / "" mean "unset": the recorded values stay
        ("llada2", {**RECORDED, "temperature": 0.5}),
        ("llada", RECORDED),
    ]


def test_cache_is_a_typed_param_and_a_cache_the_sampler_cannot_use_is_a_400(generator):
    from dllmflow.tracking.pyfunc import InvalidGenerationRequest
    from dllmflow.tracking.pyfunc_runtime import build_signature

    model, _ = generator
    spec = {p.name: p for p in build_signature("llada2", RECORDED).params}
    assert spec["cache"].dtype.name == "string" and spec["cache"].default == "exact"  # llada2's preset
    # llada2's cache is exact (or none): a Fast-dLLM mode is refused, naming sampler and field
    with pytest.raises(
        InvalidGenerationRequest, match="sampler llada2 takes cache exact or none, not 'dual'"
    ) as e:
        model.predict(None, PROMPTS, params={"sampler": "llada2", "cache": "dual"})
    assert e.value.error_code == "INVALID_PARAMETER_VALUE"  # what `mlflow models serve` answers with 400
    out = model.predict(None, PROMPTS, params={"sampler": "llada2", "cache": "none"})  # no cache: fine
    assert len(out) == 2
