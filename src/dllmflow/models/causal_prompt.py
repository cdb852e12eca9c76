"""A block-causal A2D model's prompt attends causally, as in the causal LM it was converted from
(`dllm.mode: block_causal` with `dllm.causal_prompt`, docs/strategies.md §2.8).

The flag is recorded in the model's config (`dllm_causal_prompt`, saved in config.json) so the sampler
that decodes the export (llada2) builds the same block-causal mask the model was trained under: the
prompt's keys are then exactly the ones a causal prefill computes.

    model = build_block_causal_model(settings, tokenizer)   # the block_causal ModeSpec's builder
    has_causal_prompt(model)                                # True when the recipe set dllm.causal_prompt
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .logit_shift import build_mdlm_model
from .wrappers import unwrap

CAUSAL_PROMPT_ATTR = "dllm_causal_prompt"


def build_block_causal_model(settings: Any, tokenizer: Any) -> nn.Module:
    """The configured model with the logit shift (`dllm.logit_shift`) and causal-prompt flags set."""
    model = build_mdlm_model(settings, tokenizer)
    return apply_causal_prompt(model) if settings.dllm.causal_prompt else model


def apply_causal_prompt(model: nn.Module) -> nn.Module:
    """Flag `model` (its config, so exports carry it) to be decoded with a causal prompt."""
    setattr(model.config, CAUSAL_PROMPT_ATTR, True)
    return model


def has_causal_prompt(model: nn.Module) -> bool:
    return bool(getattr(getattr(unwrap(model), "config", None), CAUSAL_PROMPT_ATTR, False))
