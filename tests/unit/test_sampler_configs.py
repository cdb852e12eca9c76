"""Per-sampler configs (docs/strategies.md §3.1-3.6): each sampler's preset is its config class's defaults, an option
a sampler does not take is an error naming it, generic settings it does not take are dropped, and a
registered model's recorded settings are told apart from the caller's own `params`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dllmflow.diffusion.samplers import SAMPLER_CONFIGS, SAMPLERS
from dllmflow.diffusion.samplers.configs import SamplerConfig, SamplerSettingError, build_sampler_config
from dllmflow.errors import UserError
from dllmflow.tracking.pyfunc_runtime import recorded_params, split_params


class _Tok:
    mask_token_id, eos_token_id, pad_token_id = 0, 1, 2


# The presets of docs/strategies.md §3.1-3.6 ("tokenizer" = the tokenizer's EOS).
PRESETS = {
    "llada": dict(steps=128, max_new_tokens=128, block_size=128, temperature=0.0, remasking="low_confidence",
                  threshold=None, eos_token_id="tokenizer", cache="none"),
    "scdd": dict(steps=128, max_new_tokens=128, temperature=1.0, uniform_ratio=0.1, schedule_shape=1.0,
                 schedule_peak=0.5, eps=1e-3, cache="none"),
    "llada2": dict(steps=32, max_new_tokens=128, block_size=32, temperature=0.0, threshold=0.5,
                   editing_threshold=0.0, max_post_steps=16, cache="exact"),
    "nemotron": dict(steps=1024, max_new_tokens=1024, block_size=32, temperature=0.0, cache="exact",
                     threshold=0.9, causal_context=True, eos_token_id="tokenizer"),
    "gemma": dict(steps=48, max_new_tokens=256),
    "idlm": dict(steps=256, max_new_tokens=256, block_size=4, threshold=0.9, eos_token_id="tokenizer",
                 cache="exact"),
    "ar": dict(max_new_tokens=128, seed=42, cache="exact"),
    "selfspec": dict(max_new_tokens=128, block_size=8, cache="exact", batch_positions=None),
}  # fmt: skip

# One option each sampler does not take (another sampler's knob).
FOREIGN = {"llada": "editing_threshold", "scdd": "threshold", "llada2": "remasking",
           "nemotron": "uniform_ratio", "gemma": "temperature", "idlm": "editing_threshold",
           "ar": "threshold", "selfspec": "threshold"}  # fmt: skip


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_preset_is_the_config_class_defaults(name):
    cls = SAMPLERS[name].config_cls
    assert issubclass(cls, SamplerConfig) and cls is not SamplerConfig
    assert cls.model_config["extra"] == "forbid" and cls.model_config["frozen"]
    assert {k: getattr(cls(), k) for k in PRESETS[name]} == PRESETS[name]
    cfg = build_sampler_config(name, tokenizer=_Tok())
    resolved = {k: (_Tok.eos_token_id if v == "tokenizer" else v) for k, v in PRESETS[name].items()}
    assert {k: getattr(cfg, k) for k in resolved} == resolved


@pytest.mark.parametrize("name", ["llada", "nemotron", "idlm"])
def test_none_turns_a_preset_eos_stop_off_where_null_keeps_it(name):
    # null is "unset" on every path (a flag not given, a recipe key left empty): the preset's stop stays
    assert build_sampler_config(name, {"eos_token_id": None}, tokenizer=_Tok()).eos_token_id == 1
    assert build_sampler_config(name, {"eos_token_id": "none"}, tokenizer=_Tok()).eos_token_id is None
    assert build_sampler_config(name, defaults={"eos_token_id": "none"}).eos_token_id is None
    assert build_sampler_config(name, {"eos_token_id": 7}, tokenizer=_Tok()).eos_token_id == 7


def test_presets_differ_per_sampler():
    assert (
        build_sampler_config("nemotron").cache == "exact" and build_sampler_config("nemotron").causal_context
    )
    assert build_sampler_config("llada").block_size == 128 and build_sampler_config("idlm").block_size == 4
    assert build_sampler_config("llada2").steps == 32 and build_sampler_config("gemma").steps == 48
    assert build_sampler_config("llada").cache == "none" and not hasattr(
        build_sampler_config("gemma"), "cache"
    )


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_an_option_the_sampler_does_not_take_is_named(name):
    option = FOREIGN[name]
    with pytest.raises(UserError, match=rf"sampler {name} does not take {option}"):
        build_sampler_config(name, {option: 1})
    with pytest.raises(ValidationError, match=option):
        SAMPLERS[name].config_cls(**{option: 1})
    # the old spelling of the cache: one line naming its replacement, for every sampler
    with pytest.raises(UserError, match=r"^use_kv_cache was replaced by cache: exact \(use_kv_cache false"):
        build_sampler_config(name, {"use_kv_cache": False})


def test_none_values_skipped_and_generic_defaults_dropped_where_not_taken():
    cfg = build_sampler_config(
        "gemma", {"steps": None}, defaults={"steps": 3, "threshold": 0.9, "block_size": None}
    )
    assert cfg.steps == 3 and not hasattr(cfg, "threshold")
    cfg = build_sampler_config("llada", {"threshold": 0.8}, defaults={"threshold": 0.9, "max_new_tokens": 16})
    assert (cfg.threshold, cfg.max_new_tokens) == (0.8, 16)  # explicit wins over defaults
    with pytest.raises(UserError, match="--threshold"):
        build_sampler_config("llada", defaults={"threshold": 1.5})  # a value it takes is still validated


def test_no_cache_is_spelled_cache_none_and_no_kv_cache_is_its_alias():
    """`cache: none` is the one spelling; `--no-kv-cache` sets exactly that (nemotron's causal context is
    its own option, set explicitly); the old `no_kv_cache` option is refused naming what replaced it."""
    from dllmflow.cli import build_parser
    from dllmflow.inference.generate import sampler_overrides

    def flags(*extra):
        argv = ["generate", "--checkpoint", "c", "--prompt", "p", *extra]
        return sampler_overrides(build_parser(argv)[0].parse_args(argv))

    assert flags("--no-kv-cache") == flags("--cache", "none") == {"cache": "none", "seed": 42}
    cfg = build_sampler_config("nemotron", flags("--no-kv-cache"))
    assert (cfg.cache, cfg.causal_context) == ("none", True)
    cfg = build_sampler_config("nemotron", flags("--no-kv-cache", "--causal-context", "off"))
    assert (cfg.cache, cfg.causal_context) == ("none", False)
    assert build_sampler_config("llada", {"cache": "none"}) == build_sampler_config(
        "llada"
    )  # nothing to turn off
    with pytest.raises(SamplerSettingError, match=r"^no_kv_cache was replaced by cache: none") as info:
        build_sampler_config("nemotron", {"no_kv_cache": True})
    assert info.value.field == "no_kv_cache"


def test_tokenizer_eos_is_filled_by_the_sampler_when_built_without_tokenizer():
    cfg = build_sampler_config("nemotron")
    assert cfg.eos_token_id == "tokenizer"
    assert SAMPLERS["nemotron"](None, _Tok(), cfg).config.eos_token_id == _Tok.eos_token_id
    with pytest.raises(UserError, match="takes a LLaDAConfig"):
        SAMPLERS["llada"](None, _Tok(), cfg)


def test_pyfunc_params_recorded_vs_the_callers_own():
    generation = {"sampler": "gemma", "sampler_settings": {"steps": 8, "max_new_tokens": 16}}
    defaults = recorded_params("gemma", generation["sampler_settings"])  # what MLflow fills in
    sampler, settings, overrides = split_params(generation, {**defaults, "threshold": -1.0})  # -1 = unset
    assert (sampler, overrides, settings["steps"]) == ("gemma", {}, 8)
    sampler, settings, overrides = split_params(generation, {**defaults, "steps": 4, "threshold": 0.9})
    assert overrides == {"steps": 4, "threshold": 0.9}
    with pytest.raises(UserError, match="sampler gemma does not take threshold"):
        build_sampler_config(sampler, overrides, defaults=settings)
    # a model registered before the per-sampler configs recorded every knob: still loads and runs
    old = {"sampler": "gemma", "sampler_settings": {**PRESETS["llada"], "steps": 8, "block_size": 32}}
    sampler, settings, overrides = split_params(old, {"sampler": "gemma", "block_size": 32, "steps": 8})
    assert overrides == {} and build_sampler_config(sampler, overrides, defaults=settings).steps == 8


def test_the_torch_free_config_registry_names_each_samplers_own_config():
    assert list(SAMPLER_CONFIGS) == list(SAMPLERS)
    for name in SAMPLERS:
        assert SAMPLER_CONFIGS[name] is SAMPLERS[name].config_cls, name
