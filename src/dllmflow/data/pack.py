"""Sequence packing: several prepared rows (documents) share one training sequence, docs/strategies.md §1.8.

    collate = build_collator(settings, tokenizer)   # a PackedCollator when dataset.packing, else DLLMCollator
    batch = collate(rows)    # input_ids / loss_mask / attention_mask / position_ids / document_ids [R, T],
                             # document_index [N] (which input row each document is), input_lengths [N]

Packing happens at batch time, over the rows of one micro-batch (never across micro-batches, steps or
ranks): `training.data.GlobalBatches` still hands each rank the same rows at each step, so resuming at
step s is still just asking for step s, and each document keeps its own global position, hence its own
noise seed. Each document is first laid out exactly as the unpacked collator lays out a row (content,
then its stage-1 block fill, docs/strategies.md §1.3); the documents are then placed first-fit
decreasing into sequences of `max_seq_len` (= `dataset.seq_length`) tokens, and every sequence is
padded to the batch length `T` (stage 2). A document whose laid-out length exceeds the sequence is cut
there (`overflow="truncate"`, the cut the unpacked collator makes) or left out (`overflow="drop"`);
`packing_truncated` / `packing_dropped` count them per batch (the trainer logs their sums per step).

Per position the batch says whose it is: `document_ids` (the document's index n in `document_index`,
-1 = padding) and `position_ids` (0, 1, ... from each document's start). The model attends only within
a document (`dllmflow.models.doc_attention`), and corruption draws each document as its own row
(`dllmflow.diffusion.corruption.per_document`), so a packed batch has the loss of the unpacked one.
"""

from __future__ import annotations

from typing import Literal

import torch

from dllmflow.data.collate import DLLMCollator, _as_list

Overflow = Literal["truncate", "drop"]
PACKING_STATS = ("packing_truncated", "packing_dropped")  # per-batch counters, summed per step


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items by decreasing length (ties in input order), each into the first bin
    with room, else a new one. Deterministic, so a batch packs the same way on every run."""
    bins: list[list[int]] = []
    room: list[int] = []
    for n in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((k for k, r in enumerate(room) if r >= lengths[n]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(n)
        room[slot] -= lengths[n]
    return bins


def build_collator(settings, tokenizer) -> DLLMCollator:
    """The run's collator: packed when `dataset.packing` is set, else one row per sequence."""
    kind = PackedCollator if settings.dataset.packing else DLLMCollator
    return kind.from_settings(settings, tokenizer)


class PackedCollator(DLLMCollator):
    """`DLLMCollator` that packs its rows into as few sequences of `max_seq_len` as first-fit finds."""

    @classmethod
    def extra_settings(cls, settings) -> dict:
        return {"overflow": settings.dataset.packing_overflow}

    def __init__(self, *args, overflow: Overflow = "truncate", **kw):
        super().__init__(*args, **kw)
        if self.max_seq_len is None:
            raise ValueError("PackedCollator needs max_seq_len (dataset.seq_length): the sequence to fill")
        if self.supervise_padding or self.response_window:
            raise ValueError(
                "dataset.packing: padding cannot be supervised (dllm.supervise_padding) and the "
                "response-window layout (block_diffusion) cannot be packed"
            )
        if overflow not in ("truncate", "drop"):
            raise ValueError(f"dataset.packing_overflow must be truncate or drop, got {overflow!r}")
        self.overflow = overflow

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        L = int(self.max_seq_len)
        # 1) each row as the unpacked collator lays it out: content, then its block fill
        docs, truncated, dropped = [], 0, 0
        for b, row in enumerate(rows):
            ids, mask = _as_list(row["input_ids"]), _as_list(row["loss_mask"])
            length = self._fill_end(len(ids), mask)
            if max(length, len(ids)) > L:
                if self.overflow == "drop":
                    dropped += 1
                    continue
                truncated += 1
            docs.append((b, ids, mask, min(length, L)))
        # 2) place the documents; the batch length follows the stage-2 rule on the fullest sequence
        bins = first_fit_decreasing([d[3] for d in docs], L) or [[]]
        R = len(bins)
        T = self._target_len([sum(docs[n][3] for n in members) for members in bins])
        input_ids = torch.full((R, T), self.pad_token_id, dtype=torch.long)  # [R, T]
        loss_mask = torch.zeros((R, T), dtype=torch.float32)  # [R, T]
        attention_mask = torch.zeros((R, T), dtype=torch.long)  # [R, T]
        position_ids = torch.zeros((R, T), dtype=torch.long)  # [R, T]
        document_ids = torch.full((R, T), -1, dtype=torch.long)  # [R, T], -1 = padding
        # 3) write each document at its place: content (attended), then its fill (supervised, not attended)
        for r, members in enumerate(bins):
            start = 0
            for n in members:
                _, ids, mask, length = docs[n]
                cl = min(len(ids), length)
                span = slice(start, start + length)
                input_ids[r, start : start + cl] = torch.tensor(ids[:cl], dtype=torch.long)
                input_ids[r, start + cl : start + length] = self.block_pad_id
                loss_mask[r, span] = 1.0
                loss_mask[r, start : start + cl] = torch.tensor(mask[:cl], dtype=torch.float32).clamp_(0, 1)
                attention_mask[r, start : start + cl] = 1
                position_ids[r, span] = torch.arange(length)
                document_ids[r, span] = n
                start += length
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "document_ids": document_ids,
            "document_index": torch.tensor([d[0] for d in docs], dtype=torch.long),  # [N] input row of doc n
            "input_lengths": torch.tensor([len(d[1]) for d in docs], dtype=torch.long),  # [N]
            "packing_truncated": torch.tensor(truncated),
            "packing_dropped": torch.tensor(dropped),
        }
