"""Weighted mixing of several sources (`dataset.mixture`), deterministic by seed.

    rows = mix_rows([(rows_a, 0.7), (rows_b, 0.3)], seed=0)                 # as many as fit, no repeats
    rows = mix_rows([(rows_a, 0.7), (rows_b, 0.3)], seed=0, num_rows=1000)  # exactly ~1000

Source i contributes round(p_i * N) rows, p_i = weight_i / sum(weights). Without `num_rows`, N is the
largest total for which no source has to repeat a row (the scarcest source, relative to its weight,
is used whole); with it, a source asked for more rows than it has repeats whole passes, then samples
the rest. Each source samples with its own `random.Random(f"{seed}:{i}")`, so adding a source does not
reshuffle the others; chosen rows keep their source order. Ids become `<i>/<id>` (and `#<k>` for a
repeat) so they stay unique.
"""

from __future__ import annotations

import random

from dllmflow.errors import UserError


def mixture_counts(sizes: list[int], weights: list[float], num_rows: int | None) -> list[int]:
    total_w = sum(weights)
    if not total_w > 0:
        raise UserError("dataset.mixture: the weights must sum to a positive number")
    shares = [w / total_w for w in weights]
    if num_rows is None:
        num_rows = int(min(n / p for n, p in zip(sizes, shares) if p > 0))
    return [round(p * num_rows) for p in shares]


def _sample(rows: list[dict], k: int, rng: random.Random) -> list[tuple[int, int]]:
    """(pass, index) pairs: whole passes while k exceeds the rows, then a sample without replacement."""
    passes, rest = divmod(k, len(rows)) if rows else (0, 0)
    picked = [(p, i) for p in range(passes) for i in range(len(rows))]
    picked += [(passes, i) for i in sorted(rng.sample(range(len(rows)), rest))]
    return picked


def mix_rows(sources: list[tuple[list[dict], float]], seed: int, num_rows: int | None = None) -> list[dict]:
    for i, (rows, weight) in enumerate(sources):
        if weight > 0 and not rows:
            raise UserError(f"dataset.mixture[{i}]: no usable rows, but its weight is {weight}")
    counts = mixture_counts([len(r) for r, _ in sources], [w for _, w in sources], num_rows)
    out = []
    for i, ((rows, _), k) in enumerate(zip(sources, counts)):
        for p, j in _sample(rows, k, random.Random(f"{seed}:{i}")):
            row = rows[j]
            out.append({**row, "id": f"{i}/{row['id']}" + (f"#{p}" if p else "")})
    return out
