"""One registration per `dllm.mode`: `MODES[name]` is the `ModeSpec` holding everything true of a mode.

A spec names the mode's `dllm:` config class, its strategy, the model builder, the samplers that decode
its checkpoints (default first) and its extra evaluations. Every other table is derived from `MODES`:
`STRATEGIES` (diffusion.strategies), `SAMPLERS_FOR_MODE` (here), `eval_samplers` (workflow.finetune),
the settings' mode list (`register_mode` adds the config class to `settings.MODE_CONFIGS`). The one
rule for "may sampler S decode a checkpoint of mode M" is `check_sampler` (generate, the registered
model and the sampler configs all ask it).

    from dllmflow.diffusion.modes import MODES, ModeSpec, build_mode_model, check_sampler, register_mode
    MODES["mdlm"].samplers                          # ("llada", "llada2"); MODES["x"] -> KeyError listing choices
    model = build_mode_model(settings, tokenizer)   # the trainable model of settings.dllm.mode
    check_sampler("mdlm", "idlm")                   # SamplerMisfitError naming the samplers that fit
    register_mode(ModeSpec("toy", ToyConfig, "my_pkg.toy:ToyStrategy", samplers=("llada",)))

Strategies and builders are "module:attr" strings imported on first use, so importing this module
stays cheap (no torch) and a mode's heavy imports (a frozen target, flex attention) happen only when
that mode runs. A mode defined outside dllmflow registers from its own module, listed in the settings'
`plugins` so every process (torchrun ranks, the registered model) imports it: docs/adding_a_mode.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dllmflow.common.lazy import load_object
from dllmflow.errors import UserError
from dllmflow.settings.block_modes import BlockCausalConfig, CausalBlocksConfig
from dllmflow.settings.dllm import (
    ARConfig,
    BlockDiffusionConfig,
    DFlashConfig,
    DLLMBaseConfig,
    HybridConfig,
    IDLMConfig,
    MDLMConfig,
    SCDDConfig,
    UnoConfig,
    mode_name,
    register_mode_config,
)

DEFAULT_MODEL_BUILDER = "dllmflow.models.build:build_model"


@dataclass(frozen=True)
class ModeSpec:
    """Everything true of one `dllm.mode`.

    name:              the `dllm.mode` value; must equal `config`'s `mode: Literal[...]`.
    config:            its `dllm:` settings section (a `DLLMBaseConfig` subclass, no torch).
    strategy:          "module:Class" of its `Strategy` (the training math).
    samplers:          samplers that decode its checkpoints, default (gated, registered) first.
    extra_evaluations: evaluations that are not a sampler (dflash: "acceptance" of the draft).
    model_builder:     "module:function" `(settings, tokenizer) -> nn.Module` building the trainable
                       model (wrapped by DDP/FSDP2 and optimised); default: the configured model.
    lossless:          for a mode whose checkpoints answer as a causal LM must (uno's drafting adapter),
                       the samplers that give that LM's greedy answers; the others are labelled lossy.

    The spec only names its strategy (a `Strategy` subclass, the training math) and never imports
    it, so that `diffusion.strategies` depends on this registry and not the other way round.
    """

    name: str
    config: type[DLLMBaseConfig]
    strategy: str
    samplers: tuple[str, ...] = ()
    extra_evaluations: tuple[str, ...] = ()
    model_builder: str = DEFAULT_MODEL_BUILDER
    lossless: tuple[str, ...] = ()

    @property
    def default_sampler(self) -> str | None:
        return self.samplers[0] if self.samplers else None

    @property
    def supports_rl(self) -> bool:
        """GRPO (`rl:`) can train it: its config declares no `rl_refusal` (settings/dllm.py says why
        hybrid, block_diffusion, dflash and idlm cannot; the settings check it at parse time)."""
        return self.config.rl_refusal is None

    @property
    def evaluations(self) -> tuple[str, ...]:
        """What the flow's evaluate step runs by default: the fitting samplers, then the extras."""
        return self.samplers + self.extra_evaluations

    def strategy_class(self) -> type:
        """The `Strategy` subclass, imported now (its heavy imports with it)."""
        return load_object(self.strategy)

    def build_model(self, settings: Any, tokenizer: Any) -> Any:
        """The trainable model (on the current device context: `meta.build_on_meta()` for a skeleton)."""
        return load_object(self.model_builder)(settings, tokenizer)


class UnknownModeError(KeyError):
    def __str__(self) -> str:  # KeyError would print the repr (quoted) of the message
        return str(self.args[0])


class ModeRegistry(Mapping[str, ModeSpec]):
    """name -> ModeSpec in registration order; an unknown name raises a KeyError listing the choices."""

    def __init__(self) -> None:
        self._specs: dict[str, ModeSpec] = {}

    def __getitem__(self, name: str) -> ModeSpec:
        if name not in self._specs:
            raise UnknownModeError(
                f"unknown dllm.mode {name!r}; choose one of: {', '.join(self._specs)} "
                "(a mode defined outside dllmflow registers with register_mode, see docs/adding_a_mode.md)"
            )
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def derive(self, get: Callable[[ModeSpec], Any]) -> DerivedTable:
        """A live read-only table name -> get(spec): it follows later registrations."""
        return DerivedTable(self, get)


class DerivedTable(Mapping[str, Any]):
    """A view of `MODES` through one fact of each spec (e.g. its strategy class, its samplers)."""

    def __init__(self, modes: ModeRegistry, get: Callable[[ModeSpec], Any]):
        self._modes, self._get = modes, get

    def __getitem__(self, name: str) -> Any:
        return self._get(self._modes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._modes)

    def __len__(self) -> int:
        return len(self._modes)

    def __contains__(self, name: object) -> bool:
        return name in self._modes


MODES = ModeRegistry()


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add a mode: to `MODES` and (its config class) to the settings' `MODE_CONFIGS`. Registering the
    same spec again is a no-op (a plugin imported twice); a different spec under a taken name fails."""
    if mode_name(spec.config) != spec.name:
        raise ValueError(
            f"ModeSpec {spec.name!r}: its config {spec.config.__name__} declares mode {mode_name(spec.config)!r}"
        )
    known = MODES._specs.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"dllm.mode {spec.name!r} is already registered: {known}")
    register_mode_config(spec.config)  # refuses a different class already registered under the name
    MODES._specs[spec.name] = spec
    return spec


# Which samplers decode a checkpoint trained with each mode (evaluation matrix, sampler checks).
SAMPLERS_FOR_MODE = MODES.derive(lambda spec: spec.samplers)


def build_mode_model(settings: Any, tokenizer: Any) -> Any:
    """The trainable model of `settings.dllm.mode` (its `ModeSpec.model_builder`)."""
    return MODES[settings.dllm.mode].build_model(settings, tokenizer)


class SamplerMisfitError(UserError):
    """A known sampler that does not decode checkpoints of the given mode (`dllmflow generate` only
    warns about it; the registered model and the server refuse it)."""


def check_sampler(mode: str | None, sampler: str) -> None:
    """The one rule for "may `sampler` decode a checkpoint trained with `mode`": the sampler exists
    (UserError listing the samplers), and, when the mode is known (None: not recorded, anything
    goes), it is one of `MODES[mode].samplers` (SamplerMisfitError naming the sampler, the mode and
    the samplers that fit). A mode this process has not registered (a plugin not imported) fits none."""
    from dllmflow.diffusion.samplers import SAMPLERS  # a table of names: imports no sampler

    if sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
    if mode is None:
        return
    fits = MODES[mode].samplers if mode in MODES else ()
    if sampler not in fits:
        raise SamplerMisfitError(
            f"checkpoint was trained with dllm.mode={mode}; sampler {sampler!r} does not fit it. "
            f"Samplers that fit: {', '.join(fits) or 'none (evaluate it with `dllmflow evaluate`)'}"
        )


def decoding_of(mode: str | None, sampler: str) -> str | None:
    """ "lossless" or "lossy" for a checkpoint of a mode that declares its lossless samplers (uno: its
    answers must be the causal LM's), else None (nothing to label). Results, the card and served usage
    carry it."""
    spec = MODES._specs.get(mode) if mode else None
    if spec is None or not spec.lossless:
        return None
    return "lossless" if sampler in spec.lossless else "lossy"


# ---- the built-in modes ------------------------------------------------------------------------------

_S = "dllmflow.diffusion.strategies"
for _spec in (
    ModeSpec(
        "mdlm",
        MDLMConfig,
        f"{_S}.mdlm:MDLMStrategy",
        samplers=("llada", "llada2"),
        model_builder="dllmflow.models.logit_shift:build_mdlm_model",  # dllm.logit_shift
    ),
    ModeSpec("scdd", SCDDConfig, f"{_S}.scdd:SCDDStrategy", samplers=("scdd", "llada")),
    ModeSpec(
        "hybrid",
        HybridConfig,
        f"{_S}.hybrid:HybridStrategy",
        samplers=("nemotron", "llada"),
        # any causal LM gets the masked_indices / causal_logits interface from the adapter
        model_builder="dllmflow.models.hybrid_adapter:build_hybrid_model",
    ),
    ModeSpec(
        "block_diffusion",
        BlockDiffusionConfig,
        f"{_S}.block_diffusion:BlockDiffusionStrategy",
        samplers=("gemma",),
        model_builder="dllmflow.models.diffusion_gemma:build_diffusion_gemma",
    ),
    # A DFlash export is a draft: no sampler decodes it alone; speculative decoding against its frozen
    # target measures it. The draft is a checkpoint or a fresh one shaped like the target.
    ModeSpec(
        "dflash",
        DFlashConfig,
        f"{_S}.dflash:DFlashStrategy",
        extra_evaluations=("acceptance",),
        model_builder="dllmflow.models.dflash_target:build_dflash_draft",
    ),
    ModeSpec("idlm", IDLMConfig, f"{_S}.idlm:IDLMStrategy", samplers=("idlm",)),
    # Trained under the block-causal mask llada2 decodes with (its causal prompt read off config.json).
    ModeSpec(
        "block_causal",
        BlockCausalConfig,
        f"{_S}.block_causal:BlockCausalStrategy",
        samplers=("llada2",),
        model_builder="dllmflow.models.causal_prompt:build_block_causal_model",
    ),
    # A causal LM that also guesses ahead from [MASK] slots: llada2 decodes it causally (dllm_causal_blocks
    # in config.json), selfspec losslessly, its slots' guesses checked by its own next-token choices.
    ModeSpec(
        "causal_blocks",
        CausalBlocksConfig,
        f"{_S}.causal_blocks:CausalBlocksStrategy",
        samplers=("llada2", "selfspec"),
        model_builder="dllmflow.models.causal_prompt:build_causal_blocks_model",
    ),
    # A drafting adapter on a frozen causal LM: selfspec decodes the LM's own greedy answers with its
    # drafts, ar the LM alone (the same answers), llada2 lossily from [MASK] blocks.
    ModeSpec(
        "uno",
        UnoConfig,
        f"{_S}.uno:UnoStrategy",
        samplers=("selfspec", "ar", "llada2"),
        lossless=("selfspec", "ar"),
    ),
    # The AR control: the base causal LM fine-tuned next-token, decoded greedily with its KV cache.
    ModeSpec("ar", ARConfig, f"{_S}.ar:ARStrategy", samplers=("ar",)),
):
    register_mode(_spec)
del _spec

__all__ = [
    "MODES",
    "SAMPLERS_FOR_MODE",
    "ModeSpec",
    "SamplerMisfitError",
    "build_mode_model",
    "check_sampler",
    "decoding_of",
    "load_object",
    "register_mode",
]
