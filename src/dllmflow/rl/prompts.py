"""The GRPO prompt set: a prepared split's questions and reference answers, asked as evaluation asks them.

    prompts = PromptSet(settings.dataset.prepared_dir, "train", tokenizer, limit=None)
    prompts[i]                          # Prompt(index, ids, question, answer)
    prompts.step_positions(step, 8, rank, world)   # global positions of this rank's prompts at `step`
    prompts.at(position, seed)          # the prompt at a global position (a seeded shuffle per epoch)

A prompt is the row's chat without its last assistant turn, rendered with the chat template and the
generation prompt (`data.task.task_chats`, zero-shot), so the policy is trained on exactly
what `dllmflow evaluate` asks. The answer is the row's reference text ("#### 085"), which the rewards
compare with. Step s uses global positions s*N .. s*N+N-1 of an endless stream that visits every
prompt once per epoch in an order seeded by (train.seed, epoch); rank r takes positions r, r+W, ...
So which prompt a position holds depends on neither the world size nor a restart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dllmflow.errors import UserError


@dataclass(frozen=True)
class Prompt:
    index: int  # row in the split
    ids: list[int]  # the rendered prompt's token ids
    question: str  # the last user turn (what a reward and an error message name)
    answer: str  # the reference answer text


class PromptSet:
    def __init__(self, prepared_dir: str | os.PathLike, split: str, tokenizer: Any, limit: int | None = None):
        from dllmflow.data.dataset import PreparedDataset
        from dllmflow.data.task import task_chats

        rows = PreparedDataset(prepared_dir, split).rows(limit)
        if not rows:
            raise UserError(f"{prepared_dir}: split {split!r} has no prompts for rl")
        chats = task_chats(Path(prepared_dir), rows, 0)
        self.items = [
            Prompt(
                i,
                list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)),
                chat[-1]["content"] if chat else "",
                r["answer"],
            )
            for i, (r, chat) in enumerate(zip(rows, chats))
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prompt:
        return self.items[i]

    @staticmethod
    def step_positions(step: int, per_step: int, rank: int, world: int) -> list[int]:
        """Global stream positions of this rank's prompts at `step` (round robin over ranks)."""
        return [step * per_step + j for j in range(rank, per_step, world)]

    def at(self, position: int, seed: int) -> Prompt:
        """The prompt at global stream position `position`: epoch e = position // len visits the
        prompts in a permutation seeded by (seed, e), drawn on its own generator (no global RNG)."""
        epoch, offset = divmod(position, len(self))
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
        return self.items[int(torch.randperm(len(self), generator=gen)[offset])]
