"""Bidirectional attention for a standard Hugging Face decoder (Qwen3, Llama) through a 4D mask.

Masked-diffusion models read the whole sequence at once. A causal decoder becomes bidirectional when
it is handed an explicit float additive mask `[B, 1, L, L]` (0 = attend, finfo.min = blocked), which
transformers passes through as-is; a bool mask is silently wrong under `eager`, so we never use one.
Natively bidirectional remote-code families (LLaDA, LLaDA-MoE, LLaDA2) expect a 2D mask or none:
they get none, as in the reference recipe (docs/strategies.md §2.1), so padding stays visible to them.

    from dllmflow.models.attention import forward_bidirectional
    logits = forward_bidirectional(model, noisy_ids, attention_mask)   # [B, L, V]
    logits = forward_bidirectional(model, canvas, attention_mask, logits_to_keep=128)  # [B, 128, V]
    logits = forward_bidirectional(model, noisy_ids, attention_mask, logits_to_keep=cols)  # [B, n, V]

`logits_to_keep` follows Hugging Face: an int n keeps the last n positions, a 1-D LongTensor of
positions keeps exactly those, in that order (the LM head then runs on them alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .logit_shift import is_logit_shifted, shift_right_keep_first
from .wrappers import unwrap

# HF's `logits_to_keep`: the last n positions (0 = all), or a 1-D LongTensor of positions.
Keep = int | Tensor

# `config.model_type` of families whose attention is already bidirectional (HF remote code).
NATIVELY_BIDIRECTIONAL = frozenset({"llada", "lladamoe", "llada2_moe"})


def bidirectional_mask(
    attention_mask: Tensor | None,
    dtype: torch.dtype,
    batch: int | None = None,
    length: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Every query sees every non-padding key: a float additive [B, 1, L, L] mask.

    `attention_mask` [B, L] (1 = real token, 0 = padding) or None (nothing padded; then `batch` and
    `length` give the shape). Each query also keeps its own diagonal, so a padded query row is never
    fully blocked (a fully blocked row gives NaN in softmax).
    """
    if attention_mask is None:
        if batch is None or length is None:
            raise ValueError("bidirectional_mask: pass attention_mask or both batch and length")
        return torch.zeros(batch, 1, length, length, dtype=dtype, device=device)
    B, L = attention_mask.shape
    key_ok = attention_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, L]
    eye = torch.eye(L, dtype=torch.bool, device=attention_mask.device)[None, None]  # [1, 1, L, L]
    allowed = key_ok | eye  # [B, 1, L, L]
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, blocked)


def mask_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype when autocast is on, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def forward_bidirectional(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    logits_to_keep: Keep = 0,
    position_ids: Tensor | None = None,
) -> Tensor:
    """Logits [B, L, V] of `model` over `input_ids` [B, L] with bidirectional attention that ignores
    padding keys (`attention_mask` [B, L], None = no padding); with `logits_to_keep` = n > 0, those of
    the last n positions only, [B, n, V]; with a LongTensor of n positions, those (see `model_logits`).
    `position_ids` [B, L] (None: the model's own 0..L-1): `row_positions` reads a left-padded row as
    it would read alone. The natively bidirectional families take neither mask nor positions."""
    config = getattr(unwrap(model), "config", None)
    if getattr(config, "model_type", None) in NATIVELY_BIDIRECTIONAL:
        return model_logits(model, logits_to_keep, input_ids=input_ids)
    B, L = input_ids.shape
    mask = bidirectional_mask(
        attention_mask, mask_dtype(model, input_ids.device), batch=B, length=L, device=input_ids.device
    )
    positions = {} if position_ids is None else {"position_ids": position_ids}
    return model_logits(
        model, logits_to_keep, input_ids=input_ids, attention_mask=mask, **positions, use_cache=False
    )


def row_positions(attention_mask: Tensor) -> Tensor:
    """Position ids [B, L] that restart at each row's first real token (`attention_mask` [B, L], 1 =
    real), so a left-padded row is read as it would be alone; padding before it gets 0."""
    return (attention_mask.cumsum(dim=1) - 1).clamp_min(0)


def model_logits(model: nn.Module, logits_to_keep: Keep = 0, **inputs) -> Tensor:
    """`model(**inputs).logits`, or with `logits_to_keep` = n > 0 only the last n positions' [B, n, V],
    or with a 1-D LongTensor of positions [n] only theirs, [B, n, V] in that order. A model whose forward
    takes HF's `logits_to_keep` runs its LM head on those positions alone (the head is a large share of
    a step at a real vocabulary, and [B, L, V] the largest tensor); any other (remote code) is sliced
    after its full forward."""
    if is_logit_shifted(model):
        return _shifted_logits(model, logits_to_keep, inputs)
    return _raw_logits(model, logits_to_keep, inputs)


def _shifted_logits(model: nn.Module, logits_to_keep: Keep, inputs: dict) -> Tensor:
    """`model_logits` of a `dllm.logit_shift` model (models/logit_shift.py): the last n positions need
    n + 1 raw logits, the first of them read by the position after it; chosen positions p read raw
    position p - 1 (position 0 its own, as `shift_right_keep_first`)."""
    if isinstance(logits_to_keep, Tensor):
        return _raw_logits(model, (logits_to_keep - 1).clamp_min(0), inputs)  # [B, n, V]
    length = inputs["input_ids"].shape[1] if "input_ids" in inputs else None
    if not logits_to_keep or (length is not None and logits_to_keep >= length):
        logits = shift_right_keep_first(_raw_logits(model, 0, inputs))  # [B, L, V]
        return logits[:, -logits_to_keep:] if logits_to_keep else logits
    return shift_right_keep_first(_raw_logits(model, logits_to_keep + 1, inputs))[:, 1:]  # [B, n, V]


def _raw_logits(model: nn.Module, keep: Keep, inputs: dict) -> Tensor:
    """`model(**inputs).logits`, the last `keep` positions only when keep > 0, or the positions `keep`."""
    if isinstance(keep, Tensor):
        if takes_logits_to_keep(unwrap(model).forward):
            return model(**inputs, logits_to_keep=keep).logits  # [B, n, V]
        return model(**inputs).logits[:, keep]
    if not keep:
        return model(**inputs).logits
    if takes_logits_to_keep(unwrap(model).forward):
        inputs = {**inputs, "logits_to_keep": keep}
    return model(**inputs).logits[:, -keep:]


def takes_logits_to_keep(forward: Callable) -> bool:
    """Whether `forward` takes `logits_to_keep`: an HF model's forward, the samplers' `model_forward`s;
    not remote code without it, nor a plain `forward(input_ids, attention_mask)` handed to a sampler."""
    try:
        return "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without an inspectable signature
        return False
