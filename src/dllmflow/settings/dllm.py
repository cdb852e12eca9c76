"""The `dllm:` section: one pydantic model per training mode, picked by its `mode` field.

Every field the guide's "Key dLLM Configuration Fields" table names lives here with its default;
the rules of each mode are validators, so a wrong combination fails at load time with the dotted
path of the field (see `dllmflow.settings.loader`). Imports no torch.

    from dllmflow.settings import load_settings
    s = load_settings("params/tiny_scdd.yaml"); s.dllm.uniform_ratio

`MODE_CONFIGS` (mode name -> config class) is open: `dllmflow.diffusion.modes.register_mode` adds the
config class of a mode defined outside this package, and the `dllm` field dispatches on `mode` through
it (a discriminated union that grows at run time). The built-in classes register themselves here (the
two block-causal modes in `block_modes.py`) so settings load without importing the (torch-side) mode
registry.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SerializeAsAny,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DLLMBaseConfig(_Section):
    """Fields shared by every mode (collator padding, corruption floor, mask id). A mode's config
    subclasses it and adds `mode: Literal["<name>"]` plus its own fields."""

    # DiffusionGemma-style modes align the collator's blocks to the response (see data/collate.py).
    response_window: ClassVar[bool] = False
    # Why the mode cannot train packed rows (`dataset.packing`); None = it can (docs/strategies.md §1.8).
    packing_refusal: ClassVar[str | None] = "it declares no packing support"
    # Why GRPO (`rl:`) cannot train the mode; None = it can: an absorbing-mask model whose sequence
    # log-likelihood the estimators of `dllmflow.rl.estimators` bound (read as `ModeSpec.supports_rl`).
    rl_refusal: ClassVar[str | None] = "it declares no sequence log-likelihood estimator"
    # Why `eval.ar_control` (the same-data AR fine-tune beside the run) cannot run for the mode; None =
    # it can: the mode trains a causal LM's weights that an `ar` run can fine-tune causally instead.
    ar_control_refusal: ClassVar[str | None] = None
    # With `eval.ar_control`, the mode trains on top of the control's export (trained first) instead of
    # beside it: uno's drafting adapter drafts for the control itself.
    trains_on_control: ClassVar[bool] = False

    mask_token_id: int | None = Field(
        None, ge=0, description="Mask token id; None = resolve from the tokenizer (then the strategy)."
    )
    eps: float = Field(1e-3, gt=0.0, le=1.0, description="Minimum corruption ratio / diffusion time.")
    pad_block_size: PositiveInt | None = Field(None, description="Collator stage-1 block fill size.")
    pad_seq_len_divisible: PositiveInt | None = Field(
        None, description="Round the batch length up to a multiple of lcm(pad_block_size, this)."
    )
    supervise_padding: bool = Field(False, description="loss_mask=1 on the global padding tail.")

    def check_eval(self, eval_section: Any) -> None:
        """Refuse an `eval:` section that cannot decode what this mode trains (raise ValueError naming
        the field); the default accepts every one."""

    def check_sections(self, settings: Any) -> None:
        """Refuse other sections this mode cannot train with (raise ValueError naming the field); the
        default accepts every one."""

    @classmethod
    def upgrade_recorded(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A section of this mode as an older dllmflow recorded it (a settings.json dump), as it validates
        today, possibly under another mode (`block_modes.py`: causal blocks left `block_causal`); the
        default: as is. A recipe's section passes as is, so a recipe still meets its refusals."""
        return value


# mode name -> its `dllm:` config class, in registration order (the order error messages list them).
MODE_CONFIGS: dict[str, type[DLLMBaseConfig]] = {}


def mode_name(config_cls: type[DLLMBaseConfig]) -> str:
    """The name in a config class's `mode: Literal["<name>"]` annotation."""
    field = config_cls.model_fields.get("mode")
    names = get_args(field.annotation) if field is not None else ()
    if len(names) != 1 or not isinstance(names[0], str):
        raise TypeError(f'{config_cls.__name__} needs a field `mode: Literal["<name>"]`')
    return names[0]


def register_mode_config(config_cls: type[DLLMBaseConfig]) -> type[DLLMBaseConfig]:
    """Make `dllm: {mode: <name>}` validate as `config_cls` (a decorator; the same class again is a no-op)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, DLLMBaseConfig)):
        raise TypeError(f"a mode config must subclass DLLMBaseConfig, got {config_cls!r}")
    name = mode_name(config_cls)
    known = MODE_CONFIGS.get(name)
    if known is not None and known is not config_cls:
        raise ValueError(
            f"dllm.mode {name!r} is already registered to {known.__module__}.{known.__qualname__}"
        )
    MODE_CONFIGS[name] = config_cls
    return config_cls


@register_mode_config
class MDLMConfig(DLLMBaseConfig):
    """LLaDA-style masked diffusion (docs/strategies.md §2.1)."""

    mode: Literal["mdlm"] = "mdlm"
    packing_refusal: ClassVar[str | None] = None
    rl_refusal: ClassVar[str | None] = None
    logit_shift: bool = Field(
        False,
        description="Dream-style A2D: position i's logit is read from position i-1, the alignment of the "
        "causal LM it starts from (models/logit_shift.py); recorded in the export's config.json.",
    )
    attention_annealing_steps: int = Field(
        0,
        ge=0,
        description="DiffuLLaMA-style A2D: for the first N optimizer steps each query sees its past and a "
        "growing share step/N of its future keys (drawn per sample, seeded like the noise), so a converted "
        "causal LM moves to bidirectional attention gradually; bidirectional from step N on. 0 = from the "
        "first step. Needs a model that takes a 4D mask (not the natively bidirectional LLaDA family).",
    )


@register_mode_config
class SCDDConfig(DLLMBaseConfig):
    """Self-correcting discrete diffusion (docs/strategies.md §2.2)."""

    mode: Literal["scdd"]
    packing_refusal: ClassVar[str | None] = None
    # Absorbing [MASK] plus uniform noise: the estimators mask only, which the model reads like any
    # partly masked canvas (its predictions at [MASK] are the absorbing part of its posterior).
    rl_refusal: ClassVar[str | None] = None
    vocab_size: PositiveInt = Field(
        ..., description="Vocabulary size including [MASK]; must equal the model's."
    )
    num_timesteps: int = Field(1000, ge=2, description="Discrete diffusion steps T (>= 2).")
    uniform_ratio: float = Field(0.1, ge=0.0, lt=1.0, description="Peak share of uniform noise, 0 <= r < 1.")
    schedule_shape: float = Field(1.0, gt=0.0, description="Shape mass of the uniform-noise bump.")
    schedule_peak: float = Field(0.5, gt=0.0, lt=1.0, description="Time in (0, 1) of the uniform peak.")
    chunk_size: PositiveInt | None = Field(
        1024, description="Positions per checkpointed loss chunk; null = one shot."
    )


@register_mode_config
class HybridConfig(DLLMBaseConfig):
    """Nemotron-Labs-Diffusion: diffusion + AR (docs/strategies.md §2.3)."""

    mode: Literal["hybrid"]
    rl_refusal: ClassVar[str | None] = (
        "its model masks the clean ids itself and mixes a causal AR branch; no masked-canvas estimator of it yet"
    )
    packing_refusal: ClassVar[str | None] = (
        "its model masks the clean ids itself and builds its own AR and bidirectional masks"
    )
    block_size: PositiveInt | None = Field(None, description="Set = blockwise corruption; unset = uniform.")
    half_life_ratio: float | None = Field(
        0.25, gt=0.0, description="Blockwise half-life ratio (null -> 0.25)."
    )
    ar_loss_alpha: float = Field(
        1.0, ge=0.0, description="Weight on the DIFFUSION branch (AR is unweighted)."
    )


@register_mode_config
class BlockDiffusionConfig(DLLMBaseConfig):
    """DiffusionGemma-style block diffusion (docs/strategies.md §2.4)."""

    mode: Literal["block_diffusion"]
    rl_refusal: ClassVar[str | None] = (
        "its corruption is uniform over the vocabulary, not an absorbing [MASK], so the masked estimators do not bound its likelihood"
    )
    packing_refusal: ClassVar[str | None] = "its encoder/decoder canvas is built around one response per row"
    response_window: ClassVar[bool] = True
    ar_control_refusal: ClassVar[str | None] = (
        "DiffusionGemma is an encoder-decoder with a canvas decoder: there is no causal LM to fine-tune "
        "next-token on the same rows"
    )
    vocab_size: PositiveInt = Field(..., description="Vocabulary the uniform corruption draws from.")
    block_size: PositiveInt = Field(256, description="Response-block size for one-canvas-per-step selection.")
    encoder_loss_weight: float = Field(1.0, ge=0.0, description="Weight on the co-trained encoder AR loss.")
    self_conditioning_p: float = Field(
        0.5, ge=0.0, le=1.0, description="Per-example self-conditioning probability."
    )


@register_mode_config
class DFlashConfig(DLLMBaseConfig):
    """DFlash speculative draft on a frozen target (docs/strategies.md §2.5). Its knobs live in the top-level `dflash:`."""

    mode: Literal["dflash"]
    rl_refusal: ClassVar[str | None] = (
        "a DFlash export is a speculative draft conditioned on a frozen target, not a standalone policy"
    )
    packing_refusal: ClassVar[str | None] = (
        "its draft blocks are conditioned on the target's hidden states of one row"
    )
    ar_control_refusal: ClassVar[str | None] = (
        "a DFlash run trains a speculative draft for a frozen target, not a model to compare with its AR parent"
    )


@register_mode_config
class IDLMConfig(DLLMBaseConfig):
    """Introspective diffusion: AR LM -> dLLM (docs/strategies.md §2.6)."""

    mode: Literal["idlm"]
    rl_refusal: ClassVar[str | None] = (
        "its [noisy | clean] 2L layout and introspective verification need their own estimator"
    )
    packing_refusal: ClassVar[str | None] = "its [noisy | clean] 2L layout and block mask are built per row"
    mask_token_id: int = Field(..., ge=0, description="Explicit mask token id (I-DLM does not infer one).")
    block_length: PositiveInt | list[PositiveInt] = Field(
        1, description="I-DLM block size; a list runs a curriculum of successive fine-tunes (e.g. [1, 2, 3])."
    )
    clean_loss_weight: float = Field(0.2, ge=0.0, description="Fixed alpha on CE_clean.")
    auto_balance_clean_loss: bool = Field(False, description="alpha = stopgrad(CE_noisy / CE_clean).")


@register_mode_config
class UnoConfig(DLLMBaseConfig):
    """A drafting adapter on a frozen causal LM (docs/strategies.md §2.9, NeMo AutoModel's `uno`): a
    LoRA adapter, active only at [MASK] positions, learns to guess the tokens after a clean prefix from
    [MASK] slots; every other position computes exactly what the causal LM computes, so `selfspec`
    decodes the LM's own greedy answers in fewer forwards."""

    mode: Literal["uno"]
    trains_on_control: ClassVar[bool] = True
    rl_refusal: ClassVar[str | None] = "the adapter drafts for a frozen causal LM; it is not a policy"
    packing_refusal: ClassVar[str | None] = "its anchors and [MASK] slots are drawn per row"
    block_size: int = Field(
        8,
        ge=2,
        description="Most tokens one selfspec forward commits: the pending token plus block_size - 1 drafts, "
        "guessed by as many [MASK] slots (trained as such; decode with selfspec at this block_size or less).",
    )
    anchors: PositiveInt = Field(
        4,
        description="Anchor points drawn per row and step: after each, block_size - 1 [MASK] slots guess the "
        "tokens that follow the clean prefix (a step computes the row once, without gradients, and the slots).",
    )

    def check_eval(self, eval_section: Any) -> None:
        given = eval_section.block_size
        if given is not None and given > self.block_size:
            raise ValueError(
                f"eval.block_size: the drafting adapter is trained for dllm.block_size={self.block_size} "
                f"(that many - 1 slots); selfspec cannot draft {given - 1}; set eval.block_size <= {self.block_size}"
            )

    def check_sections(self, settings: Any) -> None:
        """The adapter needs LoRA that touches nothing but itself, a causal LM under it and no activation
        checkpointing (its slot forward appends to the clean row's KV cache)."""
        from .pipeline import non_causal_base

        peft = settings.peft
        if peft is None or not peft.enabled:
            raise ValueError(
                "peft: dllm.mode=uno trains a LoRA drafting adapter on a frozen causal LM; add a peft: "
                "section (e.g. {r: 16, alpha: 32})"
            )
        if peft.modules_to_save:
            raise ValueError(
                "peft.modules_to_save: dllm.mode=uno keeps the causal LM exactly as it is (only the gated "
                "adapter trains); remove peft.modules_to_save"
            )
        base = non_causal_base(settings.model) or dllm_export(settings.model)
        if base is not None:
            raise ValueError(
                f"model.pretrained_model_name_or_path: dllm.mode=uno drafts for a causal LM, and "
                f"{settings.model.pretrained_model_name_or_path!r} is {base}; name the AR model (or an "
                "`ar` export, the AR control)"
            )
        if settings.train.activation_checkpointing != "none":
            raise ValueError(
                "train.activation_checkpointing: dllm.mode=uno's slot forward appends to the clean row's KV "
                "cache, which a recomputed layer would append to again; set it to none (a step keeps "
                "activations for the slots alone)"
            )


def dllm_export(model: Any) -> str | None:
    """Why the `model:` section's local dir is a dLLM export (its config.json's `dllm.mode` is one that
    is not a causal LM: not `ar`), or None."""
    import json
    from pathlib import Path

    name = model.pretrained_model_name_or_path
    config = Path(name) / "config.json" if name is not None else None
    if config is None or not config.is_file():
        return None
    try:
        mode = (json.loads(config.read_text()).get("dllm") or {}).get("mode")
    except (OSError, ValueError, AttributeError):
        return None
    return f"a dLLM export (dllm.mode={mode})" if mode not in (None, "ar") else None


@register_mode_config
class ARConfig(DLLMBaseConfig):
    """Causal next-token SFT of the base model, the AR control of every dLLM mode (docs/strategies.md §2.7).
    Only `mask_token_id` of the shared fields matters: it keeps the tokenizer and embedding rows those of
    the dLLM run it controls."""

    mode: Literal["ar"]
    ar_control_refusal: ClassVar[str | None] = (
        "the run is already the AR model; `ar_control` controls a dLLM run"
    )
    rl_refusal: ClassVar[str | None] = "GRPO here estimates a masked-diffusion likelihood, not a causal one"


def _validate_dllm(value: Any, handler: ValidatorFunctionWrapHandler) -> DLLMBaseConfig:
    """Dispatch on `mode` to the registered config class; its errors keep their `dllm.<field>` path."""
    if isinstance(value, DLLMBaseConfig) or not isinstance(value, dict):
        return handler(value)  # an instance passes as is; anything else fails as "not a mapping"
    if "mode" not in value:
        raise PydanticCustomError(
            "union_tag_not_found", "`mode` is missing; choose one of {choices}", {"choices": _choices()}
        )
    mode = value["mode"]
    if not isinstance(mode, str) or mode not in MODE_CONFIGS:
        raise PydanticCustomError(
            "union_tag_invalid",
            "unknown mode {mode}; choose one of {choices} (a mode defined outside dllmflow: name the "
            "module that registers it in `plugins`)",
            {"mode": repr(mode), "choices": _choices()},
        )
    value = MODE_CONFIGS[mode].upgrade_recorded(value)
    return MODE_CONFIGS[value["mode"]].model_validate(value)


def _choices() -> str:
    return ", ".join(MODE_CONFIGS)


# The `dllm:` field type: validated by `mode`, serialised as the concrete subclass (all its fields).
DLLMConfig = Annotated[SerializeAsAny[DLLMBaseConfig], WrapValidator(_validate_dllm)]


# The registered mode names, a live view: a mode registered at run time shows up here too.
MODE_NAMES = MODE_CONFIGS.keys()


class DFlashSection(_Section):
    """The guide's top-level `dflash:` block (only read when `dllm.mode == dflash`)."""

    target_model_id: str = Field(
        ..., min_length=1, description="Hub id or local dir of the frozen causal target."
    )
    target_torch_dtype: Literal["float32", "bfloat16", "float16", "float64"] = "bfloat16"
    block_size: int = Field(
        0, ge=0, description="Tokens per draft block; 0 reads the draft config. Must resolve >= 2."
    )
    loss_decay_gamma: float = Field(
        0.0, ge=0.0, description="Decay gamma; 0 = paper defaults (7/5/4 for 16/10/8)."
    )
    num_blocks_per_sample: PositiveInt = Field(
        1, description="Anchor blocks per sequence per step (paper: 512)."
    )
    attention_backend: Literal["sdpa", "flex_attention"] = "sdpa"
    overlap_anchors: bool = True
    use_fused_linear_ce: bool = True
    ce_chunk_size: PositiveInt = 1024
    num_draft_layers: PositiveInt = Field(
        1, description="Layers of our own draft module when the draft has no class."
    )
    target_layer_ids: list[int] | None = Field(
        None, description="Target layers feeding the draft; None = evenly spaced."
    )

    @model_validator(mode="after")
    def _block_size_not_one(self) -> DFlashSection:
        if self.block_size == 1:
            raise ValueError("dflash.block_size must be 0 (read from the draft config) or >= 2")
        return self
