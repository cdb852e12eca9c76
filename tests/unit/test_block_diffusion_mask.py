"""DiffusionGemma training masks (docs/strategies.md §2.4 step 6, §5 mask tests): each invariant against a direct
element-wise reference written here with plain Python loops."""

from __future__ import annotations

import pytest
import torch

from dllmflow.diffusion.masks.block_diffusion import (
    block_diffusion_visibility,
    build_block_diffusion_mask,
    build_decoder_masks,
    build_encoder_masks,
    encoder_visibility,
    split_prompt_response,
)


def reference_visibility(prefix, resp, attn, R, bs, sw=None):
    """The documented rule (docs/strategies.md §2.4), one (b, j, column) at a time."""
    B, S = attn.shape
    out = torch.zeros(B, R, S + R, dtype=torch.bool)
    for b in range(B):
        p, rb = int(prefix[b]), int(resp[b])
        for j in range(R):
            q = j // bs
            for e in range(S):
                blk = (e - p) // bs if e >= p else -1
                ok = blk < q and e - p < rb and bool(attn[b, e])
                if sw is not None:
                    ok = ok and e >= p + q * bs - sw + 1
                out[b, j, e] = ok
            for k in range(R):
                out[b, j, S + k] = (k // bs == q and k < rb) or k == j
    return out


def case(prefixes=(3, 6), lengths=(15, 14), S=16, bs=4):
    """Right-padded rows: prompt [0, prefix), response [prefix, length), padding after."""
    B = len(prefixes)
    attn = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
    prefix = torch.tensor(prefixes)
    resp = attn.sum(1) - prefix
    R = int(resp.max())
    return prefix, resp, attn, R, bs


@pytest.mark.parametrize("sw", [None, 5, 100])
@pytest.mark.parametrize("bs", [1, 3, 4])
def test_matches_elementwise_reference(bs, sw):
    prefix, resp, attn, R, _ = case(bs=bs)
    got = block_diffusion_visibility(prefix, resp, attn, R, bs, sw)
    assert torch.equal(got, reference_visibility(prefix, resp, attn, R, bs, sw))


def test_shape_dtype_and_additive_values():
    prefix, resp, attn, R, bs = case()
    for dtype in (torch.float32, torch.bfloat16):
        m = build_block_diffusion_mask(prefix, resp, attn, R, bs, dtype=dtype)
        assert m.shape == (2, 1, R, attn.shape[1] + R) and m.dtype == dtype
        vis = block_diffusion_visibility(prefix, resp, attn, R, bs)[:, None]
        assert torch.all(m[vis] == 0)
        assert torch.all(m[~vis] == torch.finfo(dtype).min)


def test_leakage_block_i_never_sees_its_own_clean_start():
    prefix, resp, attn, R, bs = case()
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs)
    for b in range(2):
        p = int(prefix[b])
        for j in range(int(resp[b])):
            i = j // bs
            # block i is masked at encoder position prefix + i*bs and everything after it
            assert not vis[b, j, p + i * bs : attn.shape[1]].any()
            if i > 0:  # ... and sees the clean tokens of every earlier block
                assert vis[b, j, p : p + i * bs].all()


def test_strict_comparison_not_greater_equal():
    """Same-block encoder columns are exactly what `>=` would add: they must stay masked."""
    prefix, resp, attn, R, bs = case(prefixes=(4,), lengths=(16,), S=16)
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs)
    p = 4
    for j in range(R):
        q = j // bs
        same_block = range(p + q * bs, min(p + (q + 1) * bs, 16))
        assert not any(vis[0, j, e] for e in same_block)
        if q > 0:
            assert vis[0, j, p + q * bs - 1]  # the last column of the previous block is visible


def test_every_query_in_a_block_shares_encoder_visibility():
    prefix, resp, attn, R, bs = case()
    S = attn.shape[1]
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs, sliding_window=6)
    for j in range(R):
        first = (j // bs) * bs
        assert torch.equal(vis[:, j, :S], vis[:, first, :S])


def test_canvas_is_block_diagonal():
    prefix, resp, attn, R, bs = case(prefixes=(2,), lengths=(14,), S=14)
    S = attn.shape[1]
    can = block_diffusion_visibility(prefix, resp, attn, R, bs)[0, :, S:]
    blocks = torch.arange(R) // bs
    assert torch.equal(can, blocks[:, None] == blocks[None, :])


def test_prompt_visible_to_every_block_and_per_example_prefixes():
    prefix, resp, attn, R, bs = case(prefixes=(3, 6))
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs)
    for b, p in enumerate((3, 6)):
        assert vis[b, : int(resp[b]), :p].all()
    # the two rows see different encoder columns for block 0: their own prompts
    assert vis[0, 0, :3].all() and not vis[0, 0, 3:6].any()
    assert vis[1, 0, :6].all()


def test_tail_padding_never_visible():
    prefix, resp, attn, R, bs = case(prefixes=(3, 6), lengths=(9, 14))
    S = attn.shape[1]
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs)
    for b in range(2):
        end = int(attn[b].sum())
        assert not vis[b, :, end:S].any()  # encoder padding
        rb = int(resp[b])
        offdiag = vis[b, :, S + rb :].clone()
        for j in range(rb, R):  # padded canvas keys: only their own row's diagonal
            offdiag[j, j - rb] = False
        assert not offdiag.any()


def test_every_row_keeps_its_diagonal():
    prefix, resp, attn, R, bs = case(prefixes=(3, 6), lengths=(9, 14))
    S = attn.shape[1]
    vis = block_diffusion_visibility(prefix, resp, attn, R, bs, sliding_window=1)
    assert vis[:, torch.arange(R), S + torch.arange(R)].all()


def test_sliding_is_a_block_anchored_subset_of_full():
    prefix, resp, attn, R, bs = case(prefixes=(3, 6), S=16)
    S, sw = attn.shape[1], 5
    full = block_diffusion_visibility(prefix, resp, attn, R, bs)
    slid = block_diffusion_visibility(prefix, resp, attn, R, bs, sliding_window=sw)
    assert not (slid & ~full).any()
    assert torch.equal(slid[:, :, S:], full[:, :, S:])  # canvas columns are untouched
    for b in range(2):
        p = int(prefix[b])
        for j in range(int(resp[b])):
            start = p + (j // bs) * bs  # the block boundary, not the query
            expect = [e for e in range(S) if full[b, j, e] and e >= start - sw + 1]
            assert torch.nonzero(slid[b, j, :S]).flatten().tolist() == expect
    # early blocks keep the prompt when it fits the window
    assert slid[0, 0, :3].all()
    assert torch.equal(block_diffusion_visibility(prefix, resp, attn, R, bs, None), full)


def test_decoder_masks_map_layer_types():
    prefix, resp, attn, R, bs = case()
    masks = build_decoder_masks(prefix, resp, attn, R, bs, 5, torch.float32)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"], build_block_diffusion_mask(prefix, resp, attn, R, bs))
    assert torch.equal(masks["sliding_attention"], build_block_diffusion_mask(prefix, resp, attn, R, bs, 5))


def test_single_block_masks_the_whole_response_in_the_encoder():
    prefix, resp, attn, R, _ = case(prefixes=(3,), lengths=(15,))
    S = attn.shape[1]
    vis = block_diffusion_visibility(prefix, resp, attn, R, block_size=R)
    assert vis[0, :, :3].all()  # prompt visible
    assert not vis[0, :, 3:S].any()  # the whole response part of the encoder masked
    assert vis[0, :, S:].all()  # one block: the canvas sees itself


def test_split_prompt_response():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    prefix, resp = split_prompt_response(loss_mask)
    assert prefix.tolist() == [2, 5, 0]
    assert resp.tolist() == [[j >= p for j in range(5)] for p in (2, 5, 0)]


def test_encoder_masks_are_causal_sliding_and_padding_aware():
    attn = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    full = encoder_visibility(attn)[0]
    slid = encoder_visibility(attn, sliding_window=2)[0]
    for i in range(7):
        for e in range(7):
            assert bool(full[i, e]) == ((e <= i and e < 5) or e == i)
            assert bool(slid[i, e]) == ((e <= i and i - e < 2 and e < 5) or e == i)
    masks = build_encoder_masks(attn, 2, torch.float32)
    assert masks["full_attention"].shape == (1, 1, 7, 7)
    assert torch.all((masks["sliding_attention"][0, 0] == 0) == slid)
