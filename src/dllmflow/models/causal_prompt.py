"""What a block-causal model attends causally: its prompt with `dllm.causal_prompt` (`block_causal` and
`causal_blocks`, docs/strategies.md §2.8, §2.10), and a `causal_blocks` model its blocks too.

The flags are recorded in the model's config (`dllm_causal_prompt`, `dllm_causal_blocks`, saved in
config.json) so the sampler that decodes the export (llada2) builds the mask the model was trained
under: with a causal prompt its keys are exactly the ones a causal prefill computes.

    model = build_block_causal_model(settings, tokenizer)   # the block_causal ModeSpec's builder
    model = build_causal_blocks_model(settings, tokenizer)  # the causal_blocks one
    has_causal_prompt(model), has_causal_blocks(model)      # what the recipe set
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .logit_shift import apply_logit_shift, build_mdlm_model
from .wrappers import unwrap

CAUSAL_PROMPT_ATTR = "dllm_causal_prompt"
CAUSAL_BLOCKS_ATTR = "dllm_causal_blocks"


def build_block_causal_model(settings: Any, tokenizer: Any) -> nn.Module:
    """The configured model with the logit shift (`dllm.logit_shift`) and the causal prompt flag set."""
    model = build_mdlm_model(settings, tokenizer)
    return apply_causal_prompt(model) if settings.dllm.causal_prompt else model


def build_causal_blocks_model(settings: Any, tokenizer: Any) -> nn.Module:
    """The configured model with the logit shift (the mode reads every logit one position early), the
    causal prompt flag when set and the causal blocks flag."""
    from .build import build_model

    model = apply_logit_shift(build_model(settings, tokenizer))
    if settings.dllm.causal_prompt:
        apply_causal_prompt(model)
    setattr(model.config, CAUSAL_BLOCKS_ATTR, True)
    return model


def apply_causal_prompt(model: nn.Module) -> nn.Module:
    """Flag `model` (its config, so exports carry it) to be decoded with a causal prompt."""
    setattr(model.config, CAUSAL_PROMPT_ATTR, True)
    return model


def has_causal_prompt(model: nn.Module) -> bool:
    return bool(getattr(getattr(unwrap(model), "config", None), CAUSAL_PROMPT_ATTR, False))


def has_causal_blocks(model: nn.Module) -> bool:
    return bool(getattr(getattr(unwrap(model), "config", None), CAUSAL_BLOCKS_ATTR, False))
