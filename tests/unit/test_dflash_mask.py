"""DFlash anchor-block mask: dense vs an element-wise reference, no empty rows, one slot per anchor,
flex == sdpa, and the leakage invariant through the whole strategy (N=1 and N>1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dflash_common import make_batch, make_strategy

from dllmflow.diffusion.dflash_blocks import build_block_inputs
from dllmflow.diffusion.masks.dflash import dflash_block_mask, dflash_dense_mask


def reference_allowed(anchors, keep, ctx_len, bs):
    """Element-wise loops straight from the rule: ctx kv < a_n iff keep_n; own block; nothing else."""
    bsz, n_blocks = anchors.shape
    out = torch.zeros(bsz, n_blocks * bs, ctx_len + n_blocks * bs, dtype=torch.bool)
    for b in range(bsz):
        for q in range(n_blocks * bs):
            n = q // bs
            for kv in range(ctx_len + n_blocks * bs):
                if kv < ctx_len:
                    out[b, q, kv] = bool(keep[b, n]) and kv < int(anchors[b, n])
                else:
                    out[b, q, kv] = (kv - ctx_len) // bs == n
    return out


@pytest.mark.parametrize("n_blocks", [1, 3])
def test_dense_mask_matches_reference(n_blocks):
    g = torch.Generator().manual_seed(n_blocks)
    anchors = torch.randint(1, 9, (2, n_blocks), generator=g)
    keep = torch.rand(2, n_blocks, generator=g) > 0.3
    mask = dflash_dense_mask(anchors, keep, ctx_len=12, block_size=4, dtype=torch.float32)
    assert mask.shape == (2, 1, n_blocks * 4, 12 + n_blocks * 4)
    ref = reference_allowed(anchors, keep, 12, 4)
    assert torch.equal(mask[:, 0] == 0, ref)
    assert torch.all(mask[:, 0][~ref] == torch.finfo(torch.float32).min)


def test_padded_block_keeps_in_block_attention_and_no_nan_rows():
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, False]])
    mask = dflash_dense_mask(anchors, keep, ctx_len=8, block_size=4, dtype=torch.float32)
    allowed = mask[0, 0] == 0  # [8, 16]
    assert not allowed[4:, :8].any()  # the padded block sees no context ...
    assert allowed[4:, 12:16].all()  # ... but its own block
    assert allowed.any(-1).all()
    q, k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()


def test_overlapping_anchors_each_get_their_own_slot():
    anchors = torch.tensor([[3, 3, 4]])  # identical and overlapping blocks
    keep = torch.ones(1, 3, dtype=torch.bool)
    allowed = dflash_dense_mask(anchors, keep, ctx_len=10, block_size=4, dtype=torch.float32)[0, 0] == 0
    for n in range(3):
        rows = allowed[4 * n : 4 * n + 4]
        assert torch.equal(rows[:, :10], (torch.arange(10) < anchors[0, n]).expand(4, 10))
        own = torch.zeros(12, dtype=torch.bool)
        own[4 * n : 4 * n + 4] = True
        assert torch.equal(rows[:, 10:], own.expand(4, 12))


def test_flex_block_mask_matches_dense_sdpa():
    from torch.nn.attention.flex_attention import flex_attention

    anchors, keep = (
        torch.tensor([[3, 3, 9], [1, 5, 2]]),
        torch.tensor([[True, True, True], [True, False, True]]),
    )
    bm = dflash_block_mask(anchors, keep, ctx_len=12, block_size=4, compile=False)
    dense = dflash_dense_mask(anchors, keep, ctx_len=12, block_size=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (12, 24, 24))
    torch.testing.assert_close(
        flex_attention(q, k, v, block_mask=bm), F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    )


# ---- leakage through the whole strategy --------------------------------------------------------------


def _block_logits(strategy, draft, batch, anchors, use_mask=True):
    """Per-block draft logits [B, N, bs-1, V] with explicit anchors (all kept)."""
    keep = torch.ones_like(anchors, dtype=torch.bool)
    block_ids, targets, tmask = build_block_inputs(
        batch["input_ids"],
        batch["attention_mask"],
        batch["loss_mask"],
        anchors,
        keep,
        strategy.block_size,
        strategy.mask_token_id,
    )
    b = dict(
        batch,
        dflash_anchors=anchors,
        dflash_keep=keep,
        dflash_block_ids=block_ids,
        dflash_targets=targets,
        dflash_target_mask=tmask,
    )
    loss = strategy.loss(draft, b).sums["diffusion"]
    h = strategy.target_features(b)
    bs, (bsz, seq_len) = strategy.block_size, batch["input_ids"].shape
    from dllmflow.diffusion.dflash_blocks import block_position_ids

    noise = strategy.target_embed(block_ids.clamp(max=strategy.target_embed.weight.shape[0] - 1))
    mask = dflash_dense_mask(anchors, keep, seq_len, bs, torch.float32) if use_mask else None
    hidden = draft(
        target_hidden=h,
        noise_embedding=noise,
        position_ids=block_position_ids(anchors, seq_len, bs),
        attention_mask=mask,
    )
    logits = strategy.target_head(hidden.view(bsz, -1, bs, hidden.shape[-1])[:, :, 1:])
    return loss, logits


@pytest.mark.parametrize("anchors", [[[6], [9]], [[6, 6, 11], [9, 5, 7]]], ids=["N=1", "N=3"])
def test_tokens_after_the_anchor_do_not_leak(tmp_path_factory, anchors):
    strategy, draft = make_strategy(tmp_path_factory.mktemp("target"), block_size=4)
    anchors = torch.tensor(anchors)
    batch = make_batch(bsz=2, seq_len=24, seed=1)
    batch["attention_mask"][:] = 1
    loss, logits = _block_logits(strategy, draft, batch, anchors)
    # Changing every token after the last block leaves the loss unchanged (targets untouched).
    after = dict(batch, input_ids=batch["input_ids"].clone())
    end = int((anchors + strategy.block_size).max())
    after["input_ids"][:, end:] = (after["input_ids"][:, end:] + 7) % 60
    loss2, _ = _block_logits(strategy, draft, after, anchors)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    # Changing any token after block n's anchor leaves block n's predictions unchanged.
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            changed = dict(batch, input_ids=batch["input_ids"].clone())
            changed["input_ids"][b, a + 1 :] = (changed["input_ids"][b, a + 1 :] + 13) % 60
            _, logits2 = _block_logits(strategy, draft, changed, anchors)
            torch.testing.assert_close(logits2[b, n], logits[b, n], rtol=0, atol=1e-6)


def test_without_the_mask_the_leakage_check_fails(tmp_path_factory):
    """The check above can fail: drop the mask (the reference code's N=1 sdpa path) and it does."""
    strategy, draft = make_strategy(tmp_path_factory.mktemp("target"), block_size=4)
    anchors = torch.tensor([[6], [9]])
    batch = make_batch(bsz=2, seq_len=24, seed=1)
    batch["attention_mask"][:] = 1
    _, logits = _block_logits(strategy, draft, batch, anchors, use_mask=False)
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][:, 12:] = (changed["input_ids"][:, 12:] + 13) % 60
    _, logits2 = _block_logits(strategy, draft, changed, anchors, use_mask=False)
    assert (logits2 - logits).abs().max() > 1e-4
