"""DFlash anchor blocks as plain functions (docs/strategies.md §2.5): anchor sampling, block inputs, positions.

Anchors are seeded per sample (never the global RNG); a block is its clean anchor token then bs-1 mask
ids, and the draft predicts the bs-1 tokens after the anchor.

    anchors, keep = sample_anchor_blocks(attention_mask, loss_mask, bs, N, overlap, gens)  # [B, N] x2
    block_ids, targets, tmask = build_block_inputs(ids, attn, loss_mask, anchors, keep, bs, mask_id)
    pos = block_position_ids(anchors, ctx_len, bs)                                   # [B, S + N·bs]

Both samplers use the draws of docs/strategies.md §2.5 from the sample's own generator; the non-overlap one runs
per sample (its own valid length, not the batch minimum) and cannot come up short (docs/strategies.md §7 caveat 3).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sample_anchors_overlap(valid_len: int, num_blocks: int, block_size: int, gen: torch.Generator) -> Tensor:
    """N independent anchors a = 1 + round(U (M-1)), U ~ U[0,1), M = max(valid-bs, 1) (docs/strategies.md §2.5), so
    a is in [1, M] with the two ends at half the weight of the inner values. They may repeat, overlap,
    land in the prompt (those targets are masked out later), and N may exceed L/bs. [N] long"""
    max_anchor = max(valid_len - block_size, 1)
    u = torch.rand(num_blocks, generator=gen)  # [N] float32, as the documented rand
    a = 1 + torch.round(u * (max_anchor - 1)).long()  # round half to even (torch.round)
    return a.clamp(1, max_anchor)


def sample_anchors_disjoint(
    valid_len: int, num_blocks: int, block_size: int, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Up to N non-overlapping blocks inside [1, valid), the legacy draw of docs/strategies.md §2.5:
    n = min(N, max(1, (valid-1)//bs)), avail = valid - n·bs, start_i = sort(randperm(avail)[:n])_i
    + i·bs + 1 (so consecutive blocks are at least one token apart). Where that draw would come up
    short (1 <= avail < n, the reference's shape error, docs/strategies.md §7 caveat 3) blocks may touch: stars and
    bars, n distinct sorted c_i from [0, avail - 1 + n), start_i = 1 + (c_i - i) + i·bs, uniform over
    the placements. Pads to N by repeating the last start; returns (anchors [N] long, n_valid)."""
    n_valid = min(num_blocks, max(1, (valid_len - 1) // block_size))
    avail = valid_len - n_valid * block_size
    i = torch.arange(n_valid)
    if avail < 1:  # the sample is shorter than one block: keep=False drops it anyway
        starts = 1 + i * block_size
    elif avail >= n_valid:
        starts = torch.randperm(avail, generator=gen)[:n_valid].sort().values + i * block_size + 1
    else:
        c = torch.randperm(avail - 1 + n_valid, generator=gen)[:n_valid].sort().values
        starts = 1 + (c - i) + i * block_size
    pad = starts[-1:].expand(num_blocks - n_valid)
    return torch.cat([starts, pad]), n_valid


def sample_anchor_blocks(
    attention_mask: Tensor, loss_mask: Tensor, block_size: int, num_blocks: int, overlap: bool, gens: list
) -> tuple[Tensor, Tensor]:
    """Anchors [B, N] long and keep [B, N] bool. keep = enough supervision (>= 2·bs tokens), a
    sequence longer than one block, and (non-overlap) a real, not padded, block."""
    effective = attention_mask * loss_mask  # [B, L]
    valid = attention_mask.sum(1).long().tolist()
    sup = effective.sum(1).tolist()
    anchors, keep = [], []
    for b, gen in enumerate(gens):
        if overlap:
            a, n_valid = sample_anchors_overlap(valid[b], num_blocks, block_size, gen), num_blocks
        else:
            a, n_valid = sample_anchors_disjoint(valid[b], num_blocks, block_size, gen)
        ok = sup[b] >= 2 * block_size and valid[b] > block_size
        anchors.append(a)
        keep.append(torch.arange(num_blocks) < (n_valid if ok else 0))
    return torch.stack(anchors).to(attention_mask.device), torch.stack(keep).to(attention_mask.device)


def build_block_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    mask_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Block token ids [B, N·bs] (clean anchor, then mask ids; a dropped block is all mask), targets
    x[a+k] [B, N·(bs-1)] and their mask effective[a+k]·1[a+k < valid]·keep [B, N·(bs-1)] float."""
    bsz, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    flat = pos.clamp(max=seq_len - 1).reshape(bsz, -1)  # [B, N·bs]
    tokens = input_ids.gather(1, flat).view(bsz, num_blocks, block_size)  # [B, N, bs]
    block_ids = torch.full_like(tokens, mask_id)
    block_ids[:, :, 0] = torch.where(keep, tokens[:, :, 0], torch.full_like(tokens[:, :, 0], mask_id))
    effective = (attention_mask * loss_mask).float().gather(1, flat).view(bsz, num_blocks, block_size)
    valid = attention_mask.sum(1)[:, None, None]  # [B, 1, 1]
    tmask = effective[:, :, 1:] * (pos[:, :, 1:] < valid).float() * keep[:, :, None].float()  # [B, N, bs-1]
    return block_ids.view(bsz, -1), tokens[:, :, 1:].reshape(bsz, -1), tmask.reshape(bsz, -1)


def block_position_ids(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """[0..S-1] ++ [a_n + 0..bs-1 for each n]: [B, S + N·bs]."""
    bsz = anchors.shape[0]
    ctx = torch.arange(ctx_len, device=anchors.device).expand(bsz, ctx_len)
    blocks = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(bsz, -1)
    return torch.cat([ctx, blocks], dim=1)


__all__ = [
    "block_position_ids",
    "build_block_inputs",
    "sample_anchor_blocks",
    "sample_anchors_disjoint",
    "sample_anchors_overlap",
]
