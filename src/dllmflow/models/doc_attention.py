"""Document-aware bidirectional attention for packed batches (docs/strategies.md §1.8).

A packed sequence holds several documents (`dllmflow.data.pack`). Each token attends to every attended
token of its own document and to nothing of the others: a block-diagonal float additive mask
`[B, 1, T, T]` through the Hugging Face model, as `dllmflow.models.attention` does for one document per
row, plus `position_ids` that restart at 0 with each document, so every document sees exactly the
keys, values and rotary frame it would see alone in a row. The dense mask runs on every backend that
takes a 4D mask (eager, sdpa; CPU and GPU); no varlen / flex-attention path is used.

    from dllmflow.models.doc_attention import forward_bidirectional_batch
    logits = forward_bidirectional_batch(model, noisy_ids, batch)   # packed or not, [B, T, V]
    logits = forward_bidirectional_batch(model, noisy_ids, batch, key_filter=allowed)  # [B, T, T] bool

`key_filter` narrows what each query sees further, within its document (mdlm's attention annealing).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dllmflow.errors import UserError

from .attention import NATIVELY_BIDIRECTIONAL, Keep, forward_bidirectional, mask_dtype, model_logits
from .wrappers import unwrap


def document_mask(
    document_ids: Tensor, attention_mask: Tensor, dtype: torch.dtype, key_filter: Tensor | None = None
) -> Tensor:
    """Float additive [B, 1, T, T] mask: query q sees key k iff both belong to the same document
    (`document_ids` [B, T], -1 = padding), k is attended (`attention_mask` [B, T]) and, when given,
    `key_filter[b, q, k]` [B, T, T] bool allows it. Each query keeps its own diagonal, so no row is
    fully blocked (a block fill or padding query sees itself)."""
    T = document_ids.shape[1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    key_ok = (attention_mask != 0) & (document_ids >= 0)  # [B, T]
    eye = torch.eye(T, dtype=torch.bool, device=document_ids.device)[None]  # [1, T, T]
    allowed = same & key_ok[:, None, :]  # [B, T, T]
    if key_filter is not None:
        allowed = allowed & key_filter
    allowed = allowed | eye
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=document_ids.device)
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, zero, blocked)[:, None]  # [B, 1, T, T]


def check_packable(model: nn.Module) -> None:
    """A natively bidirectional remote-code model takes no 4D mask: its documents could not be kept apart."""
    model_type = _model_type(model)
    if model_type in NATIVELY_BIDIRECTIONAL:
        raise UserError(
            f"dataset.packing: the {model_type} model attends through its own mask and takes no document "
            "mask, so packed rows would see each other; set dataset.packing: false"
        )


def check_key_filter(model: nn.Module, field: str) -> None:
    """The same limit for a setting that narrows attention (`field`, e.g. mdlm's annealing)."""
    model_type = _model_type(model)
    if model_type in NATIVELY_BIDIRECTIONAL:
        raise UserError(
            f"{field}: the {model_type} model attends through its own mask and takes no 4D mask, so what "
            f"each position sees cannot be limited; set {field}: 0"
        )


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(unwrap(model), "config", None), "model_type", None)


def forward_documents(
    model: nn.Module,
    input_ids: Tensor,
    document_ids: Tensor,
    position_ids: Tensor | None,
    attention_mask: Tensor,
    logits_to_keep: Keep = 0,
    key_filter: Tensor | None = None,
) -> Tensor:
    """Logits [B, T, V] of a packed batch: bidirectional within each document, per-document positions
    (None: the model's own), keys further limited by `key_filter` when given (`document_mask`);
    `logits_to_keep` as `models.attention.model_logits`."""
    check_packable(model)
    mask = document_mask(document_ids, attention_mask, mask_dtype(model, input_ids.device), key_filter)
    return model_logits(
        model, logits_to_keep, input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
        use_cache=False,
    )  # fmt: skip


def forward_bidirectional_batch(
    model: nn.Module,
    input_ids: Tensor,
    batch: dict[str, Tensor],
    logits_to_keep: Keep = 0,
    key_filter: Tensor | None = None,
) -> Tensor:
    """`forward_documents` for a packed batch (it carries `document_ids`) or a `key_filter` [B, T, T]
    bool that limits which keys each query sees (mdlm's attention annealing: an unpacked row is then one
    document), else `forward_bidirectional` with the batch's padding mask; `input_ids` [B, T] is what
    the model reads (e.g. the noisy ids). A key filter needs a model that takes a 4D mask: the caller
    checks that once (`check_key_filter`, at the strategy's setup)."""
    if key_filter is None and "document_ids" not in batch:
        return forward_bidirectional(model, input_ids, batch.get("attention_mask"), logits_to_keep)
    ones = torch.ones_like(input_ids)  # [B, T]: one document, nothing padded
    return forward_documents(
        model, input_ids, batch.get("document_ids", torch.zeros_like(input_ids)), batch.get("position_ids"),
        batch.get("attention_mask", ones), logits_to_keep, key_filter,
    )  # fmt: skip
