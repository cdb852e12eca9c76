"""Every sampler's knobs and preset (docs/strategies.md §3), and the one `build_sampler_config` path from
settings and flags to a config. Torch-free, so that a recipe's eval section (at the flow's parse), a CLI's
flags and a registered model's signature are checked without importing torch (~1.3 s a process); the
sampler files (`llada.py`, ...) import their config from here and do the decoding.

    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    cfg = build_sampler_config("llada", {"threshold": 0.9})    # an LLaDAConfig
    SAMPLER_CONFIGS["llada"].model_fields                      # its options (the sampler module not imported)
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from dllmflow.errors import UserError
from dllmflow.settings.pipeline import CacheMode

# An EOS stop setting: a token id, "tokenizer" (its EOS) or "none" (a preset's stop off); None = unset.
EosSetting = int | Literal["tokenizer", "none"] | None


class SamplerSettingError(UserError):
    """A sampler setting refused by `build_sampler_config`; `field` names it (a server's 400 names it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class SamplerConfig(BaseModel):
    """Knobs every sampler takes. Each sampler's config below subclasses it with its own options, its
    preset (docs/strategies.md §3.1-3.6) as the defaults. `eos_token_id: "tokenizer"` = the tokenizer's EOS."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # `steps` is the step budget of each block (llada2), not the total over max_new_tokens.
    steps_per_block: ClassVar[bool] = False
    # The `cache` modes the sampler takes (a config with a `cache` field; none: no cache of its own), and
    # why it takes no other (said when one is asked for).
    cache_modes: ClassVar[tuple[str, ...]] = ("none",)
    cache_why: ClassVar[str] = ""
    # What GRPO's rollouts (rl/rollout.py) take in place of the preset, below the eval section and
    # `rl.sampler_overrides`: a preset kept for evaluation that would change how a rollout is drawn.
    rollout_defaults: ClassVar[dict[str, Any]] = {}

    steps: PositiveInt = 128
    max_new_tokens: PositiveInt = 128
    seed: int = 42

    @field_validator("cache", check_fields=False)
    @classmethod
    def _cache_mode(cls, cache: str) -> str:
        if cache not in cls.cache_modes:
            name = cls.__name__.removesuffix("Config").lower()
            raise ValueError(
                f"sampler {name} takes cache {' or '.join(cls.cache_modes)}, not {cache!r}: {cls.cache_why}"
            )
        return cache


class BlockConfig(SamplerConfig):
    """Knobs of block-wise [MASK] filling with this loop (llada, nemotron, idlm; docs/strategies.md §3.0 defaults)."""

    block_size: PositiveInt | None = 32
    temperature: float = Field(0.0, ge=0.0)
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    eos_token_id: EosSetting = Field(
        None,
        description="Set = stop a row once it has an EOS with no [MASK] before it; 'none' turns a preset's stop off.",
    )

    @field_validator("eos_token_id")
    @classmethod
    def _no_stop(cls, eos: EosSetting) -> EosSetting:
        # "none" is how a flag, a recipe or a request says "no stop" past a preset that stops: a null
        # there means "unset, keep the preset" (build_sampler_config skips it)
        return None if eos == "none" else eos


# Why each sampler takes the cache modes it takes (docs/strategies.md §3.0 "Caches").
EXACT_CACHE_MODES = ("exact", "none")
EXACT_CACHE = (
    "its attention (causal or block-causal) keeps every cached key final, so its cache is exact; Fast-dLLM's "
    "approximate prefix/dual are for the bidirectional llada and scdd"
)
BIDIRECTIONAL_CACHE = (
    "bidirectional attention changes every key as the canvas fills, so no cache of it is exact: Fast-dLLM's "
    "approximate prefix or dual"
)

# EoTP-style truncation of the full-canvas samplers (docs/strategies.md §3.0 "Stopping at EOS").
EOS_TRUNCATE = (
    "Positions after a committed EOS become filler and leave the forwards, and a row whose window holds "
    "an EOS with no [MASK] before it stops (EOS: eos_token_id, else the tokenizer's). Approximate: "
    "with bidirectional attention the dropped positions changed the others' logits."
)


def _refuse_truncate_with_cache(cls, eos_truncate: bool, info: ValidationInfo) -> bool:
    cache = info.data.get("cache", "none")
    if eos_truncate and cache != "none":
        raise ValueError(
            f"eos_truncate shortens the full-canvas forwards of cache 'none'; cache {cache!r} "
            "forwards cached spans: set cache 'none' or drop eos_truncate"
        )
    return eos_truncate


class LLaDAConfig(BlockConfig):
    """Preset (docs/strategies.md §3.1): 128 steps for 128 new tokens in ONE block of 128, greedy, low-confidence
    remasking, no threshold, no cache, and a row stops once it holds the tokenizer's EOS with no [MASK]
    before it: its answer is final then (committed tokens never change), so the answer is the full
    canvas's token for token and the forwards after it are saved (`eos_token_id: none`: LLaDA's
    reference full canvas, trimmed afterwards). GRPO's rollouts keep the full canvas (`rollout_defaults`):
    a stopped row would change the group's noise draws and, under FSDP2, the forwards per rank."""

    cache_modes: ClassVar[tuple[str, ...]] = ("none", "prefix", "dual")
    cache_why: ClassVar[str] = BIDIRECTIONAL_CACHE
    rollout_defaults: ClassVar[dict[str, Any]] = {"eos_token_id": "none"}

    block_size: PositiveInt | None = 128
    eos_token_id: EosSetting = Field(
        "tokenizer", description="Stop a row once it has this EOS with no [MASK] before it; 'none': never."
    )
    cache: CacheMode = Field("none", description="Fast-dLLM KV cache: none, prefix or dual (approximate).")
    eos_truncate: bool = Field(False, description=EOS_TRUNCATE)

    _truncate_without_cache = field_validator("eos_truncate")(classmethod(_refuse_truncate_with_cache))


class SCDDConfig(SamplerConfig):
    """Preset (docs/strategies.md §3.2): 128 steps for 128 new tokens at temperature 1. The schedule must be the
    training one (unset = the checkpoint's); `eps` is the last time of the walk from t = 1."""

    temperature: float = Field(1.0, ge=0.0)
    uniform_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    schedule_shape: float = Field(1.0, gt=0.0)
    schedule_peak: float = Field(0.5, gt=0.0, lt=1.0)
    eps: float = Field(1e-3, gt=0.0, le=1.0)
    cache_modes: ClassVar[tuple[str, ...]] = ("none", "prefix")
    cache_why: ClassVar[str] = (
        "it redraws every window position at every step, so no suffix keeps its tokens (no 'dual'), and "
        "bidirectional attention changes every key (no 'exact')"
    )
    cache: CacheMode = Field("none", description="Fast-dLLM prefix cache of the prompt (approximate).")
    cache_refresh: PositiveInt = Field(
        16, description="Steps between the full forwards refreshing the cache."
    )
    eos_truncate: bool = Field(False, description=EOS_TRUNCATE)

    _truncate_without_cache = field_validator("eos_truncate")(classmethod(_refuse_truncate_with_cache))


class LLaDA2Config(SamplerConfig):
    """Preset (docs/strategies.md §3.3): blocks of 32, 32 steps EACH, greedy, threshold 0.5, editing off."""

    steps_per_block: ClassVar[bool] = True
    steps: PositiveInt = Field(32, description="Step budget of each block (not a total).")
    block_size: PositiveInt | None = 32
    temperature: float = Field(0.0, ge=0.0)
    threshold: float | None = Field(0.5, gt=0.0, le=1.0)
    eos_token_id: int | Literal["tokenizer"] | None = Field(None, description="None = the tokenizer's EOS.")
    # LLaDA2.1 editing: a committed token of the current block is replaced when the model's confidence
    # in a different token exceeds this; 0 = off.
    editing_threshold: float = Field(0.0, ge=0.0, le=1.0)
    max_post_steps: int = Field(16, ge=0, description="Editing-only forwards after a block is full.")
    cache_modes: ClassVar[tuple[str, ...]] = EXACT_CACHE_MODES
    cache_why: ClassVar[str] = EXACT_CACHE
    cache: CacheMode = Field("exact", description="Exact cache of the prompt and committed blocks, or none.")


class NemotronConfig(BlockConfig):
    """Preset (docs/strategies.md §3.4): 1024 steps for 1024 new tokens in blocks of 32, KV cache on, causal prompt
    context with the AR seed, threshold 0.9, EOS stop at the tokenizer's EOS."""

    steps: PositiveInt = 1024
    max_new_tokens: PositiveInt = 1024
    threshold: float | None = Field(0.9, gt=0.0, le=1.0)
    eos_token_id: EosSetting = "tokenizer"
    cache_modes: ClassVar[tuple[str, ...]] = EXACT_CACHE_MODES
    cache_why: ClassVar[str] = EXACT_CACHE
    cache: CacheMode = Field("exact", description="Exact cache of the prompt and committed blocks, or none.")
    causal_context: bool = Field(True, description="Prompt attends causally; each block gets an AR seed.")


class IDLMConfig(BlockConfig):
    """Preset (docs/strategies.md §3.6): 256 new tokens in blocks of 4 (the decode stride), 4 steps a block,
    threshold 0.9, EOS stop at the tokenizer's EOS; the rest as `BlockConfig`."""

    steps: PositiveInt = 256
    max_new_tokens: PositiveInt = 256
    block_size: PositiveInt | None = 4
    threshold: float | None = Field(0.9, gt=0.0, le=1.0)
    eos_token_id: EosSetting = "tokenizer"
    cache_modes: ClassVar[tuple[str, ...]] = EXACT_CACHE_MODES
    cache_why: ClassVar[str] = EXACT_CACHE
    cache: CacheMode = Field("exact", description="Exact cache of the committed prefix, or none.")


class ARConfig(SamplerConfig):
    """Greedy next-token decoding of a causal LM with its KV cache (docs/strategies.md §3.9): one forward
    per token, a row stops at its first stop id. `steps` is not read (one token per forward)."""

    cache_modes: ClassVar[tuple[str, ...]] = EXACT_CACHE_MODES
    cache_why: ClassVar[str] = "causal attention keeps every cached key final"
    cache: CacheMode = Field("exact", description="Exact cache of the prompt and the tokens so far, or none.")


class SelfSpecConfig(SamplerConfig):
    """Lossless self-speculative decoding of a `causal_blocks` (or `uno`) model (docs/strategies.md
    §3.10): a forward commits the model's next greedy token and the leading drafts it confirms, and
    drafts `block_size - 1` more from [MASK] slots. Preset: blocks of 8, 128 new tokens; `steps` is not
    read. The answer is the `ar` sampler's on the same model."""

    block_size: PositiveInt = Field(
        8, description="Most tokens a forward commits (1 + drafts); at most the model's dllm.block_size."
    )
    max_new_tokens: PositiveInt = 128
    batch_positions: PositiveInt | None = Field(
        None,
        description="Most positions a forward after the prompt's feeds across the live rows (None: no cap): "
        "b rows get min(block_size - 1, (batch_positions // b - 1) // 2) drafts and as many slots each, "
        "0 being an ar step. Drafts pay where a forward costs about the same for more positions (a GPU, "
        "a small batch); on a CPU at batch 16 each position is compute.",
    )
    draft_schedule: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: every forward feeds block_size - 1 drafts and as many slots. adaptive: the "
        "width follows acceptance (one more than the most drafts a row accepted, +2 when a row accepted "
        "every draft it was fed, at least 1), so drafts that keep missing stop costing positions; drafts "
        "copied by lookup_ngram are fed whole.",
    )
    slot_groups: PositiveInt = Field(
        1,
        description="Groups of [MASK] slots a forward feeds: 1 = one after the last draft (its guesses are "
        "the next drafts when every draft holds, the model's choices after a miss otherwise); 2 = also one "
        "right after the pending token (the next drafts after a first-draft miss, from the exact prefix); "
        "block_size = one after each draft. Each group costs as many positions as it has slots.",
    )
    lookup_ngram: NonNegativeInt = Field(
        0,
        description="0: the drafts are the model's. n > 0: a row whose last n tokens (or fewer, down to 1) "
        "occurred before in its prompt or answer drafts the tokens that followed there (prompt-lookup "
        "decoding), the model's drafts elsewhere. Checked like any draft: the answer does not change.",
    )
    cache_modes: ClassVar[tuple[str, ...]] = ("exact",)
    cache_why: ClassVar[str] = "its drafts are checked against the exact cache of the committed tokens"
    cache: CacheMode = Field("exact", description="Exact cache of the prompt and the committed tokens.")


class GemmaConfig(SamplerConfig):
    """Preset (docs/strategies.md §3.5): 48 denoising steps, 256 new tokens; every other knob is upstream's."""

    steps: PositiveInt = Field(48, description="Passed as `max_denoising_steps`.")
    max_new_tokens: PositiveInt = 256


# Options that were replaced: refused in one line naming what replaced them (a served request's 400 names
# the option). `no_kv_cache` also turned nemotron's causal context off; that is its own option now.
REPLACED_OPTIONS = {
    "use_kv_cache": "cache: exact (use_kv_cache false: cache: none)",
    "no_kv_cache": "cache: none (and causal_context: false, which it also set, where the sampler has one)",
}


def build_sampler_config(
    name: str,
    overrides: dict[str, Any] | None = None,
    tokenizer: Any = None,
    *,
    defaults: dict[str, Any] | None = None,
) -> SamplerConfig:
    """The config of sampler `name`: its preset, then `defaults`, then `overrides`; None values are
    skipped (an unset flag keeps the preset).

    overrides: options asked for explicitly (CLI flags, pyfunc params, Python callers); one the sampler
    does not take is a UserError naming it. defaults: generic settings shared by several samplers (the
    eval section, a registered model's recorded settings); the ones the sampler does not take are
    dropped, and so is a shared `cache` mode it cannot use (`drop_unusable_cache`). "No cache" is spelled `cache: none` only (the CLI's `--no-kv-cache` is an alias setting
    it); the old `use_kv_cache` and `no_kv_cache` options are refused, naming what replaced them
    (`REPLACED_OPTIONS`). `eos_token_id: "tokenizer"` takes `tokenizer.eos_token_id`; with no tokenizer the
    sampler fills it from its own.
    """
    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS

    check_sampler(None, name)  # a known sampler (which mode it may decode is the caller's question)
    config_cls = SAMPLER_CONFIGS[name]
    fields = config_cls.model_fields
    explicit = {k: v for k, v in (overrides or {}).items() if v is not None}
    for old in REPLACED_OPTIONS.keys() & explicit.keys():
        raise SamplerSettingError(f"{old} was replaced by {REPLACED_OPTIONS[old]}", old)
    if explicit.get("cache") == "none" and "cache" not in fields:  # no cache asked of a sampler without one
        del explicit["cache"]
    unknown = [k for k in explicit if k not in fields]
    if unknown:
        raise SamplerSettingError(_unknown_options_message(name, unknown), unknown[0])
    values = drop_unusable_cache(config_cls, {k: v for k, v in (defaults or {}).items() if k in fields})
    values.update(explicit)
    if tokenizer is not None and "eos_token_id" in fields:
        if values.get("eos_token_id", fields["eos_token_id"].default) == "tokenizer":
            values["eos_token_id"] = getattr(tokenizer, "eos_token_id", None)
    try:
        return config_cls(**values)
    except ValidationError as e:
        flags = ("--" + ".".join(map(str, err["loc"])).replace("_", "-") for err in e.errors())
        problems = "; ".join(f"{flag}: {err['msg']}" for flag, err in zip(flags, e.errors()))
        field = ".".join(map(str, e.errors()[0]["loc"])) or None
        raise SamplerSettingError(f"invalid {name} sampler settings: {problems}", field) from None


def drop_unusable_cache(config_cls: type[SamplerConfig], values: dict[str, Any]) -> dict[str, Any]:
    """Shared settings (the eval section, a model's recorded settings) as defaults of `config_cls`: the
    None values left out, and a `cache` mode it cannot use (llada2, nemotron: exact or none; llada: no
    exact). The one place this rule is written (`build_sampler_config`, `eval_knobs.eval_defaults`)."""
    out = {k: v for k, v in values.items() if v is not None}
    if "cache" in out and out["cache"] not in config_cls.cache_modes:
        del out["cache"]
    return out


def _unknown_options_message(name: str, unknown: list[str]) -> str:
    from dllmflow.diffusion.samplers import SAMPLERS  # the class's cache facts: torch, on this error only

    sampler = SAMPLERS[name]
    if "cache" in unknown:
        return f"sampler {sampler.name} takes no cache but 'none': {sampler.no_cache_reason}"
    takes = ", ".join(sampler.config_cls.model_fields)
    return f"sampler {sampler.name} does not take {', '.join(unknown)}; its options: {takes}"
