"""The one causal decoder with a KV cache (issue 51): next-token decoding of a causal LM, a token per
forward, for both the `ar` sampler (samplers/ar.py) and serving's `ChatEngine` (inference/engine.py).
Greedy by default; the engine passes its temperature/top-p draw as `pick`.

    decoder = CausalDecoder(model, [ids_a, ids_b], fill_id, stop_ids={eos}, max_new=[32, 16])
    out, nfe, row_nfe, positions = drain(iter_causal_decode(decoder))     # whole
    loop = iter_causal_decode(decoder)                                     # or paused before each
    progress = next(loop); progress = loop.send([1])                       # forward, rows dropped

The prompts are left-padded to a common length S (`loop.build_left_padded_canvas`): position ids
restart at each row's first real token and padded keys are blocked (`masks.causal.causal_mask`), so a
row decodes as it would alone (batch invariance). One forward reads the prompts, then one forward per
new token reads only that token against the cache (`use_cache=False`: the whole sequence again, same
tokens). A row stops at its first stop id or at its own `max_new` tokens, and leaves the batch (and its
cached keys, through transformers' `batch_select_indices`) before the next forward: no forward is spent
on a finished answer. The loop pauses before each forward after the prompts' (`token_steps.pause_rows`),
where a caller streams the rows' tokens (final already) and may drop rows.

Tested by tests/unit/test_causal_decode.py (both callers equal HF `generate` through this loop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dllmflow.diffusion.masks.causal import causal_mask

from .kv import ModelCache
from .loop import BlockLoop, build_left_padded_canvas
from .token_steps import pause_rows

# (logits [b, V] of the live rows, their original row indices) -> the next token of each [b]
Pick = Callable[[Tensor, list[int]], Tensor]


def greedy(logits: Tensor, rows: list[int]) -> Tensor:
    return logits.argmax(-1)  # [b]


class CausalDecoder:
    """A batch of prompts decoded token by token. Per original row: its new tokens (`out`, the stop id
    included), forwards (`row_nfe`), positions computed (`positions`, padding excluded) and whether it
    stopped (`done`); `calls` counts model forwards. `out` may be the caller's lists (appended in place)."""

    def __init__(
        self,
        model,
        prompt_ids: list[list[int]],
        fill_id: int,
        stop_ids: set[int],
        max_new: list[int],
        *,
        use_cache: bool = True,
        pick: Pick = greedy,
        out: list[list[int]] | None = None,
        sampler: str = "ar",
    ):
        device = next(model.parameters()).device
        B = len(prompt_ids)
        self.c = build_left_padded_canvas(
            prompt_ids, max(max_new, default=0), fill_id, fill_id, device, sampler=sampler
        )
        self.kv = ModelCache(model, device)
        self.use_cache, self.pick, self.stop_ids, self.max_new = use_cache, pick, set(stop_ids), list(max_new)
        self.live = torch.arange(B, device=device)  # [b] original row of each live row
        self.out = out if out is not None else [[] for _ in range(B)]
        self.row_nfe, self.positions = [0] * B, [0] * B
        self.done = [n <= 0 for n in self.max_new]
        self.t = 0  # forwards so far = new tokens of every live row (rows only ever leave)

    @property
    def calls(self) -> int:
        return self.kv.calls

    def going(self) -> set[int]:
        """The live rows (original indices) that have not stopped."""
        return {r for r in self.live.tolist() if not self.done[r]}

    def keep(self, rows: set[int]) -> None:
        """Only the live rows in `rows` (original indices) stay, in their order, with their cached keys."""
        index = [i for i, r in enumerate(self.live.tolist()) if r in rows]
        if len(index) == len(self.live):
            return
        index = torch.tensor(index, dtype=torch.long, device=self.live.device)  # [b']
        self.live = self.live[index]
        self.c.select_rows(index)
        self.kv.select_rows(index)

    def forward(self) -> None:
        """The next token of every live row: forward what the cache lacks (the prompts, then the last
        token; everything again without a cache), read the last position, pick, count."""
        c, lo, hi = self.c, self.kv.length, self.c.prefix_len + self.t
        mask = causal_mask(c.valid[:, :hi], self.kv.dtype, lo, hi - lo)  # [b, 1, hi - lo, hi]
        logits = self.kv.forward(c.x[:, lo:hi], mask, c.position_ids[:, lo:hi], hi - lo - 1, hi - lo)[:, -1]
        computed = c.valid[:, lo:hi].sum(dim=1).tolist()  # [b] real positions forwarded
        if not self.use_cache:
            self.kv.truncate(0)
        rows = self.live.tolist()
        token = self.pick(logits, rows)  # [b]
        c.x[:, hi] = token
        for r, tok, n in zip(rows, token.tolist(), computed):
            self.out[r].append(tok)
            self.row_nfe[r] += 1
            self.positions[r] += n
            self.done[r] = tok in self.stop_ids or len(self.out[r]) >= self.max_new[r]
        self.t += 1


def iter_causal_decode(decoder: CausalDecoder) -> BlockLoop:
    """The decoding loop (a `loop.BlockLoop`): a forward, then a pause (`pause_rows`: each row's tokens
    so far, final) before the next one, where the caller may drop rows; stopped and dropped rows leave the
    batch there. -> (out, forwards, row_nfe, positions) of the rows the caller still holds, in its order."""
    d = decoder
    batch = list(range(len(d.out)))  # the rows the caller holds (it may drop some at a pause), in its order
    while going := d.going():
        if d.t:
            batch = yield from pause_rows(batch, d.out, going, d.row_nfe, d.positions)
            going &= set(batch)
        d.keep(going)
        if not going:
            break
        d.forward()
    return [d.out[r] for r in batch], d.calls, [d.row_nfe[r] for r in batch], [d.positions[r] for r in batch]
