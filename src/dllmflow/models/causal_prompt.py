"""What a block-causal A2D model (`dllm.mode: block_causal`, docs/strategies.md §2.8) attends causally:
its prompt (`dllm.causal_prompt`), and with `dllm.block_attention: causal` its blocks too.

The flags are recorded in the model's config (`dllm_causal_prompt`, `dllm_causal_blocks`, saved in
config.json) so the sampler that decodes the export (llada2) builds the mask the model was trained
under: with a causal prompt its keys are exactly the ones a causal prefill computes.

    model = build_block_causal_model(settings, tokenizer)   # the block_causal ModeSpec's builder
    has_causal_prompt(model), has_causal_blocks(model)      # what the recipe set
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .logit_shift import build_mdlm_model
from .wrappers import unwrap

CAUSAL_PROMPT_ATTR = "dllm_causal_prompt"
CAUSAL_BLOCKS_ATTR = "dllm_causal_blocks"


def build_block_causal_model(settings: Any, tokenizer: Any) -> nn.Module:
    """The configured model with the logit shift (`dllm.logit_shift`) and the causal flags set."""
    model = build_mdlm_model(settings, tokenizer)
    if settings.dllm.causal_prompt:
        apply_causal_prompt(model)
    if settings.dllm.block_attention == "causal":
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
