"""Bundled synthetic tasks a model learns on CPU in minutes: `embedded:addition` (the demo's) and
`embedded:arithmetic` (the real-model A2D recipes').

    rows = addition_rows()                              # [{"id", "messages": [user, assistant]}, ...]
    rows = addition_rows(num_rows=500, seed=1, min_digits=1, max_digits=2)
    rows = arithmetic_rows()                            # 1-2 digit + and -, e.g. "What is 47 - 8?"
    # in a recipe:  dataset: {path_or_dataset_id: "embedded:addition", seq_length: 32}

A row asks "What is 47 + 38?" and answers "#### 085": GSM8K's answer line, so evaluation's strict
`#### N` extraction scores it unchanged (numbers are compared as numbers: 085 == 85). The answer is only
the number, zero-padded to a fixed width, because a masked diffusion model decodes every position at
once: with a variable width it must also guess where the digits start, and a tiny model trained for
minutes answers "#### 101" for 71 (measured: held-out exact match 0.31 unpadded). With the byte-level
BPE's per-digit split the answer is `####`, a space, max_digits + 1 digit tokens and eos. Rows are a pure function of the
arguments (same arguments -> same rows, on every machine and Python version: `random.Random(seed)`
is specified to be stable); `dllmflow prepare` holds out `dataset.eval_fraction` of them by a hash of
the question, and every question appears once, so no eval problem is also a training problem.
"""

from __future__ import annotations

import hashlib
import json
import random

ADDITION_VERSION = 1  # bump when addition_rows() changes what it generates
# Every 2-digit pair (90 * 90): the tiny demo model learns the digit table, it cannot just memorise.
ADDITION_DEFAULTS = {"num_rows": 8100, "seed": 0, "min_digits": 2, "max_digits": 2}
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
    """`num_rows` distinct addition problems; each operand has min_digits..max_digits digits, the sum is
    written zero-padded to max_digits + 1 digits (see the module docstring)."""
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
                    {"role": "assistant", "content": f"#### {a + b:0{max_digits + 1}d}"},
                ],
            }
        )
    return rows


# The A2D recipes' task (params/smollm2_*.yaml), sized so that the AR base model is neither perfect nor
# hopeless on it, which makes "the converted model matches its AR base" a measurable claim. Measured,
# SmolLM2-135M-Instruct greedy with its chat template, 64 problems, flexible exact match (the last number):
# 1-2 digit + and - 0.11 with 16 new tokens, 0.19 with 32 (it often explains before answering); 2 digit +
# 0.125, 3 digit + 0.0, 2 digit + and - 0.03 (32 new tokens). Same answer line as `addition`.
ARITHMETIC_VERSION = 1  # bump when arithmetic_rows() changes what it generates
ARITHMETIC_DEFAULTS = {"num_rows": 4000, "seed": 0, "min_digits": 1, "max_digits": 2, "ops": "+-"}
ARITHMETIC_SHA256 = hashlib.sha256(
    json.dumps({"arithmetic": ARITHMETIC_VERSION, **ARITHMETIC_DEFAULTS}, sort_keys=True).encode()
).hexdigest()
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


def arithmetic_rows(
    num_rows: int = ARITHMETIC_DEFAULTS["num_rows"],
    seed: int = ARITHMETIC_DEFAULTS["seed"],
    min_digits: int = ARITHMETIC_DEFAULTS["min_digits"],
    max_digits: int = ARITHMETIC_DEFAULTS["max_digits"],
    ops: str = ARITHMETIC_DEFAULTS["ops"],
) -> list[dict]:
    """`num_rows` distinct problems `a op b` (op drawn from `ops`, each operand min_digits..max_digits
    digits, drawn digit count first so short operands are as common as long ones); a subtraction puts
    the larger operand first, so every answer is >= 0 and written zero-padded to max_digits + 1 digits."""
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be drawn from {''.join(_OPS)!r}, got {ops!r}")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    rows = []
    width = max_digits + 1
    for _ in range(50 * num_rows):  # bounded: too many rows for the operand range ends with an error
        if len(rows) == num_rows:
            return rows
        op = rng.choice(ops)
        a, b = (_operand(rng, min_digits, max_digits) for _ in range(2))
        if op == "-" and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append(
            {
                "id": f"arithmetic-{len(rows):05d}",
                "messages": [
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                    {"role": "assistant", "content": f"#### {_OPS[op](a, b):0{width}d}"},
                ],
            }
        )
    if len(rows) == num_rows:
        return rows
    raise ValueError(
        f"could not draw {num_rows} distinct problems with {min_digits}-{max_digits} digit operands"
    )


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


# `embedded:<name>` of the synthetic tasks -> (rows(), sha256 that identifies them); data/chat.py lists them.
SYNTHETIC = {"addition": (addition_rows, ADDITION_SHA256), "arithmetic": (arithmetic_rows, ARITHMETIC_SHA256)}
