"""Bundled synthetic tasks a tiny model learns on CPU in minutes: the embedded default of the demo.

    rows = addition_rows()                              # [{"id", "messages": [user, assistant]}, ...]
    rows = addition_rows(num_rows=500, seed=1, min_digits=1, max_digits=2)
    # in a recipe:  dataset: {path_or_dataset_id: "embedded:addition", seq_length: 32}

A row asks "What is 347 + 58?" and answers "#### 405": GSM8K's answer line, so evaluation's strict
`#### N` extraction scores it unchanged. The answer is only the number because a masked diffusion model
decodes every position at once: the digits of the sum are the whole task (with the byte-level BPE's
per-digit split, 3-digit operands give at most 4 answer tokens). Rows are a pure function of the
arguments (same arguments -> same rows, on every machine and Python version: `random.Random(seed)`
is specified to be stable); `dllmflow prepare` holds out `dataset.eval_fraction` of them by a hash of
the question, and every question appears once, so no eval problem is also a training problem.
"""

from __future__ import annotations

import hashlib
import json
import random

ADDITION_VERSION = 1  # bump when addition_rows() changes what it generates
ADDITION_DEFAULTS = {"num_rows": 5000, "seed": 0, "min_digits": 1, "max_digits": 3}
# The rows are a pure function of the generator and its arguments, so those identify them.
ADDITION_SHA256 = hashlib.sha256(
    json.dumps({"addition": ADDITION_VERSION, **ADDITION_DEFAULTS}, sort_keys=True).encode()
).hexdigest()


def addition_rows(
    num_rows: int = ADDITION_DEFAULTS["num_rows"],
    seed: int = ADDITION_DEFAULTS["seed"],
    min_digits: int = ADDITION_DEFAULTS["min_digits"],
    max_digits: int = ADDITION_DEFAULTS["max_digits"],
) -> list[dict]:
    """`num_rows` distinct addition problems; each operand has min_digits..max_digits digits."""
    lo, hi = 10 ** (min_digits - 1) if min_digits > 1 else 0, 10**max_digits - 1
    capacity = (hi - lo + 1) ** 2
    if num_rows > capacity:
        raise ValueError(f"only {capacity} distinct problems with {min_digits}-{max_digits} digit operands")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    rows = []
    while len(rows) < num_rows:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append(
            {
                "id": f"addition-{len(rows):05d}",
                "messages": [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"#### {a + b}"},
                ],
            }
        )
    return rows
