"""Per-sample corruption seeds: a pure function of (base seed, step, global sample index), docs/strategies.md §1.3.

A sample's noise must not depend on how many ranks or accumulation micro-batches the step was cut
into, nor on what else shared its micro-batch; and a resumed run must redraw the same noise. So each
sample gets its own generator seeded from its position in the step's global batch:

    gbs  = local_batch_size * dp_size * grad_accum_steps          (the global batch size)
    gidx = step * gbs + dp_rank + (microbatch_idx * local_batch_size + offset) * dp_size
    seed = (base_seed + 2**43 + 2654435761 * gidx) & (2**63 - 1)

The index layout matches a distributed sampler that deals a step's global batch round-robin over
ranks (rank r gets global positions r, r + dp_size, ...) and then cuts each rank's share into
micro-batches in order. A loader with another layout (e.g. `dllmflow.training.data`, which hands
each row its global position as `batch["global_index"]`) calls `seeds_from_indices` instead; either
way the seed depends only on the sample's global position. `base_seed` is `settings.train.seed` (not a constant; docs/strategies.md §7 caveat 4);
TP/CP peers share a dp_rank and so draw identical noise. 2**43 offsets the corruption stream from
other per-sample streams that use the same index.

    from dllmflow.diffusion.seeding import sample_seeds, generators
    seeds = sample_seeds(settings.train.seed, step, gbs, dp_rank, dp_size, mb_idx, lbs)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CORRUPTION_STREAM = 2**43
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant: spreads consecutive indices apart
_MASK63 = 2**63 - 1


def sample_seed(base_seed: int, step: int, global_index: int, stream: int = CORRUPTION_STREAM) -> int:
    """63-bit seed of one sample. `step` is accepted for a self-describing call; it is already folded
    into `global_index` (which grows with the step)."""
    del step
    return (int(base_seed) + int(stream) + _GOLDEN * int(global_index)) & _MASK63


def restream(seed: int, stream: int) -> int:
    """The seed `sample_seed` would give the same sample on another stream (seeds carry +2^43)."""
    return (int(seed) - CORRUPTION_STREAM + stream) & _MASK63


def global_sample_index(
    step: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    microbatch_idx: int,
    local_batch_size: int,
    offset: int,
) -> int:
    """Index of row `offset` of micro-batch `microbatch_idx` on `dp_rank` in the whole training stream."""
    return step * global_batch_size + dp_rank + (microbatch_idx * local_batch_size + offset) * dp_size


def sample_seeds(
    base_seed: int, *position: int, num_rows: int | None = None, stream: int = CORRUPTION_STREAM
) -> list[int]:
    """Seeds of the rows of one micro-batch. `position` = (step, global_batch_size, dp_rank, dp_size,
    microbatch_idx, local_batch_size): where the micro-batch sits, as `global_sample_index` takes it.
    `num_rows` defaults to `local_batch_size`; a shorter final batch passes its real row count."""
    step, local_batch_size = position[0], position[5]
    n = local_batch_size if num_rows is None else num_rows
    return [sample_seed(base_seed, step, global_sample_index(*position, i), stream) for i in range(n)]


def seeds_from_indices(base_seed: int, step: int, global_index: Sequence[int] | torch.Tensor) -> list[int]:
    """Seeds for rows whose global indices are already known (e.g. a batch's `global_index` [B])."""
    indices = global_index.tolist() if isinstance(global_index, torch.Tensor) else list(global_index)
    return [sample_seed(base_seed, step, int(i)) for i in indices]


def generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One seeded `torch.Generator` per seed, on `device` (CUDA generators draw different streams
    than CPU ones, so keep the device fixed for reproducibility)."""
    out = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))
        out.append(gen)
    return out
