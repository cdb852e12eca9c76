"""`DLLMCollator`: pads prepared rows into a batch with the two-stage rule of docs/strategies.md §1.3.

    collate = DLLMCollator.from_settings(settings, tokenizer)
    batch = collate([ds[0], ds[1]])   # input_ids [B,T] long, loss_mask [B,T] float,
                                      # attention_mask [B,T] long, input_lengths [B] long

Stage 1 fills each row from its content length `cl` up to a block boundary `fill_end` with the block
pad (EOS, else pad), supervised, so a diffusion model learns to emit EOS after the answer. Stage 2
pads every row to the batch length `T` (the longest fill, rounded up to lcm(block, divisible), capped
at `max_seq_len`) with the pad token, supervised only with `supervise_padding`. In response-window
mode (block diffusion) blocks are aligned to the first supervised token and the block fill is
attended; that mode trains single-turn data only, which is checked on every batch. With
`dataset.packing` rows are packed several to a sequence instead (`dllmflow.data.pack`; `build_collator` picks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dllmflow.errors import UserError


def supervised_runs(loss_mask: Sequence[int]) -> int:
    """Number of contiguous runs of supervised (non-zero) positions."""
    runs, prev = 0, 0
    for m in loss_mask:
        if m and not prev:
            runs += 1
        prev = m
    return runs


class DLLMCollator:
    def __init__(
        self,
        pad_token_id: int | None,
        eos_token_id: int | None,
        block_size: int | None = None,
        pad_seq_len_divisible: int | None = None,
        max_seq_len: int | None = None,
        supervise_padding: bool = False,
        response_window: bool = False,
    ):
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.eos_token_id = eos_token_id
        self.block_size = block_size if block_size and block_size > 1 else None
        self.pad_seq_len_divisible = pad_seq_len_divisible
        self.max_seq_len = max_seq_len
        self.supervise_padding = supervise_padding
        self.response_window = response_window
        # The block fill teaches "stop here": EOS when there is one.
        self.block_pad_id = self.pad_token_id if eos_token_id is None else int(eos_token_id)

    @classmethod
    def from_settings(cls, settings, tokenizer) -> DLLMCollator:
        """This class's collator for the run (`dllmflow.data.pack.build_collator` picks the class: packed
        when `dataset.packing` is set)."""
        dllm = settings.dllm
        return cls(
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            block_size=dllm.pad_block_size,
            pad_seq_len_divisible=dllm.pad_seq_len_divisible,
            max_seq_len=settings.dataset.seq_length,
            supervise_padding=dllm.supervise_padding,
            response_window=dllm.response_window,  # a fact of the mode config (block_diffusion)
            **cls.extra_settings(settings),
        )

    @classmethod
    def extra_settings(cls, settings) -> dict:
        """Constructor arguments a subclass reads from the settings besides the shared ones."""
        return {}

    # 1) stage-1 fill end of one row
    def _fill_end(self, content_len: int, loss_mask: list[int]) -> int:
        capped = content_len if self.max_seq_len is None else min(content_len, self.max_seq_len)
        if self.block_size is None:
            return capped
        prefix = 0
        if self.response_window:
            prefix = next((i for i, m in enumerate(loss_mask) if m), capped)
            prefix = min(prefix, capped)
        return prefix + math.ceil((capped - prefix) / self.block_size) * self.block_size

    # 2) batch length
    def _target_len(self, fill_ends: list[int]) -> int:
        T = max(fill_ends, default=0)
        d = self.pad_seq_len_divisible
        if d and d > 1:
            m = math.lcm(self.block_size or 1, d)
            T = math.ceil(T / m) * m
        if self.max_seq_len is not None:
            T = min(T, self.max_seq_len)
        return max(T, 1)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids_list = [_as_list(r["input_ids"]) for r in rows]
        mask_list = [_as_list(r["loss_mask"]) for r in rows]
        if self.response_window:
            for b, m in enumerate(mask_list):
                n = supervised_runs(m)
                if n > 1:
                    raise UserError(
                        f"batch row {b} (id {rows[b].get('id', '?')}) has {n} supervised runs; response-window "
                        "mode (dllm.mode=block_diffusion) trains single-turn data: set dataset.mask_history: true"
                    )
        lengths = [len(x) for x in ids_list]
        fill_ends = [self._fill_end(cl, m) for cl, m in zip(lengths, mask_list)]
        B, T = len(rows), self._target_len(fill_ends)

        # 3) fill: content | block pad (supervised) | global pad
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)  # [B, T]
        loss_mask = torch.full((B, T), float(self.supervise_padding), dtype=torch.float32)  # [B, T]
        attention_mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
        fill_attention = 1 if self.response_window else 0
        for b, (ids, m, cl, fe) in enumerate(zip(ids_list, mask_list, lengths, fill_ends)):
            n = min(cl, T)
            input_ids[b, :n] = torch.tensor(ids[:n], dtype=torch.long)
            loss_mask[b, :n] = torch.tensor(m[:n], dtype=torch.float32).clamp_(0, 1)
            attention_mask[b, :n] = 1
            end = min(fe, T)
            if end > n:
                input_ids[b, n:end] = self.block_pad_id
                loss_mask[b, n:end] = 1.0
                attention_mask[b, n:end] = fill_attention
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "attention_mask": attention_mask,
            "input_lengths": torch.tensor(lengths, dtype=torch.long),  # [B], unclamped content lengths
        }


def _as_list(x) -> list[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)
