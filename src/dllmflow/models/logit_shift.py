"""Dream-style logit shift for converting a causal LM into an `mdlm` dLLM (docs/strategies.md §2.1).

A pretrained causal LM reads token i+1 off position i's hidden state. With `dllm.logit_shift: true` the
converted model keeps that alignment: the logit for canvas position i is read from position i-1 (Dream,
DiffuLLaMA), so fine-tuning only has to teach bidirectional attention and [MASK] inputs, not a new head
alignment. The flag is recorded in the model's config (`dllm_logit_shift`, saved in config.json), and
`models.attention.model_logits`, the one place bidirectional logits are read (training loss, the llada
sampler, GRPO's estimators), shifts them for such a model; callers see "logit i predicts token i" as for
any other model. Fast-dLLM's caches and llada2's block-causal sources (diffusion/samplers/kv.py, llada2.py)
start their spans one position early.

    model = build_mdlm_model(settings, tokenizer)      # the mdlm ModeSpec's builder
    is_logit_shifted(model)                            # True when the recipe set dllm.logit_shift
    shift_right_keep_first(raw)                        # [B, L, V]: out[:, i] = raw[:, i-1], out[:, 0] = raw[:, 0]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .wrappers import unwrap

SHIFT_ATTR = "dllm_logit_shift"


def build_mdlm_model(settings: Any, tokenizer: Any) -> nn.Module:
    """The configured model, flagged for the logit shift when `dllm.logit_shift` is set."""
    from .build import build_model

    model = build_model(settings, tokenizer)
    return apply_logit_shift(model) if getattr(settings.dllm, "logit_shift", False) else model


def apply_logit_shift(model: nn.Module) -> nn.Module:
    """Flag `model` (its config, so exports carry it) to have its logits read one position earlier."""
    setattr(model.config, SHIFT_ATTR, True)
    return model


def is_logit_shifted(model: nn.Module) -> bool:
    return bool(getattr(getattr(unwrap(model), "config", None), SHIFT_ATTR, False))


def shift_right_keep_first(logits: Tensor) -> Tensor:
    """[B, L, V] -> [B, L, V] with position i holding position i-1's logits. Position 0 has no
    predecessor and keeps its own: it is always a prompt token (or padding), never predicted."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
