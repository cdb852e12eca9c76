"""Split attention over a doubled sequence `[first half | second half]` (2L tokens) for HF decoders.

I-DLM feeds `[x_t | x_0]` and its 2L x 2L mask is mostly empty: the second half (x_0) only attends
causally to itself, and a first-half query only needs keys near it. One dense additive mask makes
SDPA score all 4L^2 pairs; this attention function computes the two halves apart instead:

    second half   queries [L, 2L) over keys [L, 2L), `is_causal=True`, no mask tensor -> fast causal kernel
    first half    block form (`block_length`, CPU): `block_shifted_attention` -- a first-half query sees
                  first-half keys of its own block up to itself and second-half keys before its block:
                  one causal SDPA shifted by the block length + b window scores per query, no mask
                  (short halves, L <= MASKED_MAX_LEN: one SDPA over all 2L keys under that pattern's mask)
    first half    chunk form (`chunks`): per query chunk [a, e), keys first[a:e] ++ second[0:e] under the
                  chunk's additive mask (a first-half query sees no second-half key at or after its own
                  chunk, and no first-half key before the chunk: the caller's masks guarantee it)

so the work is ~L^2/2 (causal) + ~L^2/2 (first half) instead of 4L^2; the block form runs both on the
causal kernel. With one chunk (a=0, e=L) the first half is SDPA over the full 2L keys with the first L
rows of the dense mask.

It is registered as the transformers attention implementation `SPLIT_ATTENTION`; a forward that
passes `split_attention=SplitAttention(...)` gets the split, any other call is plain `sdpa`:

    from dllmflow.models.split_attention import SplitAttention, use_split_attention
    use_split_attention(model)                              # config._attn_implementation = SPLIT_ATTENTION
    model(input_ids=ids_2l, position_ids=pos, split_attention=SplitAttention(L, block_length=2))

No mask function is registered with it, so transformers builds no (2L x 2L) mask for these calls;
other callers must pass 4D masks, as every dllmflow caller does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .shifted_attention import SHIFTED_DEVICES, block_shifted_attention, block_shifted_mask
from .wrappers import unwrap

SPLIT_ATTENTION = "dllmflow_split"
# Up to this half length the block form runs as one masked SDPA over all 2L keys: at such L the
# block-shifted kernel's fixed cost (a few dozen small CPU ops per layer) exceeds the 2L^2 scores
# (measured: masked 2.2 ms vs 3.5 ms per layer at L=128, even at 256, block-shifted ahead from 512).
MASKED_MAX_LEN = 256


@dataclass(frozen=True)
class SplitAttention:
    """What one forward's split needs: the half length and the first half's pattern, in one of two forms.

    `block_length`: the block form (see `block_shifted_attention`); without dropout on `SHIFTED_DEVICES`
    and for L > `MASKED_MAX_LEN` it runs mask-free, else through the same pattern as one [L, 2L] mask
    (`block_shifted_mask`).
    `chunks`: (a, e, mask) with mask an additive [B, 1, e-a, (e-a)+e] over keys first[a:e] ++ second[0:e].
    Both assume that no real query needs padding masked (right padding). The second half is plainly
    causal (callers make sure no real query there needs more masking).
    """

    seq_len: int
    chunks: tuple[tuple[int, int, Tensor], ...] = ()
    block_length: int | None = None


def split_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    split_attention: SplitAttention | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The transformers attention-function signature: q [B, H, 2L, D], k/v [B, Hkv, 2L, D] -> [B, 2L, H, D]."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if split_attention is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    groups = getattr(module, "num_key_value_groups", 1)
    sdpa_kwargs = {"dropout_p": dropout, "scale": scaling}
    if groups > 1 and query.device.type == "cpu":
        sdpa_kwargs["enable_gqa"] = True  # the CPU kernels take GQA with or without a mask: no copies
    else:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, 2L, D]
    L = split_attention.seq_len
    chunks = split_attention.chunks
    # Halves and chunks are `split` views (backward: one cat), never slices (backward: a zero-filled
    # full-size gradient per slice, which would cost more than the attention the split saves).
    q_first, q_second = query.split(L, dim=2)  # [B, H, L, D] each
    k_first, k_second = key.split(L, dim=2)
    v_first, v_second = value.split(L, dim=2)
    if split_attention.block_length is not None:
        b = split_attention.block_length
        if query.device.type in SHIFTED_DEVICES and dropout == 0.0 and L > MASKED_MAX_LEN:
            parts = [block_shifted_attention(q_first, k_first, v_first, k_second, v_second, b, scaling)]
        else:  # the same pattern through one mask: short halves, dropout, or a device without the kernel
            mask = block_shifted_mask(L, b, query.dtype, query.device)  # [L, 2L]
            parts = [F.scaled_dot_product_attention(q_first, key, value, attn_mask=mask, **sdpa_kwargs)]
    elif len(chunks) == 1:  # one chunk (a=0, e=L): the full key sequence, in its own order
        parts = [F.scaled_dot_product_attention(q_first, key, value, attn_mask=chunks[0][2], **sdpa_kwargs)]
    else:
        sizes = [e - a for a, e, _ in chunks]
        qs, k1s, k2s = q_first.split(sizes, dim=2), k_first.split(sizes, dim=2), k_second.split(sizes, dim=2)
        v1s, v2s = v_first.split(sizes, dim=2), v_second.split(sizes, dim=2)
        parts = []
        for j, (_, _, mask) in enumerate(chunks):
            k = torch.cat([k1s[j], *k2s[: j + 1]], dim=2)  # first[a:e] ++ second[0:e]: [B, H, (e-a)+e, D]
            v = torch.cat([v1s[j], *v2s[: j + 1]], dim=2)
            parts.append(F.scaled_dot_product_attention(qs[j], k, v, attn_mask=mask, **sdpa_kwargs))
    parts.append(F.scaled_dot_product_attention(q_second, k_second, v_second, is_causal=True, **sdpa_kwargs))
    out = torch.cat(parts, dim=2)  # [B, H, 2L, D]
    return out.transpose(1, 2).contiguous(), None


def register_split_attention() -> str:
    """Register `SPLIT_ATTENTION` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SPLIT_ATTENTION, split_attention_forward)
    return SPLIT_ATTENTION


def use_split_attention(model: nn.Module) -> None:
    """Switch `model` (a HF decoder, possibly wrapped) to `SPLIT_ATTENTION`.

    The implementation lives in `config._attn_implementation`, which transformers does not serialise:
    exports keep the architecture's own default.
    """
    name = register_split_attention()
    inner = unwrap(model)
    setter = getattr(inner, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        inner.config._attn_implementation = name
