"""What a caller may ask of a sampler: the one check of a value given from outside (a served request's
`dllmflow` overrides, `serve --sampler-setting`, `generate`/`evaluate` flags, the registered pyfunc's
params) before a sampler decodes with it. Torch-free.

    config = build_asked_config("llada", {"steps": 64}, tok, defaults=recorded, limits=AskLimits(1024))
    # SamplerSettingError naming the field: a string or a bool for a number, a float for an int, a
    # non-finite float, steps beyond the generation length, max_new_tokens above the cap, a seed outside
    # int64, an eos_token_id outside the vocabulary (the tokenizer's, when one is given)

Two stages, in this order. Parse: each value the caller gave is checked STRICTLY against the type of
the sampler's field (`"1000000000"`, `1e9` and `true` are not steps; lax coercion read `true` as 1), and
a float must be finite. Cap, on the parsed config: `max_new_tokens` and `block_size` at most the caller's cap;
`steps` (and llada2's `max_post_steps`) at most the generation length and the cap (a forward past it
decodes nothing, and `steps` sizes a [B, steps] schedule: 10^9 steps allocated 8 GB), `temperature` in [0, TEMPERATURE_MAX], `seed` an int64. Values recorded with a model (the
`defaults`) are the training run's own and are not the caller's: only the fields asked for are capped.

The ranges shared with the causal server's request schema (`inference/requests.py`) are defined here
once: `TEMPERATURE_MAX`, `SEED_MIN`, `SEED_MAX`, and `strict_value` checks any field the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from dllmflow.diffusion.samplers.configs import SamplerConfig, SamplerSettingError, build_sampler_config

TEMPERATURE_MAX = 2.0  # OpenAI's range for `temperature`: the top-level field of a request
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's range for `seed` (an int64; torch takes it too)


@dataclass(frozen=True)
class AskLimits:
    """Caps of what a caller may ask beyond the sampler's own rules. `max_new_tokens`: the largest
    generation, and the most `steps` / `max_post_steps` (None: the model's positions decide,
    `models.limits.check_generation_fits`); `flag`: what sets it, named in the refusal."""

    max_new_tokens: int | None = None
    flag: str = "--max-tokens-cap"
    vocab_size: int | None = None  # token ids asked (eos_token_id) must be below it; None: >= 0 only


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation, config=ConfigDict(strict=True))


def strict_value(key: str, value: Any, annotation: Any) -> Any:
    """`value` checked strictly against `annotation` (no string or bool for a number, no float for an
    int) and, if a float, finite; SamplerSettingError naming `key` otherwise."""
    try:
        out = _adapter(annotation).validate_python(value)
    except ValidationError as e:
        got = repr(value)
        got = got if len(got) <= 60 else got[:60] + "..."
        raise SamplerSettingError(f"{key}: {e.errors()[0]['msg'].lower()} (got {got})", key) from None
    if isinstance(out, float) and not math.isfinite(out):
        raise SamplerSettingError(f"{key}: must be a finite number (got {value!r})", key)
    return out


def parse_asked(name: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A caller's overrides of sampler `name`, each value parsed strictly by its field's type (None: the
    preset, kept as None). Unknown keys pass through: `build_sampler_config` names them."""
    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS

    fields = SAMPLER_CONFIGS[name].model_fields
    out: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            out[key] = None
        else:
            out[key] = strict_value(key, value, fields[key].annotation) if key in fields else value
    return out


def check_asked(config: SamplerConfig, asked: set[str], limits: AskLimits = AskLimits()) -> None:
    """Caps of the fields in `asked` on the parsed `config` (module docstring); SamplerSettingError
    naming the field."""
    length = config.max_new_tokens
    cap = limits.max_new_tokens
    if "max_new_tokens" in asked and cap is not None and length > cap:
        raise SamplerSettingError(
            f"max_new_tokens: {length} is above the cap of {cap} ({limits.flag})", "max_new_tokens"
        )
    block = getattr(config, "block_size", None) or length
    # a block past the generation is one block (llada's preset block of 128 decodes 8 tokens too), but a
    # cached sampler's canvas is a whole block: a server caps it like max_new_tokens
    if "block_size" in asked and cap is not None and block > cap:
        raise SamplerSettingError(
            f"block_size: {block} is above the cap of {cap} ({limits.flag})", "block_size"
        )
    # a forward each: past the tokens they can commit they decode nothing; a server caps them as it caps
    # max_new_tokens
    per_block = type(config).steps_per_block
    bound, what = (min(block, length), "the block size") if per_block else (length, "max_new_tokens")
    for key in ("steps", "max_post_steps"):
        value = getattr(config, key, None)
        if key not in asked or value is None:
            continue
        if cap is not None and value > cap:
            raise SamplerSettingError(f"{key}: {value} is above the cap of {cap} ({limits.flag})", key)
        if value > bound:
            raise SamplerSettingError(
                f"{key}: {value} is above the generation length ({what} = {bound}): a forward past it "
                "decodes nothing",
                key,
            )
    temperature = getattr(config, "temperature", None)
    if "temperature" in asked and temperature is not None and not 0.0 <= temperature <= TEMPERATURE_MAX:
        raise SamplerSettingError(
            f"temperature: {temperature} is outside [0, {TEMPERATURE_MAX:g}]", "temperature"
        )
    if "seed" in asked and not SEED_MIN <= config.seed <= SEED_MAX:
        raise SamplerSettingError(f"seed: {config.seed} is outside the int64 range", "seed")
    check_eos(config, limits.vocab_size if "eos_token_id" in asked else None, asked)


def check_eos(config: SamplerConfig, vocab_size: int | None, asked: set[str] | None = None) -> None:
    """An integer `eos_token_id` is a token id: >= 0 always, < `vocab_size` when it is known (an id no
    row can hold never stops a row: every answer would run to max_new_tokens)."""
    eos = getattr(config, "eos_token_id", None)
    if (
        not isinstance(eos, int)
        or isinstance(eos, bool)
        or (asked is not None and "eos_token_id" not in asked)
    ):
        return
    if eos < 0 or (vocab_size is not None and eos >= vocab_size):
        where = f"[0, {vocab_size})" if vocab_size is not None else "the token ids (>= 0)"
        raise SamplerSettingError(
            f"eos_token_id: {eos} is outside the vocabulary {where}; give a token id of the model's "
            "tokenizer, 'tokenizer' (its EOS) or none",
            "eos_token_id",
        )


def build_asked_config(
    name: str,
    overrides: dict[str, Any] | None,
    tokenizer: Any = None,
    *,
    defaults: dict[str, Any] | None = None,
    limits: AskLimits = AskLimits(),
) -> SamplerConfig:
    """`build_sampler_config` of a caller's `overrides`: parsed strictly first, capped after (module
    docstring); SamplerSettingError naming the field."""
    asked = parse_asked(name, overrides)
    config = build_sampler_config(name, asked, tokenizer, defaults=defaults)
    if limits.vocab_size is None and tokenizer is not None:
        limits = dataclasses.replace(limits, vocab_size=len(tokenizer))
    check_asked(config, {k for k, v in asked.items() if v is not None}, limits)
    return config
