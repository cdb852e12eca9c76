"""Which eval-section knob a sampler takes: the `eval:` section is shared by every sampler of a mode,
so each sampler takes the knobs its config has (a value it cannot use is dropped, `cache` included:
`configs.drop_unusable_cache`).
Torch-free (the sampler configs, not the samplers): the recipe parse, the evaluation and RL's rollouts
call it.

    defaults = eval_defaults(settings.eval, "llada")     # {"max_new_tokens": .., "cache": .., ...}
    sampler_takes("nemotron", "cache", "dual")            # False: its cache is exact (exact or none)
"""

from __future__ import annotations

from typing import Annotated, Any

EVAL_SETTINGS = (
    "max_new_tokens", "steps", "block_size", "threshold", "cache", "temperature", "batch_positions",
    "draft_schedule", "lookup_ngram", "slot_groups", "seed",
)  # fmt: skip
# Knobs only some samplers have (selfspec's draft policies): a value set in the eval section is refused
# when no evaluated sampler takes it (`protocol.check_eval_settings`), as `cache` is.
SAMPLER_SPECIFIC = ("batch_positions", "draft_schedule", "lookup_ngram", "slot_groups")


def eval_defaults(eval_cfg: Any, sampler: str) -> dict[str, Any]:
    """The eval section's sampler knobs as defaults for `sampler`, the ones set. The section is shared by
    every sampler of the mode: a knob it does not take is dropped (by `build_sampler_config`), and so is an
    `eval.cache` mode it cannot use (`configs.drop_unusable_cache`); `check_eval_settings` refuses a
    cache that no evaluated sampler can use."""
    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS  # torch-free: the recipe parse calls this
    from dllmflow.diffusion.samplers.configs import drop_unusable_cache

    values = {k: getattr(eval_cfg, k, None) for k in EVAL_SETTINGS} if eval_cfg is not None else {}
    return drop_unusable_cache(SAMPLER_CONFIGS[sampler], values)


def sampler_takes(sampler: str, key: str, value: Any) -> bool:
    """Whether `sampler`'s config has option `key` and accepts `value` for it (None = the preset: always).
    `cache`: one of the config's `cache_modes` (`none` for a sampler without a cache option too)."""
    from pydantic import TypeAdapter, ValidationError

    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS  # torch-free: the recipe parse calls this

    if key == "cache":
        return value is None or value in SAMPLER_CONFIGS[sampler].cache_modes
    field = SAMPLER_CONFIGS[sampler].model_fields.get(key)
    if field is None:
        return False
    if value is None:
        return True
    try:
        annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return False
    return True


def cache_modes(sampler: str) -> tuple[str, ...]:
    """The `cache` values `sampler` takes, in `CACHE_MODES` order ("none" only: it has no cache option)."""
    from dllmflow.settings.pipeline import CACHE_MODES

    return tuple(m for m in CACHE_MODES if sampler_takes(sampler, "cache", m))
