"""`dllmflow.diffusion.modes`: every per-mode table is derived from `MODES`, unknown modes list the
choices, and a seventh mode defined only in the test tree (`_toy_mode.py`) validates, trains under
torchrun (the `plugins` setting imports it in the child) and evaluates through the workflow functions."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from dllmflow.diffusion.modes import (
    MODES,
    SAMPLERS_FOR_MODE,
    ModeSpec,
    SamplerMisfitError,
    check_sampler,
    load_object,
    register_mode,
)
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.strategies import STRATEGIES, build_strategy
from dllmflow.errors import UserError
from dllmflow.settings import (
    MODE_CONFIGS,
    MDLMConfig,
    SettingsError,
    load_settings,
    load_settings_json,
)
from dllmflow.settings import MODE_NAMES as SETTINGS_MODES
from dllmflow.workflow import finetune

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY_RECIPES = sorted((ROOT / "params").glob("tiny_*.yaml"))
BUILT_IN = ("mdlm", "scdd", "hybrid", "block_diffusion", "dflash", "idlm", "block_causal", "causal_blocks")


# ---- every table is derived from MODES --------------------------------------------------------------


def test_built_in_modes_are_registered_in_order():
    assert tuple(MODES)[: len(BUILT_IN)] == BUILT_IN


def test_strategies_samplers_and_settings_follow_the_specs():
    assert list(STRATEGIES) == list(MODES) == list(SAMPLERS_FOR_MODE)
    assert set(SETTINGS_MODES) == set(MODES)
    for name, spec in MODES.items():
        assert spec.name == name
        assert STRATEGIES[name] is load_object(spec.strategy) and STRATEGIES[name].name == name
        assert SAMPLERS_FOR_MODE[name] == spec.samplers
        assert MODE_CONFIGS[name] is spec.config
        assert all(s in SAMPLERS for s in spec.samplers), spec
        assert callable(load_object(spec.model_builder)), spec
        assert "build_model" not in vars(spec.strategy_class()), spec  # the spec builds the model


@pytest.mark.parametrize("path", TINY_RECIPES, ids=[p.name for p in TINY_RECIPES])
def test_eval_samplers_and_build_strategy_come_from_the_spec(path):
    s = load_settings(path)
    spec = MODES[s.dllm.mode]
    # the untrained AR base ("ar") and the same-data AR control ("ar_control") follow when asked for
    # (a GRPO recipe, `rl:`, has no control arm even when it shares the fine-tune's eval section)
    control = s.eval.ar_control is not None and s.eval.ar_control.enabled and s.rl is None
    ar_rows = ["ar"] * bool(s.eval.ar_baseline) + ["ar_control"] * control
    assert finetune.eval_samplers(s) == list(spec.samplers) + list(spec.extra_evaluations) + ar_rows
    assert type(build_strategy(s)) is spec.strategy_class()
    assert type(s.dllm) is spec.config


def test_every_built_in_mode_has_a_tiny_recipe():
    recipes = {load_settings(p).dllm.mode for p in TINY_RECIPES}
    assert set(BUILT_IN) <= recipes


def test_unknown_mode_lists_the_choices():
    for table in (MODES, STRATEGIES, SAMPLERS_FOR_MODE):
        with pytest.raises(KeyError) as e:
            table["diffusion"]
        assert "'diffusion'" in str(e.value) and "choose one of: mdlm, scdd, hybrid" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load_settings(dllm={"mode": "diffusion"})
    msg = str(e.value)
    assert msg.startswith("invalid setting: dllm: unknown mode 'diffusion'")
    assert all(name in msg for name in BUILT_IN) and "plugins" in msg


def test_register_mode_refuses_a_conflict():
    assert register_mode(MODES["mdlm"]) is MODES["mdlm"]  # the same spec again: a no-op
    other = ModeSpec("mdlm", MDLMConfig, "somewhere:Else", samplers=("llada",))
    with pytest.raises(ValueError, match="already registered"):
        register_mode(other)
    with pytest.raises(ValueError, match="declares mode 'mdlm'"):
        register_mode(ModeSpec("mdlm2", MDLMConfig, "somewhere:Else"))
    assert MODES["mdlm"].strategy.endswith("mdlm:MDLMStrategy") and "mdlm2" not in MODES


# ---- may sampler S decode mode M: one rule -----------------------------------------------------------


def test_check_sampler_accepts_exactly_the_spec_samplers():
    for name, spec in MODES.items():
        for sampler in SAMPLERS:
            if sampler in spec.samplers:
                check_sampler(name, sampler)
            else:
                with pytest.raises(SamplerMisfitError):
                    check_sampler(name, sampler)
        check_sampler(None, next(iter(SAMPLERS)))  # no recorded mode: any known sampler


def test_check_sampler_names_the_sampler_the_mode_and_the_choices():
    with pytest.raises(SamplerMisfitError) as e:
        check_sampler("hybrid", "idlm")
    assert str(e.value) == (
        "checkpoint was trained with dllm.mode=hybrid; sampler 'idlm' does not fit it. "
        "Samplers that fit: nemotron, llada"
    )
    assert isinstance(e.value, UserError)
    with pytest.raises(
        SamplerMisfitError, match="dllm.mode=dflash; sampler 'llada' .* Samplers that fit: none"
    ):
        check_sampler("dflash", "llada")
    with pytest.raises(SamplerMisfitError, match="dllm.mode=not_imported_plugin; .* fit: none"):
        check_sampler("not_imported_plugin", "llada")


def test_check_sampler_refuses_an_unknown_sampler_listing_the_samplers():
    for mode in (None, "mdlm"):
        with pytest.raises(UserError) as e:
            check_sampler(mode, "nope")
        assert not isinstance(e.value, SamplerMisfitError)
        assert str(e.value) == f"unknown sampler 'nope'; choose one of: {', '.join(SAMPLERS)}"


def test_every_sampler_check_asks_the_one_rule(monkeypatch):
    """generate (a warning), the registered model (an error) and the sampler configs all defer to
    `modes.check_sampler`: a mode whose spec lists a sampler fits it everywhere at once."""
    from dllmflow.diffusion.samplers.base import build_sampler_config
    from dllmflow.inference.generate import check_sampler_fits, validate_sampler_request
    from dllmflow.tracking.pyfunc_runtime import generate_texts

    toy = ModeSpec("mdlm", MDLMConfig, MODES["mdlm"].strategy, samplers=("idlm",))
    monkeypatch.setitem(MODES._specs, "mdlm", toy)
    settings = load_settings()
    assert check_sampler_fits("idlm", settings) is None
    with pytest.warns(UserWarning, match="sampler 'llada' does not fit"):
        assert "Samplers that fit: idlm" in check_sampler_fits("llada", settings)
    with pytest.raises(SamplerMisfitError, match="Samplers that fit: idlm"):
        generate_texts(object(), None, ["hi"], sampler="llada", trained=settings)
    for check in (validate_sampler_request, build_sampler_config):
        with pytest.raises(UserError, match="unknown sampler 'nope'; choose one of: llada"):
            check("nope")


def test_a_plugin_that_does_not_import_names_the_field():
    with pytest.raises(SettingsError, match=r"plugins: cannot import plugin 'no_such_plugin_x'"):
        load_settings(plugins=["no_such_plugin_x"])


# ---- a seventh mode from the test tree, end to end --------------------------------------------------


def _toy_settings(tmp_path: Path, **dllm):
    return load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        name="tiny_toy",
        plugins=["_toy_mode"],  # imported before `dllm` is validated, here and in torchrun's ranks
        dllm={"mode": "toy", "loss_weight": 0.5, **dllm},
        dataset={"limit": 16, "seq_length": 128, "prepared_dir": str(tmp_path / "prepared")},
        train={"max_steps": 3, "global_batch_size": 4, "local_batch_size": 2, "warmup_steps": 1},
        checkpoint={"every_steps": 3},
        eval={"limit": 2, "max_new_tokens": 8, "steps": 8, "block_size": 8, "batch_size": 2}
        | {"untrained_baseline": True},
    )


def test_toy_mode_validates_and_round_trips(tmp_path):
    s = _toy_settings(tmp_path)
    import _toy_mode

    assert type(s.dllm) is _toy_mode.ToyConfig and s.dllm.loss_weight == 0.5 and "toy" in SETTINGS_MODES
    assert s.dllm.eps == 1e-3 and s.dllm.supervise_padding is False  # shared fields from the recipe
    back = load_settings_json(s.write_json(tmp_path / "settings.json"))
    assert back == s and type(back.dllm) is _toy_mode.ToyConfig
    assert json.loads((tmp_path / "settings.json").read_text())["dllm"]["loss_weight"] == 0.5
    with pytest.raises(SettingsError, match=r"dllm\.loss_weight"):
        _toy_settings(tmp_path, loss_weight=0)
    with pytest.raises(SettingsError, match=r"dllm\.vocab_size: unknown field"):
        _toy_settings(tmp_path, vocab_size=5)
    assert type(build_strategy(s)) is _toy_mode.ToyStrategy
    assert MODES["toy"] is _toy_mode.SPEC and finetune.eval_samplers(s) == ["llada"]


def _check_run_and_evaluate(s, run_dir: Path) -> None:
    """metrics.jsonl says the toy mode ran 3 steps; the workflow's evaluate step decodes with llada."""
    recorded = json.loads((run_dir / "settings.json").read_text())
    assert recorded["plugins"] == ["_toy_mode"] and recorded["dllm"]["mode"] == "toy"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["mode"] == "toy" and math.isfinite(m["loss"]) for m in metrics)

    samplers = finetune.eval_samplers(s)
    assert samplers == ["llada"]
    result = finetune.evaluate_sampler(s, str(run_dir), samplers[0])
    assert {"metrics", "protocol", "predictions"} <= set(result)  # + "baseline" (untrained EM) on tiny models
    assert result["baseline"]["metrics"].keys() == result["metrics"].keys()
    assert result["protocol"]["sampler"] == "llada" and len(result["predictions"]) == 2
    assert result["metrics"]["num_examples"] == 2
    assert json.loads((run_dir / "eval" / "llada.json").read_text())["protocol"]["sampler"] == "llada"


def test_toy_mode_trains_in_process_and_evaluates(tmp_path):
    from dllmflow.data.prepare import prepare
    from dllmflow.training.distributed import shutdown
    from dllmflow.training.trainer import run_training

    s = _toy_settings(tmp_path)
    prepare(s)
    try:
        result = run_training(s, tmp_path / "run")
    finally:
        shutdown()
    assert result.final_step == 3 and len(result.losses) == 3
    _check_run_and_evaluate(s, tmp_path / "run")


@pytest.mark.slow  # ~40 s: torchx + torchrun start a fresh interpreter that must import the plugin
def test_toy_mode_trains_under_torchrun_and_evaluates(tmp_path, monkeypatch):
    from dllmflow.data.prepare import prepare

    # The child processes find the plugin where this test does (tests/unit is not a package).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    s = _toy_settings(tmp_path)
    prepare(s)
    training = finetune.train(s, str(tmp_path / "run"))
    _check_run_and_evaluate(s, Path(training["run_dir"]))


def test_an_evaluated_sampler_the_mode_does_not_list_fails_at_the_recipe_parse():
    """Which samplers decode a mode is the registry's alone (no per-config hook): a recipe asking for
    another one is refused when the flow parses it, naming the field and the samplers that fit."""
    import yaml

    from dllmflow.settings import SettingsError

    data = yaml.safe_load((ROOT / "params" / "tiny_mdlm.yaml").read_text())
    data["eval"]["samplers"] = ["llada", "selfspec"]
    with pytest.raises(SettingsError, match=r"eval\.samplers: selfspec does not decode dllm\.mode=mdlm; "
                                            r"samplers that fit: llada, llada2"):  # fmt: skip
        finetune.parse_params_config(yaml.safe_dump(data))
    data["eval"]["samplers"] = ["llada2", "llada"]
    assert finetune.parse_params_config(yaml.safe_dump(data))["eval"]["samplers"] == ["llada2", "llada"]
