"""Per-sample corruption seeds (docs/strategies.md §1.3): topology-independent, deterministic, distinct, 63-bit."""

from __future__ import annotations

import torch

from dllmflow.diffusion.seeding import (
    generators,
    global_sample_index,
    sample_seed,
    sample_seeds,
    seeds_from_indices,
)


def _seed_by_global_position(base: int, step: int, gbs: int, dp_size: int, lbs: int) -> dict[int, int]:
    """Seed of every sample of one step keyed by its position in the step's global batch, where a
    round-robin sampler deals position p to rank p % dp_size as that rank's (p // dp_size)-th row and
    each rank cuts its rows into micro-batches of lbs in order."""
    grad_accum = gbs // (lbs * dp_size)
    out: dict[int, int] = {}
    for rank in range(dp_size):
        for mb in range(grad_accum):
            seeds = sample_seeds(base, step, gbs, rank, dp_size, mb, lbs)
            for offset, seed in enumerate(seeds):
                row_on_rank = mb * lbs + offset
                position = rank + row_on_rank * dp_size  # the sampler's layout
                assert position not in out
                out[position] = seed
    return out


def test_same_sample_same_seed_across_topologies():
    gbs = 8
    reference = _seed_by_global_position(base=7, step=3, gbs=gbs, dp_size=1, lbs=8)
    assert sorted(reference) == list(range(gbs))
    for dp_size, lbs in [(1, 4), (1, 2), (2, 4), (2, 2), (2, 1), (4, 1), (4, 2)]:
        assert _seed_by_global_position(7, 3, gbs, dp_size, lbs) == reference, (dp_size, lbs)


def test_reference_formula():
    # gidx = step*gbs + rank + (mb*lbs + offset)*dp ; seed = (base + 2^43 + 2654435761*gidx) mod 2^63
    assert global_sample_index(5, 16, 1, 2, 3, 2, 1) == 5 * 16 + 1 + (3 * 2 + 1) * 2
    gidx = 97
    assert sample_seed(42, 0, gidx) == (42 + 2**43 + 2654435761 * gidx) % 2**63


def test_deterministic():
    a = sample_seeds(11, 4, 8, 1, 2, 1, 2)
    b = sample_seeds(11, 4, 8, 1, 2, 1, 2)
    assert a == b


def test_base_seed_changes_every_seed():
    a = sample_seeds(1, 0, 8, 0, 1, 0, 8)
    b = sample_seeds(2, 0, 8, 0, 1, 0, 8)
    assert all(x != y for x, y in zip(a, b))


def test_distinct_per_sample_and_per_step():
    seen = set()
    for step in range(20):
        for seed in _seed_by_global_position(0, step, 8, 2, 2).values():
            seen.add(seed)
    assert len(seen) == 20 * 8


def test_63_bit_range_even_for_huge_or_negative_inputs():
    for base in (-(2**70), -1, 0, 2**62, 2**80):
        for gidx in (0, 1, 2**40, 2**60):
            s = sample_seed(base, 0, gidx)
            assert 0 <= s < 2**63
            torch.Generator().manual_seed(s)  # accepted by torch


def test_seeds_from_indices_matches_sample_seed():
    idx = torch.tensor([3, 9, 4])
    assert seeds_from_indices(5, 2, idx) == [sample_seed(5, 2, i) for i in (3, 9, 4)]


def test_generators_reproduce_their_seed():
    g1, g2 = generators([123, 123])
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    h1, h2 = generators([123, 124])
    assert not torch.equal(torch.rand(4, generator=h1), torch.rand(4, generator=h2))
