"""One optimizer step's forward/backward with globally normalised losses (the Trainer's default step).

    record = train_step(model, strategy, batches, step, settings, info, autocast)   # collective
    record["grad_norm"] = clip_grad_norm(model, settings.train.max_grad_norm)

  1) every micro-batch of the step is collated and corrupted first (noise seeded per sample by its
     global position, so it does not depend on the topology);
  2) per-term token counts are summed over micro-batches and all-reduced over ranks;
  3) each micro-batch: total = sum_k w_k * sums_k / max(G_k, 1); backward of total * world_size
     (DDP/FSDP2 average gradients over ranks; this turns the average back into global sum / global count).
The loss therefore does not depend on world size or gradient accumulation.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from dllmflow.training.distributed import DistInfo, all_reduce_sum, grad_sync

T = TypeVar("T")


def train_step(model, strategy, batches, step: int, settings, info: DistInfo, autocast) -> dict[str, Any]:
    """Forward/backward of every micro-batch of one step; returns globally reduced metrics."""
    from dllmflow.diffusion.seeding import sample_seed

    # 1) collate + corrupt everything first, so the denominators are known before any backward
    if hasattr(strategy, "begin_step"):  # an optional hook: a duck-typed strategy may lack it
        strategy.begin_step(step)
    micro, packing = [], defaultdict(float)
    for mb in batches.step(step):
        positions = mb.pop("global_index").tolist()
        for k in [k for k in mb if k.startswith("packing_")]:  # dataset.packing's overflow counters
            packing[k] += float(mb.pop(k))
        mb = {k: v.to(info.device) for k, v in mb.items()}
        mb.update(strategy.corrupt(mb, [sample_seed(settings.train.seed, step, p) for p in positions]))
        micro.append(mb)

    # 2) global counts per loss term (+ tokens and supervised tokens for the metrics)
    local = defaultdict(float)
    for mb in micro:
        for k, v in strategy.token_counts(mb).items():
            local[k] += float(v)
        local["__tokens"] += mb["input_ids"].numel()
        local["__supervised"] += float(mb["loss_mask"].sum())
    counts = reduce_sums(local, info)

    # 3) forward/backward with global denominators
    def loss_of(mb):
        out = strategy.loss(model, mb)
        terms = {k: out.weight(k) * s / max(counts[k], 1.0) for k, s in out.sums.items()}
        return sum(terms.values()), (out, terms)

    loss_sums = {"loss": 0.0, "dllm_loss": 0.0}
    metric_sums: dict[str, float] = defaultdict(float)
    for total, (out, terms) in backward_each(model, micro, loss_of, info, autocast):
        loss_sums["loss"] += float(total)
        loss_sums["dllm_loss"] += float(sum(terms[k].detach() for k in out.dllm_terms if k in terms))
        for k, v in out.metric_sums.items():
            metric_sums[k] += float(v)

    # 4) global metrics
    record: dict[str, Any] = reduce_sums(loss_sums, info)
    if metric_sums:
        record.update(strategy.finalize_metrics(reduce_sums(metric_sums, info)))
    record["tokens_per_step"] = int(counts["__tokens"])
    record["supervised_tokens"] = int(counts["__supervised"])
    record.update({k: int(v) for k, v in reduce_sums(packing, info).items()} if packing else {})
    return record


def backward_each(
    model, micro: Sequence[T], loss_of: Callable[[T], tuple[torch.Tensor, Any]], info: DistInfo, autocast
) -> Iterator[tuple[torch.Tensor, Any]]:
    """Per micro-batch: `loss, extra = loss_of(mb)` under autocast, then backward of loss x world size
    (DDP/FSDP2 average gradients over ranks: this turns the average back into the global sum over the
    global count the loss was divided by). Gradients sync on the last micro-batch only. Yields the
    detached loss and `extra`."""
    for j, mb in enumerate(micro):
        with grad_sync(model, enabled=j == len(micro) - 1):
            with autocast:
                loss, extra = loss_of(mb)
            (loss * info.world_size).backward()
        yield loss.detach(), extra


def reduce_sums(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """SUM over ranks of a dict of scalars, in one collective (on the device: NCCL needs CUDA tensors)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    return dict(zip(keys, all_reduce_sum(t).tolist()))


def clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
        norm = norm.full_tensor()
    return float(norm)
