"""The `rl:` section: a GRPO stage on top of a supervised dLLM (docs/strategies.md, the RL section).

Absent (`rl: null`, the default) in every supervised recipe; present, it turns `dllmflow rl` /
`python -m dllmflow.rl` into GRPO from `init_from`. Same rules as `sections.py`: frozen, extra
fields refused, defaults here, imports no torch:

    from dllmflow.settings import load_settings
    s = load_settings("params/tiny_addition_grpo.yaml", **{"rl.init_from": "runs/tiny_addition"})
    s.rl.num_generations, s.rl.estimator.name

Checked at parse time, each naming its field: the mode has an estimator (`rl_refusal` of the mode's
`dllm:` config class, declared once per mode, read by `ModeSpec.supports_rl`), G >= 2, estimator and
reward names (built-in names, or a user's reward as "module:attr", imported only from the caller's
own recipe like `plugins`), weights per reward, prompts_per_step divisible by the world size, and
under FSDP2 with more than one rank no rollout threshold or EOS stop (`check_lockstep_rollouts`). What
needs the torch side (the rollout sampler's options and its fit to the mode, the estimator's params)
is checked by `dllmflow.rl.config.check_rl_settings` before anything is launched.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from .sections import Section

__all__ = [
    "RL_ESTIMATORS",
    "RL_REWARDS",
    "UNEVEN_ROLLOUT_OPTIONS",
    "UNEVEN_ROLLOUT_SAMPLERS",
    "EstimatorSettings",
    "RLConfig",
    "check_lockstep_rollouts",
    "check_rl_mode",
    "import_reward",
]

# The names `dllmflow.rl.estimators.ESTIMATORS` and `dllmflow.rl.rewards.REWARDS` register (a unit test
# keeps these equal to the registries, which live above settings and import torch).
RL_ESTIMATORS: tuple[str, ...] = ("one_step", "mc_elbo", "coupled", "ar_order")
RL_REWARDS: tuple[str, ...] = ("exact_match", "exact_match_strict", "format")
_USER_REWARD = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

# Under FSDP2 every forward is a collective: each rank's rollouts must take the same number of forwards
# (docs/strategies.md §8.4). These rollout options end a decode early on some data (a confidence
# threshold commits several tokens per step; an EOS stop ends a row), and these samplers do so whatever
# `rl.sampler_overrides` says (a preset threshold or EOS stop, which a null override keeps, or the
# model's own generate loop). A unit test keeps the list equal to the sampler configs' presets.
UNEVEN_ROLLOUT_OPTIONS: tuple[str, ...] = ("threshold", "eos_token_id")
UNEVEN_ROLLOUT_SAMPLERS: tuple[str, ...] = ("llada2", "nemotron", "idlm", "gemma")


class EstimatorSettings(Section):
    """`rl.estimator`: the sequence log-likelihood estimator (`dllmflow.rl.estimators`) and its params."""

    name: str = Field("one_step", description=f"One of {', '.join(RL_ESTIMATORS)}.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Its keyword params (e.g. num_masks), checked when it is built."
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in RL_ESTIMATORS:
            raise ValueError(f"unknown estimator {name!r}; choose one of: {', '.join(RL_ESTIMATORS)}")
        return name


def import_reward(spec: str) -> Any:
    """The callable a "module:attr" reward names (ValueError naming it when it does not import)."""
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"reward {spec!r} does not import ({e}); put its module on PYTHONPATH or install its package"
        ) from None
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


class RLConfig(Section):
    """GRPO: per step, `prompts_per_step` prompts x `num_generations` rollouts decoded with `sampler`,
    rewards, group-normalised advantages, `num_iterations` clipped policy updates with a KL penalty
    (`kl_beta`) to the frozen starting model."""

    init_from: str | None = Field(
        None,
        description="Starting model: a run dir, an export dir or models:/<name>@<alias> (or /<version>); "
        "`dllmflow rl --init-from` sets it. The frozen KL reference is this model.",
    )
    num_generations: int = Field(4, ge=2, description="G rollouts per prompt (a group); >= 2.")
    prompts_per_step: PositiveInt = Field(4, description="Prompts per step over all ranks.")
    num_iterations: PositiveInt = Field(1, description="Policy updates per rollout batch (mu).")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO ratio clip.")
    kl_beta: NonNegativeFloat = Field(0.04, description="Weight of the KL penalty to the reference.")
    kl_log_ratio_clip: PositiveFloat | None = Field(
        10.0,
        description="Above this log-ratio ref - policy, the k3 KL grows linearly (bounded gradient); null = unbounded.",
    )
    advantage_scale: Literal["std", "none"] = Field(
        "std", description="Divide group-centred rewards by the group's std (std) or not (none)."
    )
    estimator: EstimatorSettings = Field(default_factory=EstimatorSettings)
    rewards: list[str] = Field(
        default_factory=lambda: ["exact_match"],
        min_length=1,
        description=f"Built-in ({', '.join(RL_REWARDS)}) or a user's 'module:attr' callable.",
    )
    reward_weights: list[float] | None = Field(None, description="One per reward; None = all 1.")
    sampler: str | None = Field(None, description="Rollout sampler; None = the mode's default sampler.")
    sampler_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Rollout sampler options (steps, block_size, max_new_tokens, ...)."
    )
    temperature: NonNegativeFloat = Field(1.0, description="Rollout sampling temperature (0 = greedy).")
    max_reward_failures: NonNegativeInt = Field(
        0, description="Steps whose reward failed (raised, NaN, not a number) that may be skipped."
    )
    eval_every: NonNegativeInt = Field(0, description="Held-out exact match every N steps; 0 = off.")
    eval_limit: PositiveInt = Field(64, description="Held-out prompts of that in-run evaluation.")
    prompt_limit: PositiveInt | None = Field(None, description="Use only the first N train-split prompts.")

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, rewards: list[str]) -> list[str]:
        for name in rewards:
            if name not in RL_REWARDS and not _USER_REWARD.fullmatch(name):
                raise ValueError(
                    f"unknown reward {name!r}; choose from {', '.join(RL_REWARDS)} or name your own "
                    "callable as 'module:attr'"
                )
        return rewards

    def user_rewards(self) -> list[str]:
        """The rewards named "module:attr" (imported by the root's validator, like `plugins`)."""
        return [name for name in self.rewards if name not in RL_REWARDS]

    @field_validator("sampler_overrides")
    @classmethod
    def _no_seed(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        if "seed" in overrides or "temperature" in overrides:
            raise ValueError(
                "seed and temperature are not sampler overrides here: rollouts are seeded per prompt from "
                "train.seed; set rl.temperature"
            )
        return overrides

    @model_validator(mode="after")
    def _ar_order_rollouts(self) -> RLConfig:
        """ar_order scores the left-to-right policy: the rollouts must be decoded by it (llada, one
        position per block, sampled); steps = max_new_tokens is checked where the sampler is known."""
        if self.estimator.name != "ar_order":
            return self
        wrong = []
        if self.sampler != "llada":
            wrong.append(f"rl.sampler={self.sampler}")
        if self.sampler_overrides.get("block_size") != 1:
            wrong.append(f"rl.sampler_overrides.block_size={self.sampler_overrides.get('block_size')}")
        if self.temperature == 0:
            wrong.append("rl.temperature=0")
        if wrong:
            raise ValueError(
                f"rl.estimator.name=ar_order needs rollouts decoded left to right (rl.sampler: llada, "
                f"rl.sampler_overrides.block_size: 1, steps = max_new_tokens, rl.temperature > 0); got "
                f"{', '.join(wrong)}"
            )
        return self

    @model_validator(mode="after")
    def _weights_per_reward(self) -> RLConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"rl.reward_weights has {len(self.reward_weights)} values for {len(self.rewards)} rewards; "
                "give one weight per reward (or leave it out)"
            )
        return self


def check_rl_mode(rl: RLConfig | None, dllm: Any, world_size: int) -> None:
    """The root's rule for `rl` (ValueError naming the field): the mode declares an estimator (its
    config's `rl_refusal` is None) and the prompts split evenly over the ranks."""
    if rl is None:
        return
    refusal = getattr(type(dllm), "rl_refusal", "it declares no RL support")
    if refusal is not None:
        raise ValueError(
            f"rl: dllm.mode={dllm.mode} has no sequence log-likelihood estimator ({refusal}); GRPO runs "
            "on the absorbing-mask modes (mdlm, scdd)"
        )
    if rl.prompts_per_step % world_size:
        raise ValueError(
            f"rl.prompts_per_step ({rl.prompts_per_step}) must be a multiple of the world size ({world_size}): "
            "each rank decodes whole groups"
        )


def check_lockstep_rollouts(rl: RLConfig | None, strategy: str, world_size: int) -> None:
    """FSDP2 with more than one rank: no rollout option or sampler that makes one rank's decode take
    fewer forwards than another's (ValueError naming the field). The eval section's threshold is not
    inherited by rollouts (`dllmflow.rl.rollout.rollout_sampler_config`), so only `rl:` is read."""
    if rl is None or world_size <= 1 or strategy != "fsdp2":
        return
    why = f"under FSDP2 with {world_size} ranks every rank's rollouts must take the same number of forwards"
    if rl.sampler in UNEVEN_ROLLOUT_SAMPLERS:
        raise ValueError(
            f"rl.sampler={rl.sampler}: {why}, and {rl.sampler} decodes with a preset confidence threshold or "
            "EOS stop; use llada (mdlm, scdd) or scdd, or distributed.strategy: ddp"
        )
    uneven = [
        f"rl.sampler_overrides.{k}" for k in UNEVEN_ROLLOUT_OPTIONS if rl.sampler_overrides.get(k) is not None
    ]
    if uneven:
        raise ValueError(
            f"{', '.join(uneven)}: {why} (a threshold commits several tokens per step, an EOS stop ends a row "
            "early); remove it, or use distributed.strategy: ddp"
        )
