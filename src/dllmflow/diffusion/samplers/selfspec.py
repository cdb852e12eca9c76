"""`selfspec`: lossless self-speculative decoding of a `causal_blocks` model (docs/strategies.md §3.10).

A `causal_blocks` model (§2.10) is a causal LM that also guesses ahead from [MASK] slots appended after
a clean prefix: slot t's logit guesses the token t + 1 places past the first slot (the lookahead loss).
So one causal forward both checks the last drafts and drafts the next ones:

    input  = [last committed token | drafts d_1..d_D | D [MASK] slots]     positions n, n+1, ...
    e_i    = argmax of the logit after the committed token and d_1..d_i     (the model's own greedy choice)
    accept = the longest prefix with d_i == e_i; commit e_0..e_j            (j drafts + one more token)
    drafts = e_{j+1}..e_D (the choices after a rejected draft: Jacobi's guesses), then the slots'
             guesses (the view they were trained on when every draft was accepted)

Every committed token is the model's greedy choice after exact tokens, so the answer is the one the `ar`
sampler gives on the same model (a unit test compares them), in fewer forwards: a forward commits one
token plus the drafts it accepts. `block_size` (preset 8, at most the model's `dllm.block_size`, the
lookahead it was trained for) is the most a forward can commit: D = block_size - 1 drafts.

KV cache only (exact: causal attention keeps every cached key final). The prompt and every committed
token stay cached; a rejected draft's keys stay behind as a hole its row's key mask blocks, and the
[MASK] slots are cropped after each forward. A row stops at its first stop id (or max_new_tokens) and
leaves the batch; a stop id is never fed as a draft (the token before it checks it), and when every live
row's drafts hold one the forward feeds no [MASK] slots. What a row committed is final: the loop pauses
before each forward but the first (`Sampler.stepper`), where a server streams it and may drop rows.
`batch_positions` caps the positions a forward feeds across the live rows (fewer drafts and slots per
row, down to plain ar steps, while the batch is large: on a CPU each position there is compute); the
drafts come back as rows finish. `draft_schedule: adaptive` sizes each forward by the last check's
acceptance instead (a long answer's drafts miss in runs, and a missed draft and its slot are paid positions);
drafts copied by `lookup_ngram` are fed whole past that span (a copy holds for a run or misses at once).

    cfg = build_sampler_config("selfspec", {"max_new_tokens": 64})
    out = SAMPLERS["selfspec"](model, tokenizer, cfg).generate([ids_a, ids_b])   # GenerationResult
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from dllmflow.diffusion.masks.causal import causal_mask

from .base import Sampler
from .configs import SelfSpecConfig
from .kv import ModelCache, check_cache_fits
from .loop import BlockLoop, build_left_padded_canvas, drain
from .token_steps import pause_rows


@dataclass
class SpecRows:
    """Per live row: the cache's valid keys, the committed token not yet fed (and its position), the
    drafts for the positions after it, and the row's original index."""

    keys: Tensor  # [b, K] bool
    pending: Tensor  # [b]
    position: Tensor  # [b]
    drafts: Tensor  # [b, D]
    index: Tensor  # [b]

    def select(self, keep: Tensor) -> None:
        for name in ("keys", "pending", "position", "drafts", "index"):
            setattr(self, name, getattr(self, name)[keep])


def lookup_drafts(context: list[int], n: int, most: int) -> list[int]:
    """Prompt-lookup drafts: the (up to `most`) tokens that followed the latest earlier occurrence of the
    context's last k tokens, for k = n down to 1 (the longest suffix that recurs); [] when none does."""
    for k in range(min(n, len(context) - 1), 0, -1):
        tail = context[-k:]
        for start in range(len(context) - k - 1, -1, -1):  # latest first; the tail itself excluded
            if context[start : start + k] == tail:
                return context[start + k : start + k + most]
    return []


def slot_groups(fed: int, slots: int, groups: int) -> list[int]:
    """After which of the `fed` drafts a group of `slots` [MASK] slots sits (0: right after the pending
    token), `groups` of them spread over 0..fed, always the one after the last draft; [] without slots."""
    if not slots:
        return []
    n = min(groups, fed + 1)
    if n == 1:
        return [fed]
    return sorted({round(i * fed / (n - 1)) for i in range(n)})


def groups_keep(fed: int, slots: int, groups: list[int], device: torch.device) -> Tensor:
    """Which new positions each new position of a grouped forward sees [Q, Q] bool (Q = 1 + fed +
    len(groups) * slots): the pending token and drafts causally; a slot of the group after draft g the
    pending token, drafts 1..g and its own group's slots up to itself: the view it was trained on
    (masks/drafting.py), whatever the check accepts."""
    Q = 1 + fed + len(groups) * slots
    keep = torch.ones(Q, Q, device=device).tril().bool()  # [Q, Q]
    for i, g in enumerate(groups):
        start = 1 + fed + i * slots
        rows = slice(start, start + slots)
        keep[rows, g + 1 : start] = False  # the drafts after g and the other groups' slots
        keep[rows, start : start + slots] = torch.ones(slots, slots, device=device).tril().bool()
    return keep


def accepted_drafts(drafts: Tensor, greedy: Tensor) -> Tensor:
    """How many leading drafts equal the model's greedy choices: drafts, greedy [b, D] -> [b] in 0..D."""
    return (drafts == greedy).long().cumprod(dim=1).sum(dim=1)


class SelfSpecSampler(Sampler):
    name = "selfspec"
    config_cls: ClassVar[type[SelfSpecConfig]] = SelfSpecConfig
    supports_infill = False

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], int, list[int], list[int]]:
        return drain(self._iter_generate(prompt_ids))

    def _iter_generate(self, prompt_ids: list[list[int]]) -> BlockLoop:
        """The decoding, paused before each forward after the first (a `loop.BlockLoop`: what a row has
        committed is final, so a server streams it and may drop rows there)."""
        G, D = self.config.max_new_tokens, self.config.block_size - 1
        self._span = D  # drafts (and slots) per row of the next forward; `draft_schedule: adaptive` moves it
        c = build_left_padded_canvas(
            prompt_ids, 0, self.mask_id, self.fill_id, self.device, sampler=self.name
        )
        check_cache_fits(self.model, c.x.shape[1] + G + D, self.name, "its drafts")
        B, S, dev = len(prompt_ids), c.prefix_len, c.x.device
        kv = ModelCache(self.model, dev)
        out: list[list[int]] = [[] for _ in range(B)]
        row_nfe, positions = [0] * B, [0] * B
        self.draft_counts = ([0] * D, [0] * D)  # per offset: checks that fed that draft, that accepted it
        stop = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=dev)  # [n_stop]
        ahead = torch.arange(D, device=dev)  # [D]

        # The prompts, then W [MASK] slots at the positions after each prompt: the first token and drafts.
        n = c.valid.sum(dim=1)  # [B] each prompt's length = the position of its first new token
        W = self._width(B, D)
        ids = torch.cat([c.x, torch.full((B, W), self.mask_id, dtype=c.x.dtype, device=dev)], dim=1)
        valid = torch.cat([c.valid.bool(), torch.ones(B, W, dtype=torch.bool, device=dev)], dim=1)
        pos = torch.cat([c.position_ids, n[:, None] + ahead[None, :W]], dim=1)  # [B, S + W]
        logits = self._forward_new(kv, valid, ids, pos, S - 1)  # [B, 1 + W, V]
        kv.truncate(S)
        guess = logits.argmax(-1)  # [B, 1 + W]: the first token, then the slots' drafts
        drafts = torch.cat([guess[:, 1:], torch.full((B, D - W), self.fill_id, device=dev)], dim=1)  # [B, D]
        rows = SpecRows(c.valid.bool(), guess[:, 0], n, drafts, torch.arange(B, device=dev))
        done = self._commit(out, rows, [[t] for t in guess[:, 0].tolist()], row_nfe, positions, valid.sum(1))
        # the drafts every row holds that a forward made (the rest is filler, not worth feeding); looked up
        # after the commit, so a copied draft follows the text committed so far
        real, copied = self._lookup(rows, prompt_ids, out, torch.full((B,), W, device=dev))
        batch = list(range(B))  # the rows the caller holds (it may drop some between forwards), in its order

        while True:
            computing = ~done  # [b] rows still decoding
            if bool(computing.any()):
                live = set(rows.index[computing].tolist())
                batch = yield from pause_rows(batch, out, live, row_nfe, positions)
                computing &= torch.isin(rows.index, torch.tensor(batch, device=dev))
            keep = computing.nonzero().squeeze(1)  # [b]
            if not len(keep):
                break
            if len(keep) < len(done):
                rows.select(keep)
                kv.select_rows(keep)
            b, K = len(keep), kv.length
            F, W = self._feed(rows.drafts, real, copied, stop)
            fed = rows.drafts[:, :F]  # [b, F]
            groups = slot_groups(
                F, W, self.config.slot_groups
            )  # a group of W slots after each of these drafts
            Q = 1 + F + len(groups) * W
            masks = torch.full((b, Q - 1 - F), self.mask_id, dtype=rows.drafts.dtype, device=dev)
            ids = torch.cat([rows.pending[:, None], fed, masks], dim=1)  # [b, Q]
            rel = torch.tensor(list(range(1 + F)) + [g + 1 + t for g in groups for t in range(W)], device=dev)
            pos = rows.position[:, None] + rel[None]  # [b, Q]
            new = torch.ones(b, Q, dtype=torch.bool, device=dev)
            mask = causal_mask(torch.cat([rows.keys, new], 1), kv.dtype, K, Q)  # [b, 1, Q, K + Q]
            if len(groups) > 1:  # each group sees the drafts up to its own, not the ones after
                mask[..., K:] = torch.where(groups_keep(F, W, groups, dev), 0.0, torch.finfo(kv.dtype).min)
            logits = kv.forward(ids, mask, pos, 0, Q)  # [b, Q, V]
            greedy = logits[:, : 1 + F].argmax(-1)  # [b, 1 + F]: e_i follows draft i (e_0: the fed token)
            j = accepted_drafts(fed, greedy[:, :F])  # [b]
            self._count_drafts(F, j)
            self._adapt(F, W, j)
            # Keep the fed token's and the accepted drafts' keys; a rejected draft's become a hole.
            kv.truncate(K + 1 + F)
            rows.keys = torch.cat([rows.keys, torch.arange(1 + F, device=dev)[None] <= j[:, None]], dim=1)
            committed = [g[: int(a) + 1].tolist() for g, a in zip(greedy, j)]  # e_0..e_j of each row
            rows.pending = greedy.gather(1, j[:, None]).squeeze(1)
            rows.position = rows.position + j + 1
            slots = logits[:, 1 + F :].argmax(-1).view(b, len(groups), W)  # [b, G, W]
            made = self._next_drafts(rows, greedy[:, 1:], slots, groups, j)  # [b]
            done = self._commit(out, rows, committed, row_nfe, positions, torch.full((b,), Q))
            real, copied = self._lookup(rows, prompt_ids, out, made)
        return [out[r] for r in batch], kv.calls, [row_nfe[r] for r in batch], [positions[r] for r in batch]

    def _next_drafts(
        self, rows: SpecRows, choices: Tensor, slots: Tensor, groups: list[int], j: Tensor
    ) -> Tensor:
        """Set each row's next drafts after its check accepted j [b] of the F drafts (`choices` [b, F]: the
        model's choice after each draft; `slots` [b, G, W]: each group's guesses) -> [b] how many are real.
        A row that accepted exactly the drafts a group followed takes that group's guesses (made from the
        exact prefix); else the model's choices after the drafts it rejected (they followed a wrong token,
        but often still hold: Jacobi's guesses), then the last group's guesses when it follows every draft;
        filler where neither reaches. Every draft is checked anyway."""
        F, W, D = choices.shape[1], slots.shape[2], rows.drafts.shape[1]
        filler = torch.full_like(rows.drafts, self.fill_id)  # [b, D]
        last = slots[:, -1] if groups and groups[-1] == F else choices[:, :0]  # [b, W or 0]: all accepted
        after = torch.cat([choices, last, filler], dim=1)  # [b, F + W + D]
        rows.drafts = after.gather(1, j[:, None] + torch.arange(D, device=j.device)[None])  # [b, D]
        made = last.shape[1] + F - j  # [b]: F - j choices, the last group's slots
        for i, g in enumerate(groups[:-1] if last.shape[1] else groups):
            hit = j == g  # [b] rows that accepted exactly the drafts group i followed
            rows.drafts[hit] = torch.cat([slots[hit, i], filler[hit]], dim=1)[:, :D]
            made[hit] = W
        return made

    def _lookup(
        self, rows: SpecRows, prompt_ids: list[list[int]], out: list[list[int]], made: Tensor
    ) -> tuple[int, int]:
        """`lookup_ngram` n > 0: each live row whose last n tokens (prompt and answer so far) occurred
        before takes the tokens that followed there as its drafts (`lookup_drafts`), in place of the
        forward's; -> (the drafts every row holds that are not filler (`made` [b]: the forward's count),
        the most drafts a row copied: 0 when none did)."""
        n, D, most = self.config.lookup_ngram, rows.drafts.shape[1], 0
        if n:
            for i, r in enumerate(rows.index.tolist()):
                copied = lookup_drafts(prompt_ids[r] + out[r], n, D)
                if copied:
                    rows.drafts[i] = self.fill_id
                    rows.drafts[i, : len(copied)] = torch.tensor(copied, dtype=rows.drafts.dtype)
                    made[i] = len(copied)
                    most = max(most, len(copied))
        return int(made.min()), most

    def _count_drafts(self, fed: int, accepted: Tensor) -> None:
        """Add one check of `fed` drafts per live row, `accepted` [b] of them, to `draft_counts`."""
        counts = torch.bincount(accepted, minlength=fed + 1).tolist()  # rows by drafts accepted
        for k in range(1, fed + 1):
            self.draft_counts[0][k - 1] += len(accepted)
            self.draft_counts[1][k - 1] += sum(counts[k:])

    def _adapt(self, fed: int, slots: int, accepted: Tensor) -> None:
        """`draft_schedule: adaptive`: the next forward's width from this check's acceptance [b] (the best
        row's): one more than its accepted drafts, 2 more when it accepted every one it was fed, between 1
        and block_size - 1. A forward that fed no drafts (or no slots: every row was ending) says nothing."""
        if self.config.draft_schedule != "adaptive" or not fed or not slots:
            return
        best = int(accepted.max())
        self._span = max(1, min(self.config.block_size - 1, best + (2 if best == fed else 1)))

    def _feed(self, drafts: Tensor, real: int, copied: int, stop: Tensor) -> tuple[int, int]:
        """(F, W): how many of the live rows' drafts [b, D] a forward feeds, at most the `real` ones
        (made by a forward or copied), and how many [MASK] slots (F = W = D without a batch_positions cap).
        `copied` drafts (the most a row's lookup found) are fed whole, past the adaptive span: a copy holds
        for a run or misses at once, where the span follows the slots' guesses. A stop draft is never fed
        (the position before it checks it, and nothing after it is committed), and when every row's
        drafts end its answer no slots are (none would be needed if accepted)."""
        W = self._width(len(drafts), drafts.shape[1])
        F = min(self._width(len(drafts), drafts.shape[1], copied), real)
        if not F:
            return 0, W
        is_stop = torch.isin(drafts[:, :F], stop)  # [b, F]
        ends = is_stop.any(dim=1)  # [b] the row's drafts end its answer
        if not bool(ends.all()):
            return F, W
        return int(is_stop.long().argmax(dim=1).max()), 0

    def _width(self, rows: int, most: int, copied: int = 0) -> int:
        """Drafts (and slots) per row of a forward over `rows` live rows: `most`, at most the adaptive
        schedule's span (or the `copied` drafts where more), unless `batch_positions` caps the forward's
        1 + (1 + slot_groups) * width positions per row."""
        cap, most = self.config.batch_positions, min(most, max(self._span, copied))
        return most if cap is None else max(0, min(most, (cap // rows - 1) // (1 + self.config.slot_groups)))

    def _forward_new(self, kv: ModelCache, keys: Tensor, ids: Tensor, pos: Tensor, first: int) -> Tensor:
        """Append `ids` [b, Q] at positions `pos` to the cache, causally over the valid keys `keys`
        [b, K + Q] (the cached ones, then the new ones: a hole is never attended); the logits of the new
        positions from `first` (relative to the cache's start) on [b, K + Q - first, V]."""
        K, Q = kv.length, ids.shape[1]
        mask = causal_mask(keys, kv.dtype, K, Q)  # [b, 1, Q, K + Q]
        return kv.forward(ids, mask, pos, first - K, Q)

    def _commit(
        self,
        out: list[list[int]],
        rows: SpecRows,
        committed: list[list[int]],
        row_nfe: list[int],
        positions: list[int],
        fed: Tensor,
    ) -> Tensor:
        """Append each live row's committed tokens (up to and with its first stop id, at most
        max_new_tokens) and count the forward and its `fed` [b] positions -> [b] bool: the row is done."""
        done = []
        for r, tokens, n in zip(rows.index.tolist(), committed, fed.tolist()):
            row_nfe[r] += 1
            positions[r] += n
            for t in tokens:
                if len(out[r]) >= self.config.max_new_tokens:
                    break
                out[r].append(t)
                if t in self.stop_ids:
                    break
            done.append(
                len(out[r]) >= self.config.max_new_tokens or bool(out[r]) and out[r][-1] in self.stop_ids
            )
        return torch.tensor(done, dtype=torch.bool, device=rows.index.device)
