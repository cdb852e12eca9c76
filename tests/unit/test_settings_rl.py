"""The `rl:` section: off by default, and every bad value refused at parse time naming its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllmflow.errors import UserError
from dllmflow.settings import RL_ESTIMATORS, RL_REWARDS, SettingsError, load_settings, load_settings_json

ROOT = Path(__file__).resolve().parents[2]
SFT = ROOT / "params" / "tiny_addition.yaml"
GRPO = ROOT / "params" / "tiny_addition_grpo.yaml"


def test_off_by_default_and_the_sft_fingerprint_is_unchanged():
    from dllmflow.training.fingerprint import settings_fingerprint

    s = load_settings(SFT)
    assert s.rl is None
    assert not any(k.startswith("rl") for k in settings_fingerprint(s)["fields"])
    g = load_settings(GRPO)
    assert g.rl.num_generations == 8 and g.rl.estimator.name == "one_step"
    fields = settings_fingerprint(g)["fields"]
    assert fields["rl.kl_beta"] == 0.01 and fields["rl.kl_log_ratio_clip"] == 10.0  # the measured recipe
    assert "rl.eval_every" not in fields  # eval cadence may change on resume


@pytest.mark.parametrize(
    ("rl", "field", "words"),
    [
        ({"num_generations": 1}, "rl.num_generations", "greater than or equal to 2"),
        ({"estimator": {"name": "exact"}}, "rl.estimator.name", "one_step, mc_elbo, coupled, ar_order"),
        ({"rewards": ["bleu"]}, "rl.rewards", "unknown reward 'bleu'"),
        ({"rewards": ["no_such_module_xyz:fn"], "reward_weights": None}, "rl", "rl.rewards: reward"),
        ({"rewards": ["exact_match"], "reward_weights": [1.0, 2.0]}, "rl", "one weight per reward"),
        ({"sampler_overrides": {"seed": 3}}, "rl.sampler_overrides", "rl.temperature"),
        ({"clip_eps": 0.0}, "rl.clip_eps", "greater than 0"),
        ({"kl_log_ratio_clip": 0.0}, "rl.kl_log_ratio_clip", "greater than 0"),
        ({"bogus": 1}, "rl.bogus", "unknown field"),
    ],
)
def test_bad_values_name_their_field(rl, field, words):
    with pytest.raises(SettingsError) as err:
        load_settings(GRPO, rl=rl)
    assert f"{field}: " in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("recipe", ["tiny_hybrid", "tiny_block_diffusion", "tiny_idlm", "tiny_dflash"])
def test_a_mode_without_an_estimator_is_refused_naming_it(recipe):
    from dllmflow.diffusion.modes import MODES

    s = load_settings(ROOT / "params" / f"{recipe}.yaml")
    assert not MODES[s.dllm.mode].supports_rl
    with pytest.raises(SettingsError, match=rf"rl: dllm.mode={s.dllm.mode} has no sequence log-likelihood"):
        load_settings(ROOT / "params" / f"{recipe}.yaml", rl={})


def test_the_absorbing_mask_modes_take_rl():
    from dllmflow.diffusion.modes import MODES

    assert [m for m, spec in MODES.items() if spec.supports_rl] == ["mdlm", "scdd"]
    assert load_settings(ROOT / "params" / "tiny_scdd.yaml", rl={}).rl.num_generations == 4


def test_prompts_split_evenly_over_ranks():
    with pytest.raises(
        SettingsError, match=r"rl.prompts_per_step \(3\) must be a multiple of the world size \(2\)"
    ):
        load_settings(GRPO, rl={"prompts_per_step": 3}, launch={"nproc_per_node": 2})
    assert (
        load_settings(GRPO, rl={"prompts_per_step": 4}, launch={"nproc_per_node": 2}).rl.prompts_per_step == 4
    )


def test_a_recorded_user_reward_is_not_imported(tmp_path):
    """As with `plugins`: a settings.json someone else wrote never imports its reward module."""
    data = load_settings(GRPO).to_dict()
    data["rl"].update(rewards=["no_such_module_xyz:fn"], reward_weights=None)
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(data))
    assert load_settings_json(path).rl.rewards == ["no_such_module_xyz:fn"]
    with pytest.raises(SettingsError, match="does not import"):
        load_settings_json(path, import_plugins=True)


def test_setting_names_match_the_registries():
    from dllmflow.rl.estimators import ESTIMATORS
    from dllmflow.rl.rewards import REWARDS

    assert set(RL_ESTIMATORS) == set(ESTIMATORS)
    assert set(RL_REWARDS) == set(REWARDS)


def test_the_rollout_sampler_must_fit_the_mode_and_take_the_options():
    from dllmflow.workflow.grpo import check_rl_settings

    with pytest.raises(UserError, match=r"rl.sampler .*'idlm' does not fit"):
        check_rl_settings(load_settings(GRPO, rl={"sampler": "idlm"}))
    with pytest.raises(UserError, match=r"rl.sampler .*does not take no_such_knob"):
        check_rl_settings(load_settings(GRPO, rl={"sampler_overrides": {"no_such_knob": 1}}))
    with pytest.raises(UserError, match="rl.estimator"):
        check_rl_settings(
            load_settings(GRPO, rl={"estimator": {"name": "one_step", "params": {"num_masks": 2}}})
        )
    check_rl_settings(load_settings(GRPO, rl={"sampler": "llada2", "sampler_overrides": {"steps": 4}}))


@pytest.mark.parametrize(
    ("rl", "field"),
    [
        ({"sampler_overrides": {"threshold": 0.9}}, "rl.sampler_overrides.threshold"),
        ({"sampler_overrides": {"eos_token_id": 2}}, "rl.sampler_overrides.eos_token_id"),
        (
            {"sampler_overrides": {"eos_token_id": "tokenizer", "threshold": 0.5}},
            "rl.sampler_overrides.threshold, rl.sampler_overrides.eos_token_id",
        ),  # fmt: skip
        ({"sampler": "llada2"}, "rl.sampler"),
    ],
)
def test_fsdp2_rollouts_over_ranks_take_no_threshold_or_eos_stop(rl, field):
    """docs/strategies.md §8.4: under FSDP2 every forward is a collective, so with 2 ranks the rollout
    options that end a decode early on some data are refused at parse time, naming the field."""
    fsdp2 = {"distributed": {"strategy": "fsdp2"}, "launch": {"nproc_per_node": 2}}
    with pytest.raises(SettingsError) as err:
        load_settings(GRPO, rl=rl, **fsdp2)
    assert f"{field}" in str(err.value) and "same number of forwards" in str(err.value)
    load_settings(GRPO, rl=rl, launch={"nproc_per_node": 2})  # DDP: ranks do not wait on each forward
    load_settings(GRPO, rl=rl, distributed={"strategy": "fsdp2"})  # one rank
    assert load_settings(GRPO, **fsdp2).rl.sampler_overrides == {}


def test_the_uneven_samplers_are_those_whose_preset_thresholds_or_stops():
    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS
    from dllmflow.settings import rl as rl_settings

    def preset(cfg, key):  # what a rollout decodes with: the preset, the sampler's rollout_defaults over it
        field = cfg.model_fields.get(key)
        value = None if field is None else cfg.rollout_defaults.get(key, field.default)
        return None if value == "none" else value

    uneven = {
        n
        for n, c in SAMPLER_CONFIGS.items()
        if any(preset(c, k) is not None for k in ("threshold", "eos_token_id"))
    }
    # llada2: eos_token_id None means the tokenizer's EOS; gemma: transformers' own adaptive stopping
    assert set(rl_settings.UNEVEN_ROLLOUT_SAMPLERS) == uneven | {"llada2", "gemma"}


def test_rollouts_do_not_inherit_the_eval_threshold():
    from dllmflow.rl.rollout import rollout_sampler_config

    s = load_settings(GRPO, eval={"threshold": 0.9, "steps": 4, "max_new_tokens": 4, "block_size": 4})
    config = rollout_sampler_config(s)
    assert config.threshold is None and config.steps == 4 and config.max_new_tokens == 4  # length knobs: yes
    assert (
        rollout_sampler_config(load_settings(GRPO, rl={"sampler_overrides": {"threshold": 0.7}})).threshold
        == 0.7
    )


def test_llada_rollouts_decode_the_full_canvas_while_its_evaluation_stops_at_eos():
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.rl.rollout import rollout_sampler_config

    class Tok:
        eos_token_id = 5

    s = load_settings(GRPO)
    assert build_sampler_config("llada", tokenizer=Tok()).eos_token_id == 5  # evaluate, serve, generate
    assert rollout_sampler_config(s, Tok()).eos_token_id is None  # rollouts: no stop, as before
    assert rollout_sampler_config(s, Tok(), greedy=True).eos_token_id is None
    asked = load_settings(GRPO, rl={"sampler_overrides": {"eos_token_id": "tokenizer"}})
    assert rollout_sampler_config(asked, Tok()).eos_token_id == 5  # the recipe may still ask for the stop
