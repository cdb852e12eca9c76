"""Stopping at EOS (docs/strategies.md §3.0 "Stopping at EOS"), shared by every block loop: which rows
a loop still decodes (`LiveRows`: a row stopped at its EOS is in no later forward, and each row's
computed positions are counted), the stop test (`first_eos_done`) and EoTP truncation of a full canvas
(`truncate_after_eos`, the `eos_truncate` setting of `llada` and `scdd`).

    live = LiveRows(batch, device)
    logits = source(lo, hi, live.index)              # the forward computes the live rows only
    live.computed(live.index, valid[live.index, lo:hi])
    done |= first_eos_done(x, start, G, eos_id, mask_id)
    stay = live.retire(done)                          # select a cache with `stay`
"""

from __future__ import annotations

import torch
from torch import Tensor


class LiveRows:
    """The canvas rows a block loop still decodes (`index` [R], ascending). A row leaves the moment it
    stops at its EOS (`retire`), so no later forward computes it (its tokens are final: stopping is
    exact); a cached source holds its rows in this order and is selected alike (`source.select_rows`).
    `positions` [B]: the canvas positions each row's forwards computed (padding excluded)."""

    def __init__(self, batch: int, device):
        self.index = torch.arange(batch, device=device)  # [R]
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # [B]

    def __len__(self) -> int:
        return len(self.index)

    def computed(self, rows: Tensor, valid: Tensor) -> None:
        """A forward computed the canvas rows `rows` [R]; `valid` [R, Q] marks their real query positions."""
        self.positions[rows] += valid.sum(dim=1).to(self.positions.dtype)

    def retire(self, done: Tensor) -> Tensor | None:
        """Drop the live rows `done` [B] marks; -> which of the live rows stay ([R'] positions in the old
        `index`, to select a cache with), None when none left."""
        stay = (~done[self.index]).nonzero().flatten()  # [R']
        if len(stay) == len(self.index):
            return None
        self.index = self.index[stay]
        return stay

    def keep(self, kept: Tensor) -> Tensor:
        """The caller kept the canvas rows `kept` [B'] (the canvas is re-indexed by it): -> which of the
        live rows stay ([R'] positions in the old `index`)."""
        new = torch.full_like(self.positions, -1)  # [B] old canvas row -> new, -1 dropped
        new[kept] = torch.arange(len(kept), device=kept.device)
        moved = new[self.index]  # [R]
        stay = (moved >= 0).nonzero().flatten()
        self.index, self.positions = moved[stay], self.positions[kept]
        return stay


def first_eos_done(x: Tensor, gen_start: Tensor, gen_length: int, eos_id: int, mask_id: int) -> Tensor:
    """Rows whose generation window holds an EOS with no [MASK] before it. -> [B] bool."""
    pos = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
    window = (pos >= gen_start[:, None]) & (pos < (gen_start + gen_length)[:, None])  # [B, T]
    masked_before = (window & (x == mask_id)).long().cumsum(dim=1)  # [B, T] masks up to and incl. p
    return (window & (x == eos_id) & (masked_before == 0)).any(dim=1)


def truncate_after_eos(x: Tensor, attention_mask: Tensor, gen_start: Tensor, gen_length: int, eos_id: int,
                       fill_id: int) -> None:  # fmt: skip
    """EoTP (`eos_truncate`), in place: in each row the window positions after its first committed EOS
    become filler and leave the forwards (attention 0); the trim cuts them anyway. x, attention_mask
    [B, T] (a row's attention a prefix of it), gen_start [B]."""
    pos = torch.arange(x.shape[1], device=x.device)[None, :]  # [1, T]
    window = (pos >= gen_start[:, None]) & (pos < (gen_start + gen_length)[:, None])  # [B, T]
    first = torch.where(window & (x == eos_id), pos, x.shape[1]).min(dim=1).values  # [B] T: none
    after = pos > first[:, None]  # [B, T]
    x[after & window] = fill_id
    attention_mask[after] = 0
