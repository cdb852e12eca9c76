"""Corruption kernels (docs/strategies.md §2, §5 test_corruption list): invariants, seeding, channel statistics."""

from __future__ import annotations

import pytest
import torch

from dllmflow.diffusion.corruption import (
    corrupt_all_masked,
    corrupt_blockwise,
    corrupt_mix,
    corrupt_scdd,
    corrupt_uniform,
    corrupt_uniform_random,
    gumbel_topk,
    per_sample,
)

M = 99  # mask id outside the clean-token range in these tests
EPS = 1e-3


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def batch():
    g = _gen(123)
    x = torch.randint(0, 50, (6, 40), generator=g)  # [B, L]
    loss_mask = torch.zeros(6, 40)
    for b in range(6):  # a prompt, a response, a padding tail
        loss_mask[b, 5 + b : 30 + b] = 1.0
    return x, loss_mask


def _masking_kernels():
    return {
        "uniform": lambda x, m, g: corrupt_uniform(x, m, M, eps=EPS, generator=g),
        "blockwise": lambda x, m, g: corrupt_blockwise(x, m, M, block_size=8, eps=EPS, generator=g),
        "blockwise_seq": lambda x, m, g: corrupt_blockwise(x, m, M, block_size=None, eps=EPS, generator=g),
    }


# ---- shared invariants of the [MASK] kernels -------------------------------------------------------


@pytest.mark.parametrize("name", ["uniform", "blockwise", "blockwise_seq"])
def test_masking_kernel_invariants(name, batch):
    x, m = batch
    z, noise, p = _masking_kernels()[name](x, m, _gen(1))
    assert z.shape == x.shape and noise.shape == x.shape and p.shape == x.shape
    assert z.dtype == x.dtype and noise.dtype == torch.bool and p.dtype == torch.float32
    assert not (noise & (m == 0)).any()  # noise ⊆ loss_mask
    assert (z[noise] == M).all()  # corrupted positions hold the mask token
    assert torch.equal(z[~noise], x[~noise])  # the rest is unchanged
    assert (p >= EPS - 1e-7).all() and (p <= 1.0).all()
    assert noise.any()


def test_uniform_p_mask_constant_per_sequence(batch):
    x, m = batch
    _, _, p = corrupt_uniform(x, m, M, eps=EPS, generator=_gen(2))
    assert torch.equal(p, p[:, :1].expand_as(p))


def test_uniform_rate_follows_p():
    # With one long row the corrupted fraction of supervised positions is close to p.
    x = torch.zeros(1, 20000, dtype=torch.long)
    m = torch.ones(1, 20000)
    for seed in range(3):
        z, noise, p = corrupt_uniform(x, m, M, eps=EPS, generator=_gen(seed))
        assert abs(noise.float().mean().item() - p[0, 0].item()) < 0.02


def test_eps_one_masks_everything_supervised(batch):
    x, m = batch
    _, noise, p = corrupt_uniform(x, m, M, eps=1.0, generator=_gen(0))
    assert torch.equal(noise, m != 0) and torch.allclose(p, torch.ones_like(p))


# ---- blockwise ----------------------------------------------------------------------------------


def test_gumbel_topk_selects_exactly_k():
    log_w = torch.randn(50, 12, generator=_gen(0))
    log_w[:, 10:] = float("-inf")  # two slots never available
    k = torch.randint(0, 11, (50,), generator=_gen(1))
    chosen = gumbel_topk(log_w, k, _gen(2))
    assert chosen.dtype == torch.bool
    assert torch.equal(chosen.sum(-1), k)
    assert not chosen[:, 10:].any()


def test_gumbel_topk_follows_the_weights():
    # Single draw (k=1) from weights ∝ [1, 3]: picks slot 1 about 3/4 of the time.
    log_w = torch.log(torch.tensor([[1.0, 3.0]])).expand(20000, 2)
    chosen = gumbel_topk(log_w, torch.ones(20000, dtype=torch.long), _gen(3))
    assert abs(chosen[:, 1].float().mean().item() - 0.75) < 0.015


def test_blockwise_exact_k_per_block_when_fully_supervised():
    B, L, bs = 8, 37, 8  # last block has 5 positions
    x = torch.arange(L).repeat(B, 1)
    m = torch.ones(B, L)
    z, noise, p = corrupt_blockwise(x, m, M, block_size=bs, eps=EPS, generator=_gen(4))
    for b in range(B):
        for start in range(0, L, bs):
            length = min(bs, L - start)
            level = p[b, start].item()
            assert torch.all(p[b, start : start + length] == p[b, start])  # one m per block
            k = min(max(round(level * length), 0), length)
            assert noise[b, start : start + length].sum().item() == k


def test_blockwise_p_mask_varies_across_blocks(batch):
    x, m = batch
    _, _, p = corrupt_blockwise(x, m, M, block_size=8, eps=EPS, generator=_gen(5))
    assert len(torch.unique(p[0])) > 1


def test_sequence_level_when_no_block_size():
    x = torch.zeros(4, 30, dtype=torch.long)
    m = torch.ones(4, 30)
    _, noise, p = corrupt_blockwise(x, m, M, block_size=None, eps=EPS, generator=_gen(6))
    assert torch.equal(p, p[:, :1].expand_as(p))
    k = torch.clamp(torch.round(p[:, 0] * 30), 1, 30).long()
    assert torch.equal(noise.sum(-1), k)


def test_blockwise_half_life_biases_to_later_positions():
    # Small m -> masking concentrates late in the block (log w_j = λ(1-m) j).
    x = torch.zeros(4000, 16, dtype=torch.long)
    m = torch.ones(4000, 16)
    _, noise, p = corrupt_blockwise(x, m, M, block_size=16, eps=EPS, half_life_ratio=0.1, generator=_gen(7))
    low = p[:, 0] < 0.3
    early, late = noise[low, :8].float().sum(), noise[low, 8:].float().sum()
    assert late > 2 * early


# ---- uniform-random (block diffusion) -----------------------------------------------------------


def test_uniform_random_invariants(batch):
    x, m = batch
    V = 50
    z, noise, p = corrupt_uniform_random(x, m, V, eps=EPS, generator=_gen(8))
    assert z.shape == x.shape and z.dtype == x.dtype
    assert torch.equal(p, torch.ones_like(p))
    assert torch.equal(z[m == 0], x[m == 0])  # only supervised positions change
    assert not (noise & (m == 0)).any()
    assert ((z >= 0) & (z < V)).all()


def test_uniform_random_dtype_preserved(batch):
    x, m = batch
    z, _, _ = corrupt_uniform_random(x.to(torch.int32), m, 50, generator=_gen(9))
    assert z.dtype == torch.int32


def test_uniform_random_no_fixed_sentinel_token():
    x = torch.zeros(4, 500, dtype=torch.long)
    m = torch.ones(4, 500)
    z, noise, _ = corrupt_uniform_random(x, m, 1000, eps=0.9, generator=_gen(10))
    assert len(torch.unique(z[noise])) > 100


def test_uniform_random_per_block_t_differs_and_none_is_per_sequence():
    x = torch.zeros(200, 64, dtype=torch.long)
    m = torch.ones(200, 64)
    _, noise, _ = corrupt_uniform_random(x, m, 1000, block_size=32, generator=_gen(11))
    rate_a, rate_b = noise[:, :32].float().mean(1), noise[:, 32:].float().mean(1)
    assert (rate_a - rate_b).abs().mean() > 0.15  # independent t per block
    _, noise, _ = corrupt_uniform_random(x, m, 1000, block_size=None, generator=_gen(11))
    rate_a, rate_b = noise[:, :32].float().mean(1), noise[:, 32:].float().mean(1)
    assert (rate_a - rate_b).abs().mean() < 0.1  # one t per sequence


# ---- all-masked (idlm) --------------------------------------------------------------------------


def test_all_masked(batch):
    x, m = batch
    z, noise, p = corrupt_all_masked(x, m, M)
    assert torch.equal(noise, m != 0)
    assert (z[m != 0] == M).all() and torch.equal(z[m == 0], x[m == 0])  # prompt stays clean
    assert torch.equal(p, torch.ones_like(p))


# ---- seeded generators --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["uniform", "blockwise"])
def test_same_seed_same_output_different_seed_differs(name, batch):
    x, m = batch
    kernel = _masking_kernels()[name]
    a, b, c = kernel(x, m, _gen(5)), kernel(x, m, _gen(5)), kernel(x, m, _gen(6))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[1], c[1])


def test_kernels_do_not_consume_global_rng(batch):
    x, m = batch
    torch.manual_seed(0)
    state = torch.get_rng_state()
    corrupt_uniform(x, m, M, generator=_gen(1))
    corrupt_blockwise(x, m, M, block_size=8, generator=_gen(1))
    corrupt_uniform_random(x, m, 50, generator=_gen(1))
    corrupt_mix(x, m, M, 100, 0.3, 0.3, generator=_gen(1))
    per_sample(corrupt_uniform, [1, 2, 3, 4, 5, 6], x, m, mask_token_id=M)
    assert torch.equal(state, torch.get_rng_state())


def test_per_sample_is_independent_of_batch_composition(batch):
    x, m = batch
    seeds = [11, 22, 33, 44, 55, 66]
    full = per_sample(corrupt_uniform, seeds, x, m, mask_token_id=M, eps=EPS)
    # Row 3 alone, and rows 3..5 in another order, draw exactly the same noise for row 3.
    alone = per_sample(corrupt_uniform, [44], x[3:4], m[3:4], mask_token_id=M, eps=EPS)
    mixed = per_sample(corrupt_uniform, [66, 44], x[[5, 3]], m[[5, 3]], mask_token_id=M, eps=EPS)
    for f, a, mx in zip(full, alone, mixed):
        assert torch.equal(f[3], a[0]) and torch.equal(f[3], mx[1]) and torch.equal(f[5], mx[0])
    # ...and equals running the kernel on that row with its own generator
    direct = corrupt_uniform(x[3:4], m[3:4], M, eps=EPS, generator=_gen(44))
    assert all(torch.equal(f[3], d[0]) for f, d in zip(full, direct))


def test_per_sample_rejects_wrong_seed_count(batch):
    x, m = batch
    with pytest.raises(ValueError, match="seeds"):
        per_sample(corrupt_uniform, [1, 2], x, m, mask_token_id=M)


# ---- corrupt_mix (scdd) -------------------------------------------------------------------------


def test_mix_channels_exclusive_and_gated_by_loss_mask(batch):
    x, m = batch
    V, Mv = 60, 59
    z, noise = corrupt_mix(x, m, Mv, V, 0.3, 0.4, generator=_gen(12))
    absorbed, swapped = z == Mv, noise & (z != Mv)
    assert not (absorbed & swapped).any()
    assert not (noise & (m == 0)).any()
    assert torch.equal(noise, z != x)
    assert absorbed.any() and swapped.any()


def test_mix_uniform_replacements_exclude_mask_and_clean_token(batch):
    x, m = batch
    V, Mv = 60, 20  # mask id inside the clean range
    z, noise = corrupt_mix(x, m, Mv, V, 0.0, 1.0, generator=_gen(13))
    repl = noise & (x != Mv)
    assert (z[repl] != Mv).all() and (z[repl] != x[repl]).all()
    assert ((z >= 0) & (z < V)).all()


def test_mix_replacements_cover_the_allowed_support_uniformly():
    V, Mv, n = 8, 7, 60000
    x = torch.zeros(1, n, dtype=torch.long)
    z, noise = corrupt_mix(x, torch.ones(1, n), Mv, V, 0.0, 1.0, generator=_gen(14))
    assert noise.all()
    counts = torch.bincount(z[0], minlength=V)
    assert counts[0] == 0 and counts[Mv] == 0
    expected = n / 6
    assert ((counts[1:7].float() - expected).abs() / expected < 0.05).all()


def test_mix_channel_marginals_match_requested_probabilities():
    V, Mv, n = 100, 99, 200000
    x = torch.randint(0, 99, (1, n), generator=_gen(15))
    z, noise = corrupt_mix(x, torch.ones(1, n), Mv, V, 0.3, 0.2, generator=_gen(16))
    assert abs((z == Mv).float().mean().item() - 0.3) < 0.01
    assert abs((noise & (z != Mv)).float().mean().item() - 0.2) < 0.01


def test_mix_clean_mask_tokens_never_change():
    x = torch.full((2, 100), 7)
    z, noise = corrupt_mix(x, torch.ones(2, 100), 7, 10, 0.5, 0.5, generator=_gen(17))
    assert torch.equal(z, x) and not noise.any()  # neither channel touches a clean [MASK]


def test_mix_ids_stay_in_range_when_every_clean_token_is_mask():
    V = 5
    x = torch.full((3, 50), V - 1)
    z, _ = corrupt_mix(x, torch.ones(3, 50), V - 1, V, 0.2, 0.8, generator=_gen(18))
    assert ((z >= 0) & (z < V)).all()


def test_mix_same_seed_identical_and_global_rng_untouched(batch):
    x, m = batch
    state = torch.get_rng_state()
    a = corrupt_mix(x, m, 99, 100, 0.2, 0.3, generator=_gen(19))
    b = corrupt_mix(x, m, 99, 100, 0.2, 0.3, generator=_gen(19))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(state, torch.get_rng_state())


def test_mix_rejects_bad_arguments(batch):
    x, m = batch
    with pytest.raises(ValueError, match="vocab_size"):
        corrupt_mix(x, m, 1, 2, 0.1, 0.1)
    with pytest.raises(ValueError, match="<= 1"):
        corrupt_mix(x, m, 99, 100, 0.6, 0.5)
    corrupt_mix(x, m, 99, 100, 0.25, 0.75, generator=_gen(0))  # summing to exactly one is fine
    corrupt_mix(x, m, 99, 100, torch.tensor([0.5] * 6), torch.tensor([0.5] * 6), generator=_gen(0))


# ---- corrupt_scdd -------------------------------------------------------------------------------


def test_scdd_time_on_the_discrete_grid_and_contract(batch):
    x, m = batch
    T = 50
    seeds = list(range(100, 106))
    z, noise, t = per_sample(
        corrupt_scdd, seeds, x, m, mask_token_id=99, vocab_size=100, num_timesteps=T, uniform_ratio=0.3
    )
    grid = t * T
    assert torch.allclose(grid, grid.round(), atol=1e-4)
    assert ((t >= 1.0 / T - 1e-6) & (t <= 1 - 1.0 / T + 1e-6)).all()
    assert torch.equal(t, t[:, :1].expand_as(t))
    assert not (noise & (m == 0)).any() and torch.equal(noise, z != x)


def test_scdd_both_channels_appear():
    x = torch.randint(0, 90, (64, 64), generator=_gen(20))
    m = torch.ones(64, 64)
    z, noise, _ = per_sample(
        corrupt_scdd,
        list(range(64)),
        x,
        m,
        mask_token_id=99,
        vocab_size=100,
        num_timesteps=1000,
        uniform_ratio=0.2,
    )
    assert (z == 99).any() and (noise & (z != 99)).any()


def test_scdd_smallest_reachable_time_is_two_steps():
    # u = (1-eps) U + eps >= eps, so t >= (floor(eps T) + 1)/T = 2/T at eps = 1e-3, T = 1000
    x = torch.zeros(1, 4, dtype=torch.long)
    ts = [
        corrupt_scdd(x, torch.ones(1, 4), 99, 100, num_timesteps=1000, uniform_ratio=0.1, generator=_gen(s))[
            2
        ][0, 0]
        for s in range(300)
    ]
    assert min(ts).item() >= 2 / 1000 - 1e-6
    assert max(ts).item() <= 1 - 1 / 1000 + 1e-6


@pytest.mark.parametrize(("T", "r"), [(1000, 0.1), (50, 0.3)])
def test_scdd_draws_the_spec_stream_from_each_samples_generator(batch, T, r):
    """docs/strategies.md §2.2 + §1.3 written out: each sample's own generator draws a float32 rand(1) for t, then
    rand(1, L) for the channels, then randint(0, V-2, (1, L)) for the replacement ids, in that order."""
    x, m = batch
    V = 100
    seeds = [7, 2**40 + 3, 123456789, 0, 5, 99]
    z, noise, p = per_sample(corrupt_scdd, seeds, x, m, mask_token_id=M, vocab_size=V, num_timesteps=T,
                             uniform_ratio=r, eps=EPS)  # fmt: skip
    a = b = 0.5  # g = 1, tau = 0.5
    scale = (r / (1 - r)) / (0.5**a * 0.5**b)
    K = V - 1
    for row, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(1, generator=g)  # float32, as the documented rand(B)
        u = (1 - EPS) * u + EPS
        t = torch.clamp((torch.floor(u * T) + 1) / T, max=1 - 1 / T)
        assert torch.equal(p[row], t.expand(x.shape[1])), f"row {row}: t is not the documented draw"
        tt = float(t.double())
        c = scale * tt**a * (1 - tt) ** b
        mask_prob, uniform_prob = tt / (1 + c), c / (1 + c) * (K - 1) / K
        pos_u = torch.rand(1, x.shape[1], generator=g)[0].double()  # [L]
        draw = torch.randint(0, V - 2, (1, x.shape[1]), generator=g)[0]  # [L]
        for i in range(x.shape[1]):
            xi = int(x[row, i])
            if m[row, i] == 0 or xi == M:
                want = xi
            elif pos_u[i] < mask_prob:
                want = M
            elif pos_u[i] < mask_prob + uniform_prob:
                d = int(draw[i])
                d += d >= min(xi, M)
                d += d >= max(xi, M)
                want = min(d, V - 1)
            else:
                want = xi
            assert int(z[row, i]) == want, (row, i)
    assert torch.equal(noise, z != x)


def test_per_sample_noise_does_not_depend_on_batch_padding():
    """A row padded to 20 or to 30 (other micro-batch) gets the same noise with a fixed draw_length."""
    from dllmflow.diffusion.corruption import corrupt_blockwise, corrupt_uniform, per_sample

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (1, 20), generator=g)
    mask = torch.ones(1, 20)
    mask[:, :5] = 0
    short = (ids, mask)
    long = (torch.nn.functional.pad(ids, (0, 10)), torch.nn.functional.pad(mask, (0, 10)))
    for kernel, kw in [(corrupt_uniform, {}), (corrupt_blockwise, {"block_size": 4})]:
        a = per_sample(kernel, [123], *short, mask_token_id=2, draw_length=64, **kw)
        b = per_sample(kernel, [123], *long, mask_token_id=2, draw_length=64, **kw)
        for x, y in zip(a, b):
            assert x.shape[1] == 20 and y.shape[1] == 30
            assert torch.equal(x, y[:, :20])
        # Without a fixed draw length the stream shifts with the padded length (why draw_length exists).
        c = per_sample(kernel, [123], *short, mask_token_id=2, **kw)
        d = per_sample(kernel, [123], *long, mask_token_id=2, **kw)
        if kernel is corrupt_blockwise:
            assert not torch.equal(c[1], d[1][:, :20])
