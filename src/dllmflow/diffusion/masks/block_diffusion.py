"""DiffusionGemma block-diffusion training masks (docs/strategies.md §2.4 step 6) and the encoder's causal masks.

The decoder's key axis is `[encoder (S) ; canvas (R)]`: the KV cache of a causal pass over the clean
sequence, then the canvas itself. The canvas is the response window, canvas position j holding
absolute position `prefix + j`. A canvas query j in block `q = j // bs` may attend:

    encoder column e  iff  blk(e) < q  (strictly)   where blk(e) = (e - prefix) // bs if e >= prefix else -1
                      and  e - prefix < R_b         (tail padding is never visible)
                      and  attention_mask[e]
                      [sliding layers also: e >= prefix + q*bs - sw + 1, anchored at the block start]
    canvas column k   iff  k // bs == q  and  k < R_b   (block-diagonal, valid keys only)
    its own diagonal  always (a padded row is never all-masked)

The strict `<` is the leakage invariant: the clean encoder copy of block q (and of later blocks) is
invisible to block q, so the decoder cannot copy the tokens it must denoise. At generation time the
canvas for block q sits right after the encoder prefix `[0, prefix + q*bs)`, which is exactly what
this mask reproduces for every block at once.

    from dllmflow.diffusion.masks.block_diffusion import build_decoder_masks, build_encoder_masks
    dec = build_decoder_masks(prefix, resp_len, attention_mask, R, bs, sliding_window=sw, dtype=torch.float32)
    enc = build_encoder_masks(attention_mask, sliding_window=sw, dtype=torch.float32)
    # -> {"full_attention": [B,1,R,S+R], "sliding_attention": [B,1,R,S+R]} additive (0 / finfo.min)

Masks are float additive (0 keep, finfo(dtype).min drop): bool masks are misread by eager attention,
and finfo.min (not -inf) keeps a fully masked row finite.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def split_prompt_response(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(prefix_lengths [B], response_mask [B, L]): prefix = first supervised index, or L if none."""
    B, L = loss_mask.shape
    sup = loss_mask != 0  # [B, L]
    first = torch.argmax(sup.to(torch.int8), dim=1)  # [B]; 0 when the row has no supervised token
    prefix = torch.where(sup.any(dim=1), first, torch.full_like(first, L))  # [B]
    pos = torch.arange(L, device=loss_mask.device)
    return prefix, pos[None, :] >= prefix[:, None]


def block_diffusion_visibility(
    prefix_lengths: Tensor,
    response_lengths: Tensor,
    attention_mask: Tensor,
    canvas_length: int,
    block_size: int,
    sliding_window: int | None = None,
) -> Tensor:
    """Bool [B, R, S+R]: may canvas query j attend key column c (encoder e = c < S, canvas k = c - S)?

    prefix_lengths [B] (first supervised index), response_lengths [B] (R_b = eff_len - prefix, >= 0),
    attention_mask [B, S] (1 = real encoder token). `sliding_window` adds the block-anchored window.
    """
    B, S = attention_mask.shape
    R, bs, dev = int(canvas_length), int(block_size), attention_mask.device
    prefix = prefix_lengths.to(dev).long()[:, None, None]  # [B, 1, 1]
    resp = response_lengths.to(dev).long().clamp(min=0)[:, None, None]  # [B, 1, 1]
    j = torch.arange(R, device=dev)
    q = (j // bs)[None, :, None]  # [1, R, 1] query block

    # 1) encoder columns: strictly earlier response blocks (the prompt is block -1), no tail padding
    e = torch.arange(S, device=dev)[None, None, :]  # [1, 1, S]
    rel = e - prefix  # [B, 1, S]
    blk = torch.where(rel >= 0, torch.div(rel, bs, rounding_mode="floor"), torch.full_like(rel, -1))
    enc = (blk < q) & (rel < resp) & (attention_mask != 0)[:, None, :]  # [B, R, S]
    if sliding_window is not None:
        enc = enc & (e >= prefix + q * bs - int(sliding_window) + 1)

    # 2) canvas columns: own block only, valid keys only; 3) every row keeps its diagonal
    k = torch.arange(R, device=dev)[None, None, :]  # [1, 1, R]
    can = ((k // bs) == q) & (k < resp)  # [B, R, R]
    can = can | (k == j[None, :, None])
    return torch.cat([enc, can.expand(B, R, R)], dim=-1)  # [B, R, S+R]


def encoder_visibility(attention_mask: Tensor, sliding_window: int | None = None) -> Tensor:
    """Bool [B, S, S] of the encoder's causal pass: key e <= query i, real keys only, optionally
    `i - e < sliding_window` (Hugging Face's sliding semantics). Each row keeps its diagonal."""
    B, S = attention_mask.shape
    dev = attention_mask.device
    i = torch.arange(S, device=dev)[:, None]  # [S, 1]
    e = torch.arange(S, device=dev)[None, :]  # [1, S]
    keep = e <= i
    if sliding_window is not None:
        keep = keep & (i - e < int(sliding_window))
    return (keep[None] & (attention_mask != 0)[:, None, :]) | (e == i)[None]  # [B, S, S]


def to_additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool [B, Q, K] -> additive float [B, 1, Q, K]: 0 where visible, finfo(dtype).min elsewhere."""
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def build_block_diffusion_mask(*visibility_args: Any, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive [B, 1, R, S+R] decoder mask (full attention, or the sliding variant when given): the
    arguments of `block_diffusion_visibility`, as an additive mask of `dtype`."""
    return to_additive(block_diffusion_visibility(*visibility_args), dtype)


def build_decoder_masks(
    prefix_lengths: Tensor,
    response_lengths: Tensor,
    attention_mask: Tensor,
    canvas_length: int,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """The per-layer-type mapping the DiffusionGemma decoder takes as `decoder_attention_mask`."""
    args = (prefix_lengths, response_lengths, attention_mask, canvas_length, block_size)
    return {
        "full_attention": build_block_diffusion_mask(*args, None, dtype=dtype),
        "sliding_attention": build_block_diffusion_mask(*args, sliding_window, dtype=dtype),
    }


def build_encoder_masks(
    attention_mask: Tensor, sliding_window: int | None, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The per-layer-type causal masks of the encoder pass over the clean sequence ([B, 1, S, S])."""
    return {
        "full_attention": to_additive(encoder_visibility(attention_mask), dtype),
        "sliding_attention": to_additive(encoder_visibility(attention_mask, sliding_window), dtype),
    }
