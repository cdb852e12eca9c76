"""Deterministic, stateless global batching: which rows each rank trains on at each step.

Every optimizer step consumes `global_batch_size` (gbs) consecutive global positions
`p = step * gbs + k`, `k in [0, gbs)`. Position p reads row `perm_e[p mod N]` of epoch `e = p // N`, where
`perm_e` is a permutation seeded by (train.seed, e). Rank r's micro-batch j holds the slots

    k = (j * world + r) * local_batch_size + b,      b in [0, local_batch_size)

so a micro-batch is the same set of rows whatever the world size / accumulation split (for a fixed
local batch size): padding, and therefore the loss, does not depend on the topology. With
local_batch_size 1 this is k = r + j * world. The data position is the number of samples consumed,
`step * gbs`: each checkpoint records it (`state(step)`, with the data it indexes: rows, content hash,
seed), and a resume checks it (`check_resume`) so the next sample is exactly the one after the last
trained. Another world size resumes exactly (positions do not depend on it); other data, another
global batch size or seed would not give the next sample, and are refused naming what changed.
The global position p is also the sample's identity for seeding its corruption noise. With
`dataset.packing` the collator packs the micro-batch's rows into fewer sequences
(`dllmflow.data.pack`); `global_index` then lists the position of each document, not of each row.

    batches = GlobalBatches(dataset, collator, gbs=8, lbs=4, rank=0, world=2, seed=42)
    for mb in batches.step(17): ...      # list of collated micro-batches, each with "global_index" [B]
    state = batches.state(17)            # {"consumed_samples": 136, ...}: saved with the checkpoint
    batches.check_resume(state, 17)      # UserError when resuming there would not continue the data
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dllmflow.errors import UserError


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> list[int]:
    """Row order of one epoch, a pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7_919 + 1) & (2**63 - 1))
    return torch.randperm(num_rows, generator=g).tolist()


class GlobalBatches:
    """Micro-batches of one rank for a given step; see the module docstring for the layout."""

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
        global_batch_size: int,
        local_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        if global_batch_size % (local_batch_size * world_size):
            raise UserError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                f"train.local_batch_size x world size ({local_batch_size} x {world_size})"
            )
        if len(dataset) == 0:
            raise UserError(
                "the training split of dataset.prepared_dir is empty; run `dllmflow prepare` again"
            )
        self.dataset, self.collator = dataset, collator
        self.gbs, self.lbs = global_batch_size, local_batch_size
        self.rank, self.world, self.seed = rank, world_size, seed
        self.grad_accum_steps = global_batch_size // (local_batch_size * world_size)
        self._perm_cache: dict[int, list[int]] = {}

    def positions(self, step: int, micro: int) -> list[int]:
        """Global positions of this rank's micro-batch `micro` at `step`."""
        first = (micro * self.world + self.rank) * self.lbs
        return [step * self.gbs + first + b for b in range(self.lbs)]

    def row_index(self, position: int) -> int:
        n = len(self.dataset)
        epoch = position // n
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: epoch_permutation(n, self.seed, epoch)}  # one epoch at a time
        return self._perm_cache[epoch][position % n]

    def step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The collated micro-batches of `step`; each carries `global_index` [B] (long) for noise seeding
        ([N], one per document, when the collator packs)."""
        out = []
        for micro in range(self.grad_accum_steps):
            positions = self.positions(step, micro)
            batch = self.collator([self.dataset[self.row_index(p)] for p in positions])
            index = torch.tensor(positions, dtype=torch.long)  # [B]
            if "document_index" in batch:  # packed: one entry per document, in document order
                index = index[batch.pop("document_index")]  # [N]
            batch["global_index"] = index
            out.append(batch)
        return out

    def state(self, step: int) -> dict[str, Any]:
        """The data position after `step` completed steps (JSON), for the checkpoint's trainer state."""
        manifest = getattr(self.dataset, "manifest", None) or {}
        return {
            "consumed_samples": step * self.gbs,
            "global_batch_size": self.gbs,
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "content_hash": manifest.get("content_hash"),
            "world_size": self.world,
        }

    def check_resume(self, saved: dict[str, Any] | None, step: int) -> None:
        """UserError when resuming at `step` from a checkpoint whose data position is `saved` would not
        read exactly the sample after the last one trained. A checkpoint without one (saved before
        data positions were recorded) resumes at `step`, as it always did."""
        if not saved:
            return
        now = self.state(step)
        changed = [
            f"{key} {saved[key]} -> {now[key]}"
            for key in ("global_batch_size", "seed", "num_rows", "content_hash")
            if saved.get(key) is not None and saved[key] != now[key]
        ]
        if saved["consumed_samples"] != now["consumed_samples"]:
            changed.insert(0, f"consumed_samples {saved['consumed_samples']} != step {step} x {self.gbs}")
        if changed:
            raise UserError(
                "cannot resume on the next sample: the data position of the checkpoint does not match "
                f"({'; '.join(changed)}); resume with the prepared data, train.seed and "
                "train.global_batch_size it was trained with, or start a new run"
            )
