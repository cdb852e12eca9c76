"""The shared denoising loop of the [MASK]-filling samplers (docs/strategies.md §3.0): transfer schedule, token
selection with the Gumbel trick, logit shift, block geometry and canvas, the one semi-autoregressive
block loop over a logits source (`iter_block_loop`: `llada`, `idlm`, uncached or cached; `nemotron` and
`llada2` decode their own algorithms with its parts: `LoopRows`, `between_blocks`, `commit_step`),
infill (`llada`), and the left-padded canvas of block-causal decoding. Plain functions over tensors;
the sampler files call them.

    geometry = block_geometry(cfg.max_new_tokens, cfg.block_size, cfg.steps, whole_blocks=False)
    canvas = build_canvas(prompt_ids, geometry.gen_length, mask_id, fill_id, device)
    nfe, row_nfe, positions = drain(iter_block_loop(FullForward(forward, canvas), canvas, cfg, geometry, mask_id, fill_id))

The block loops are generators (`iter_block_loop` over a logits source: `FullForward`, or a cache of
`kv.py`; `llada2.iter_refine_blocks`) that yield a `BlockProgress` between blocks (`between_blocks`) and may be
sent the rows to keep (a server drops finished or abandoned rows there); `drain` runs one to its end, so
decoding block by block gives the tokens of decoding at once. Within a block they tell a listener (`SettledRows`,
set by `BlockStepper.step(on_settled=...)`) of each row whose block is final while others still decode
it, so a server can stream that row's block without waiting for the batch's slowest row. A row that
stopped at its EOS is in no later forward (`LiveRows`; exact: its tokens before the EOS are final),
and each row's computed positions are counted (`GenerationResult.row_positions`).

Departures from the reference, on purpose (docs/strategies.md §7 caveat 6): with a threshold the last step of a
block commits every remaining [MASK] of that block (never a stranded mask), and the EOS stop is per
row (a finished row stops changing and leaves the forwards; the batch stops when every row is done). The [MASK] column is
never a candidate token, so a committed position can never hold [MASK].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from dllmflow.errors import UserError
from dllmflow.models.attention import row_positions, takes_logits_to_keep

from .configs import BlockConfig
from .stopping import LiveRows, first_eos_done, truncate_after_eos

# logits = forward(input_ids [B, T], attention_mask [B, T]) -> [B, T, V]; a forward may also take
# `logits_to_keep=n` and return the last n positions' [B, n, V] (`takes_logits_to_keep`)
ForwardFn = Callable[[Tensor, Tensor], Tensor]


# ---- schedule and token selection ---------------------------------------------------------------


def get_num_transfer_tokens(mask_index: Tensor, steps: int) -> Tensor:
    """Tokens to commit per step: n masked in a row -> base = n // steps; the first n % steps steps
    get base + 1, the rest base. mask_index [B, L] bool -> [B, steps] long (rows sum to n)."""
    n = mask_index.sum(dim=1, keepdim=True)  # [B, 1]
    base, rem = n // steps, n % steps
    step = torch.arange(steps, device=mask_index.device)[None, :]  # [1, steps]
    return base + (step < rem).long()  # [B, steps]


def gumbel_argmax(
    logits: Tensor, temperature: float, uniform: Tensor | None = None, generator=None
) -> Tensor:
    """LLaDA's sampling trick: argmax of exp(logits) / (-log U)^temperature, which samples from
    softmax(logits / temperature). Computed as logits - temperature * log(-log U) in float64 (same
    argmax, no overflow of exp). temperature 0 = argmax. logits [..., V] -> [...] long."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    if uniform is None:
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    uniform = uniform.clamp_min(torch.finfo(torch.float64).tiny)  # U = 0 would give log(inf)
    scores = logits.double() - temperature * torch.log(-torch.log(uniform))
    return scores.argmax(dim=-1)


def get_transfer_index(
    logits: Tensor,
    temperature: float,
    remasking: str,
    mask_index: Tensor,
    x: Tensor,
    k: Tensor,
    threshold: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick the tokens to commit this step (docs/strategies.md §3.0 "Token selection").

    logits [B, L, V], mask_index [B, L] bool (the candidates), x [B, L], k [B] (tokens to commit per
    row). Returns (x0 [B, L]: proposals on candidates, x elsewhere; transfer [B, L] bool). With a
    threshold every candidate at or above it is committed, and the top-1 of each row always is.
    """
    # 1) proposals and confidences, only where a candidate sits (the rest is never committed)
    rows, cols = mask_index.nonzero(as_tuple=True)
    cand_logits = logits[rows, cols].float()  # [N, V]
    x0_c = gumbel_argmax(cand_logits, temperature, generator=generator)  # [N]
    if remasking == "low_confidence":
        conf_c = torch.softmax(cand_logits, dim=-1).gather(-1, x0_c[:, None]).squeeze(-1)  # [N]
    elif remasking == "random":
        conf_c = torch.rand(x0_c.shape, generator=generator, device=x0_c.device)
    else:
        raise ValueError(f"remasking must be low_confidence or random, got {remasking!r}")
    x0 = x.clone()
    x0[rows, cols] = x0_c.to(x.dtype)
    conf = torch.full(x.shape, -math.inf, device=x.device)  # [B, L]
    conf[rows, cols] = conf_c.float()

    # 2) per-row top-k by confidence (rank 0 = most confident)
    num_cand = mask_index.sum(dim=1)  # [B]
    k = num_cand if threshold is not None else torch.minimum(k.to(num_cand.device), num_cand)
    order = conf.argsort(dim=1, descending=True, stable=True)  # [B, L]
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(x.shape[1], device=x.device).expand_as(order)
    )
    transfer = (ranks < k[:, None]) & mask_index  # [B, L]
    if threshold is not None:
        transfer &= (conf >= threshold) | (ranks == 0)
    return x0, transfer


def shift_right_zero_fill(logits: Tensor, shift: int) -> Tensor:
    """Position p reads logits[p - shift]; the first `shift` positions get zeros. [B, L, V] -> same."""
    if shift == 0:
        return logits
    out = torch.zeros_like(logits)
    out[:, shift:] = logits[:, :-shift]
    return out


# ---- geometry, canvas and the standalone block sampler ---------------------------------------------------------------


@dataclass(frozen=True)
class BlockGeometry:
    gen_length: int  # G: new tokens per row
    num_blocks: int  # nb
    steps_per_block: int  # spb
    block_size: int


def block_geometry(
    max_new_tokens: int, block_size: int | None, steps: int, whole_blocks: bool
) -> BlockGeometry:
    """docs/strategies.md §3.0 step 1. With `whole_blocks` (nemotron) G is a whole number of blocks and
    steps a multiple of nb."""
    bs = block_size or max_new_tokens
    if whole_blocks:
        g = (max_new_tokens // bs) * bs or bs
        nb = g // bs
        total = (steps // nb) * nb or nb
        return BlockGeometry(g, nb, total // nb, bs)
    nb = math.ceil(max_new_tokens / bs)
    return BlockGeometry(max_new_tokens, nb, math.ceil(steps / nb), bs)


@dataclass
class Canvas:
    """Prompts left-aligned, [MASK] over each row's own window [P_b, P_b + G), eos filler after."""

    x: Tensor  # [B, T]
    valid: Tensor  # [B, T] 1 on [0, P_b + G): the attention mask
    gen_start: Tensor  # [B] = P_b
    origin: ClassVar[int] = 0  # a source's block [lo, hi) counts from each row's window start

    def select_rows(self, index: Tensor) -> None:
        """Keep the rows `index` [B'] (in place: the loop and its sources share the canvas)."""
        self.x, self.valid, self.gen_start = self.x[index], self.valid[index], self.gen_start[index]


def build_canvas(prompts: list[list[int]], gen_length: int, mask_id: int, fill_id: int, device) -> Canvas:
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    total = int(lengths.max()) + gen_length
    x = torch.full((len(prompts), total), fill_id, dtype=torch.long, device=device)  # [B, T]
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        x[b, len(p) : len(p) + gen_length] = mask_id
    pos = torch.arange(total, device=device)[None, :]  # [1, T]
    valid = (pos < (lengths + gen_length)[:, None]).long()  # [B, T]
    return Canvas(x, valid, lengths)


@dataclass
class LeftPaddedCanvas:
    """Prompts right-aligned at a common length S (left padding), [MASK] over [S, S + G): every row's
    block j is the same slice, as block-causal decoding (nemotron, llada2) needs."""

    x: Tensor  # [B, S + G]
    valid: Tensor  # [B, S + G] 0 on the left padding
    position_ids: Tensor  # [B, S + G] 0 at each row's first real token
    prefix_len: int  # S

    @property
    def origin(self) -> int:
        """Where every row's window starts: a source's block [lo, hi) is in canvas positions."""
        return self.prefix_len

    @property
    def gen_start(self) -> Tensor:
        return torch.full((self.x.shape[0],), self.prefix_len, device=self.x.device)  # [B]

    def select_rows(self, index: Tensor) -> None:
        """Keep the rows `index` [B'] (in place: the loop and its cache share the canvas). S stays: the
        other rows' padding is still padding, and a row decodes as it would alone at any S."""
        self.x, self.valid, self.position_ids = self.x[index], self.valid[index], self.position_ids[index]


# ---- decoding block by block ------------------------------------------------------------------------


@dataclass
class BlockProgress:
    """What a block loop yields between blocks: per live row, its generated ids so far (the blocks it has
    left, which never change again; untrimmed), whether it stopped at an EOS, and its forwards so far."""

    tokens: list[list[int]]
    done: list[bool]
    row_nfe: list[int]
    row_positions: list[int] = field(default_factory=list)  # positions computed for the row so far


# A block loop: yields BlockProgress between blocks, is sent None or the indices of the rows to keep
# (applied before the next block), returns what its `run_*` form returns.
BlockLoop = Generator[BlockProgress, "list[int] | None", tuple]


@dataclass
class LoopRows:
    """What a block loop tracks per row: its generation window's start, whether it stopped at its EOS,
    its forwards so far, and the live rows (`LiveRows`: still in the forwards, positions computed)."""

    start: Tensor  # [B]
    done: Tensor  # [B] bool
    row_nfe: Tensor  # [B] long
    live: LiveRows

    @classmethod
    def new(cls, start: Tensor) -> LoopRows:
        """Every row live, none stopped, no forward yet; windows starting at `start` [B]."""
        B, device = start.shape[0], start.device
        done = torch.zeros(B, dtype=torch.bool, device=device)
        return cls(start, done, torch.zeros(B, dtype=torch.long, device=device), LiveRows(B, device))

    def retire_done(self, source) -> None:
        """Rows stopped at their EOS leave the live rows and the `source`'s cache."""
        stay = self.live.retire(self.done)
        if stay is not None:
            source.select_rows(stay)


def window_ids(x: Tensor, start: Tensor, length: int) -> list[list[int]]:
    """Each row's first `length` ids of its window ([B] `start` on), untrimmed."""
    return [x[b, s : s + length].tolist() for b, s in enumerate(start.tolist())]


def between_blocks(rows: LoopRows, canvas, upto: int, source=None) -> Generator[BlockProgress, Any, None]:
    """The pause of a block loop after a block: yield each row's first `upto` generated ids (final
    now), then keep the rows the caller sends back (None: all) in `rows`, the canvas and the `source`'s
    cache (`select_rows` of the live rows that stay)."""
    x, start = canvas.x, rows.start
    tokens = window_ids(x, start, upto)
    positions = rows.live.positions.tolist()
    kept = yield BlockProgress(tokens, rows.done.tolist(), rows.row_nfe.tolist(), positions)
    if kept is None:
        return
    index = torch.tensor(kept, dtype=torch.long, device=x.device)
    stay = rows.live.keep(index)
    if source is not None:
        source.select_rows(stay)
    canvas.select_rows(index)
    rows.start, rows.done, rows.row_nfe = start[index], rows.done[index], rows.row_nfe[index]


# Told mid-block of rows whose current block became final: (row indices among the live rows, each row's
# generated ids through that block, untrimmed). Set by `BlockStepper.step(on_settled=...)` around the
# loop's resumption (a generator resumes in its caller's context); None: nobody listens.
SettledListener = Callable[[list[int], list[list[int]]], None]
SETTLED_LISTENER: ContextVar[SettledListener | None] = ContextVar("settled_listener", default=None)


class SettledRows:
    """One block's watch for rows that finish it early. With a threshold (or an EOS) rows of a batch need
    different numbers of forwards for the same block, and the batch decodes until the slowest is done;
    a row's block is final as soon as it holds no [MASK] (or the row stopped), so it is announced then,
    unless no row is left decoding (the block's end reports those). Costs nothing without a listener."""

    def __init__(self, already: Tensor):
        """`already` [B] bool: rows final before the block starts (stopped at an EOS): never announced."""
        self.listener = SETTLED_LISTENER.get()
        self.settled = already.clone() if self.listener is not None else already

    def __bool__(self) -> bool:
        return self.listener is not None

    def update(self, x: Tensor, start: Tensor, stop: Tensor | int, final: Tensor) -> None:
        """`final` [B] bool: rows whose block is final now; announces the newly final ones with their ids
        `x[b, start_b:stop_b]` (`stop` [B] or one int) while some row still decodes the block."""
        if self.listener is None:
            return
        newly = final & ~self.settled  # [B]
        self.settled = self.settled | final
        if bool(self.settled.all()) or not bool(newly.any()):
            return
        rows = newly.nonzero().flatten().tolist()
        ends = stop.tolist() if isinstance(stop, Tensor) else [stop] * x.shape[0]
        starts = start.tolist()
        self.listener(rows, [x[b, starts[b] : ends[b]].tolist() for b in rows])


def drain(loop: BlockLoop):
    """Run a block loop to its end (every row kept); its return value."""
    try:
        while True:
            next(loop)
    except StopIteration as stop:
        return stop.value


def build_left_padded_canvas(
    prompts: list[list[int]], gen_length: int, mask_id: int, fill_id: int, device, *, sampler: str = "this"
) -> LeftPaddedCanvas:
    if any(len(p) == 0 for p in prompts):
        raise UserError(f"sampler {sampler} needs a non-empty prompt for every row")
    S = max(len(p) for p in prompts)
    x = torch.full((len(prompts), S + gen_length), fill_id, dtype=torch.long, device=device)  # [B, T]
    valid = torch.zeros_like(x)
    for b, p in enumerate(prompts):
        x[b, S - len(p) : S] = torch.tensor(p, dtype=torch.long, device=device)
        valid[b, S - len(p) :] = 1
    x[:, S:] = mask_id
    # Positions restart at each row's first real token, so a padded row sees what it would alone.
    return LeftPaddedCanvas(x, valid, row_positions(valid), S)


def commit_step(
    logits: Tensor,
    candidates: Tensor,
    x: Tensor,
    scheduled: Tensor,
    last: bool,
    cfg: BlockConfig,
    mask_id: int,
    generator: torch.Generator | None = None,
) -> None:
    """One denoising step in place on `x` [B, L] (a view of the canvas): logits [B, L, V] (the [MASK]
    column is overwritten), candidates [B, L] bool, scheduled [B] = the schedule's count. The block's
    last step commits every candidate left (caveat 6: never strand masks), without the threshold."""
    logits[..., mask_id] = -math.inf  # a committed position must never hold [MASK]
    k = candidates.sum(dim=1) if last else scheduled
    threshold = None if last else cfg.threshold
    x0, transfer = get_transfer_index(
        logits, cfg.temperature, cfg.remasking, candidates, x, k, threshold, generator
    )
    x[transfer] = x0[transfer]


class FullForward:
    """The uncached logits source of `iter_block_loop` on a `Canvas`: each call forwards the rows that
    still have masks in their block (a row stopped at its EOS, or done with the block while others are
    not, is not computed), only as wide as the longest of them needs, with `logits_to_keep` when the
    forward takes it. `source(lo, hi, rows)`: [lo, hi) counts from each row's window start; the logits
    [R, n, V] are those of the canvas columns `cols`. logit_shift: position p reads logits[p - shift]
    (I-DLM's next-token checkpoints: 1)."""

    def __init__(self, forward: ForwardFn, canvas: Canvas, logit_shift: int = 0):
        self.forward, self.c, self.shift = forward, canvas, logit_shift
        self.keep_arg = takes_logits_to_keep(forward)
        self.calls = 0

    def rows(self, needs: Tensor, live: LiveRows) -> Tensor:
        """The rows a step forwards: those with masks left in their block ([B] `needs`)."""
        return needs.nonzero().flatten()  # [R]

    def select_rows(self, index: Tensor) -> None:
        pass  # no state of its own: the canvas is shared with the loop, which selects it

    def __call__(self, lo: int, hi: int, rows: Tensor) -> Tensor:
        c = self.c
        width = int(c.valid[rows].sum(dim=1).max())  # each row's attention is [0, end)
        # Only the rows' blocks are filled now, and with prompts left-aligned and filler after, their union
        # lies in the suffix from the earliest block start on (plus the `logit_shift` positions read from
        # before it): logits for that suffix alone (the LM head then skips the prompts and the committed
        # blocks). Same commits: candidates keep their order.
        keep = min(width, width - int((c.gen_start[rows] + lo).min()) + self.shift)
        kw = {"logits_to_keep": keep} if self.keep_arg else {}
        logits = self.forward(c.x[rows, :width], c.valid[rows, :width], **kw)[:, -keep:]
        self.calls += 1
        self.span, self.cols = (0, width), (width - keep, width)
        return shift_right_zero_fill(logits, self.shift)  # [R, keep, V]


def iter_block_loop(
    source,
    canvas: Canvas | LeftPaddedCanvas,
    cfg: BlockConfig,
    geometry: BlockGeometry,
    mask_id: int,
    fill_id: int,
    generator: torch.Generator | None = None,
) -> BlockLoop:
    """Semi-autoregressive block decoding (docs/strategies.md §3.0 step 4), in place on `canvas.x`, one
    block at a time (a `BlockLoop`; `drain` runs it whole): block j of row b covers its window's
    [j*bs, min((j+1)*bs, G)); per block the transfer schedule, per step `commit_step` (selection,
    threshold, the last step commits the rest) and the per-row EOS stop. The logits come from `source`:
    `FullForward` (no cache), `kv.CausalShiftCache` (exact), `kv.FastDLLMCache` (prefix, dual). A
    source is called `source(lo, hi, rows)` for the block [lo, hi) (from `canvas.origin`) of the rows
    `source.rows(needs, live)` and leaves the canvas columns its logits cover in `cols`, those its
    forward computed in `span`, its forwards in `calls`; rows leave it through `select_rows` (a row
    stopped at its EOS at once). -> (nfe, row_nfe [B] = forwards made while the row still had masks to
    fill, positions [B] = canvas positions those forwards computed for the row)."""
    G, bs, spb = geometry.gen_length, geometry.block_size, geometry.steps_per_block
    eos = cfg.eos_token_id
    truncate = getattr(cfg, "eos_truncate", False) and eos is not None
    pos = torch.arange(canvas.x.shape[1], device=canvas.x.device)[None, :]  # [1, T]
    state = LoopRows.new(canvas.gen_start)
    for j in range(geometry.num_blocks):
        if j:
            yield from between_blocks(state, canvas, j * bs, source)
        x, start, done, row_nfe, live = canvas.x, state.start, state.done, state.row_nfe, state.live
        first, stop = j * bs, min((j + 1) * bs, G)  # the block in each row's window
        in_block = (pos >= (start + first)[:, None]) & (pos < (start + stop)[:, None])  # [B, T]
        schedule = get_num_transfer_tokens(in_block & (x == mask_id), spb)  # [B, spb]
        settled = SettledRows(done)
        for i in range(spb):
            candidates = in_block & (x == mask_id) & ~done[:, None]  # [B, T]
            needs = candidates.any(dim=1)  # [B]
            if not needs.any():
                break
            r = source.rows(needs, live)  # [R] the rows this forward computes
            row_nfe[r] += needs[r].long()  # forwards a row needed, not the batch's
            logits = source(canvas.origin + first, canvas.origin + stop, r)  # [R, n, V]
            live.computed(r, canvas.valid[r, source.span[0] : source.span[1]])
            a, b = source.cols
            last = i == spb - 1
            sub = x[r, a:b]  # [R, n] a copy: written back below
            commit_step(logits, candidates[r, a:b], sub, schedule[r, i], last, cfg, mask_id, generator)
            x[r, a:b] = sub
            if truncate:
                truncate_after_eos(x, canvas.valid, start, G, eos, fill_id)
            if eos is not None:
                done |= first_eos_done(x, start, G, eos, mask_id)
            if settled and not last:
                settled.update(x, start, start + stop, ~(in_block & (x == mask_id)).any(dim=1) | done)
            state.retire_done(source)
        if not len(live):  # every row stopped at its EOS
            break
    # Rows stopped early: their leftover masks become filler (trimmed away after the EOS).
    x, start = canvas.x, state.start
    window = (pos >= start[:, None]) & (pos < (start + G)[:, None])  # [B, T]
    x[window & (x == mask_id)] = fill_id
    return source.calls, state.row_nfe, state.live.positions


def run_infill(
    forward: ForwardFn,
    seqs: list[list[int]],
    cfg: BlockConfig,
    mask_id: int,
    fill_id: int,
    device,
    generator: torch.Generator | None = None,
    logit_shift: int = 0,
) -> tuple[Tensor, Tensor, int]:
    """Fill every [MASK] of `seqs` in place (docs/strategies.md §3.0 "Infill"): blocks of `block_size` over the whole
    sequence, the transfer schedule per block, full forwards (logit shift applied), no threshold.
    Returns (x [B, T], lengths [B], nfe)."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # [B]
    total = int(lengths.max())
    x = torch.full((len(seqs), total), fill_id, dtype=torch.long, device=device)  # [B, T]
    for b, s in enumerate(seqs):
        x[b, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    pos = torch.arange(total, device=device)[None, :]  # [1, T]
    attn = (pos < lengths[:, None]).long()  # [B, T]
    bs = cfg.block_size or total
    nb = math.ceil(total / bs)
    spb = math.ceil(cfg.steps / nb)
    nfe = 0
    for j in range(nb):
        in_block = (pos >= j * bs) & (pos < (j + 1) * bs) & attn.bool()  # [B, T]
        schedule = get_num_transfer_tokens(in_block & (x == mask_id), spb)  # [B, spb]
        for i in range(spb):
            candidates = in_block & (x == mask_id)
            if not candidates.any():
                break
            logits = shift_right_zero_fill(forward(x, attn), logit_shift)  # [B, T, V]
            logits[..., mask_id] = -math.inf
            nfe += 1
            k = candidates.sum(dim=1) if i == spb - 1 else schedule[:, i]
            x0, transfer = get_transfer_index(
                logits, cfg.temperature, cfg.remasking, candidates, x, k, None, generator
            )
            x[transfer] = x0[transfer]
    return x, lengths, nfe
