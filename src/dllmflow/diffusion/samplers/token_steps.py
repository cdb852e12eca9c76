"""What the token-by-token decoders (`ar`, `selfspec`) share: the pause of their loops before a forward,
where a caller (`Sampler.stepper`, the server's turn) sees every row's committed tokens, final already,
and may drop rows. Their loops are `loop.BlockLoop`s whose "block" is one forward.

    batch = yield from pause_rows(batch, out, computing, row_nfe, positions)   # the rows kept
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .loop import BlockProgress


def pause_rows(
    batch: list[int], out: list[list[int]], computing: set[int], row_nfe: list[int], positions: list[int]
) -> Generator[BlockProgress, Any, list[int]]:
    """The pause of a token-by-token loop (ar, selfspec) before its next forward: yield the progress of
    the caller's rows `batch` (original indices; `out` their committed ids, final; a row not in
    `computing` has stopped), -> the rows the caller keeps (it sends indices into `batch`, or None)."""
    kept = yield BlockProgress([list(out[r]) for r in batch], [r not in computing for r in batch],
                               [row_nfe[r] for r in batch], [positions[r] for r in batch])  # fmt: skip
    return batch if kept is None else [batch[i] for i in kept]
