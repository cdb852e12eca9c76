"""Give any Hugging Face decoder the Nemotron-Labs-Diffusion training interface (docs/strategies.md §2.3).

The hybrid strategy calls `model(input_ids=<clean x>, masked_indices=<noise mask>, ...)` and reads
`out.logits` (diffusion) and `out.causal_logits` (AR). A real Nemotron-Labs-Diffusion checkpoint
(remote code, `dlm_paradigm: block_diff`) has that forward and is used as is; for every other
causal LM, `HybridAdapter` runs it twice on shared weights:

    diffusion: input x with [MASK] at masked_indices, bidirectional attention   -> logits
    AR:        the clean input x, causal attention                               -> causal_logits

    from dllmflow.models.hybrid_adapter import apply_hybrid_adapter
    model = apply_hybrid_adapter(model, mask_token_id=M)   # unchanged if it accepts masked_indices

The adapter owns no weights of its own: it saves and exports as the plain inner model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers.utils import ModelOutput

from dllmflow.errors import UserError
from dllmflow.models.attention import forward_bidirectional

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllmflow.settings import Settings


@dataclass
class HybridOutput(ModelOutput):
    logits: Tensor | None = None  # [B, L, V] diffusion logits (masked input, bidirectional)
    causal_logits: Tensor | None = None  # [B, L, V] AR logits (clean input, causal)


class HybridAdapter(nn.Module):
    """Wraps a causal LM; unknown attributes (config, save_pretrained, ...) fall through to it."""

    def __init__(self, model: nn.Module, mask_token_id: int):
        super().__init__()
        self.model = model
        self.mask_token_id = int(mask_token_id)

    def forward(
        self, input_ids: Tensor, masked_indices: Tensor, attention_mask: Tensor | None = None
    ) -> HybridOutput:
        noisy = torch.where(
            masked_indices, torch.full_like(input_ids, self.mask_token_id), input_ids
        )  # [B, L]
        diffusion = forward_bidirectional(self.model, noisy, attention_mask)  # [B, L, V]
        causal = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).logits  # [B, L, V]
        return HybridOutput(logits=diffusion, causal_logits=causal)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def save_pretrained(self, out_dir, state_dict: dict[str, Tensor] | None = None, **kwargs) -> None:
        """Save as the plain inner model (a state dict of the adapter loses its `model.` prefix)."""
        if state_dict is not None:
            state_dict = inner_state_dict(state_dict)
        self.model.save_pretrained(out_dir, state_dict=state_dict, **kwargs)


def accepts_masked_indices(model: nn.Module) -> bool:
    """A native hybrid model names `masked_indices` in its forward (a bare **kwargs does not count)."""
    return "masked_indices" in inspect.signature(model.forward).parameters


def apply_hybrid_adapter(model: nn.Module, mask_token_id: int | None) -> nn.Module:
    """`model` as is when it speaks the hybrid interface, else wrapped in `HybridAdapter`."""
    if isinstance(model, HybridAdapter) or accepts_masked_indices(model):
        return model
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is None or get_head() is None:
        raise UserError(
            f"dllm.mode=hybrid: {name} neither accepts `masked_indices` nor has a language-model head, so it "
            "cannot produce causal logits; use a causal LM (AutoModelForCausalLM) or a Nemotron-Labs-Diffusion model"
        )
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "flash_attention_2":
        raise UserError(
            "dllm.mode=hybrid: the adapter needs a bidirectional 4D mask, which flash_attention_2 ignores; "
            "set model.attn_implementation to sdpa or eager"
        )
    if mask_token_id is None:
        raise UserError("dllm.mode=hybrid: set dllm.mask_token_id or give the tokenizer a mask token")
    return HybridAdapter(model, mask_token_id)


def build_hybrid_model(settings: Settings, tokenizer: PreTrainedTokenizerBase) -> nn.Module:
    """The configured model (`models.build.build_model`) with the hybrid interface; the adapter's mask
    id is `dllm.mask_token_id`, else the tokenizer's (the hybrid mode's `ModeSpec.model_builder`)."""
    from dllmflow.models.build import build_model
    from dllmflow.models.mask_id import find_mask_id

    mask_id = find_mask_id(settings.dllm.mask_token_id, tokenizer=tokenizer)
    return apply_hybrid_adapter(build_model(settings, tokenizer), mask_id)


def inner_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adapter keys (`model.<inner key>`) -> the inner model's keys; other keys pass unchanged."""
    return {k.removeprefix("model."): v for k, v in state_dict.items()}
