"""`dllmflow.training.trainer`: the LR schedule, one optimizer step's loss reduction (global sum / global
count per term, across micro-batches) against a direct computation on a toy model and strategy, and
gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dllmflow.diffusion.seeding import sample_seed
from dllmflow.diffusion.strategies.base import LossOutput
from dllmflow.settings import load_settings
from dllmflow.training.distributed import DistInfo
from dllmflow.training.step import clip_grad_norm
from dllmflow.training.trainer import lr_factor, train_step

INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)
NO_AUTOCAST = torch.autocast("cpu", enabled=False)
V, L = 7, 6


# ---- LR schedule ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_lr_schedule_warmup_then_cosine_or_constant(schedule):
    s = load_settings(
        train={"max_steps": 10, "warmup_steps": 2, "min_lr_ratio": 0.1, "lr_schedule": schedule}
    )
    factors = [lr_factor(step, s) for step in range(10)]
    assert factors[:2] == [0.5, 1.0]
    if schedule == "constant":
        assert factors[2:] == [1.0] * 8
    else:
        # reference: 0.1 + 0.9 * (1 + cos(pi * (step - warmup) / (max - warmup))) / 2
        want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in range(2, 10)]
        assert factors[2:] == pytest.approx(want)
    assert lr_factor(10, s) == pytest.approx(0.1 if schedule == "cosine" else 1.0)


# ---- one step: global normalisation across micro-batches -----------------------------------------


class ToyStrategy:
    """Two loss terms with different denominators: "diffusion" over the noised supervised positions
    (weight 1) and "ar" over all supervised positions (weight 0.5); an accuracy from metric sums."""

    def corrupt(self, batch, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        noise = torch.stack([torch.rand(L, generator=g) < 0.5 for g in gens])  # [B, L]
        return {"noise_mask": noise}

    def _masks(self, batch):
        sup = batch["loss_mask"].bool()
        return {"diffusion": sup & batch["noise_mask"], "ar": sup}

    def token_counts(self, batch):
        return {k: m.sum() for k, m in self._masks(batch).items()}

    def loss(self, model, batch):
        logits = model(batch["input_ids"])  # [B, L, V]
        nll = F.cross_entropy(logits.transpose(1, 2), batch["input_ids"], reduction="none")  # [B, L]
        masks = self._masks(batch)
        right = (logits.argmax(-1) == batch["input_ids"]) & masks["ar"]
        return LossOutput(
            sums={k: (nll * m).sum() for k, m in masks.items()},
            weights={"ar": 0.5},
            dllm_terms=("diffusion",),
            metric_sums={"right": right.sum().float(), "seen": masks["ar"].sum().float()},
        )

    def finalize_metrics(self, sums):
        return {"acc": sums["right"] / sums["seen"]}


class ToyBatches:
    """Two micro-batches of unequal supervision, so a per-micro-batch mean differs from the global one."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (5, L), generator=g)
        self.loss_mask = torch.tensor(
            [
                [0, 1, 1, 1, 1, 1],
                [0, 0, 0, 0, 1, 1],
                [1, 1, 1, 1, 1, 1],
                [0, 0, 1, 1, 1, 1],
                [0, 0, 0, 0, 0, 1],
            ]
        ).float()
        self.split = [(0, 2), (2, 5)]

    def step(self, step):
        return [
            {
                "input_ids": self.ids[a:b].clone(),
                "loss_mask": self.loss_mask[a:b].clone(),
                "global_index": torch.arange(a, b) + 5 * step,
            }
            for a, b in self.split
        ]


def _toy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Tanh(), nn.Linear(8, V))


def test_train_step_loss_is_global_sum_over_global_count_per_term():
    settings = load_settings(train={"seed": 5})
    strategy, batches = ToyStrategy(), ToyBatches()
    model, ref_model = _toy_model(), _toy_model()
    record = train_step(model, strategy, batches, 3, settings, INFO, NO_AUTOCAST)

    # direct: the whole step as one batch, noise seeded per sample from (seed, step, position)
    ids, lm = batches.ids, batches.loss_mask
    noise = ToyStrategy().corrupt({}, [sample_seed(5, 3, 15 + i) for i in range(5)])["noise_mask"]
    nll = F.cross_entropy(ref_model(ids).transpose(1, 2), ids, reduction="none")
    diff_mask, ar_mask = lm.bool() & noise, lm.bool()
    diffusion = (nll * diff_mask).sum() / diff_mask.sum()
    ar = (nll * ar_mask).sum() / ar_mask.sum()
    total = diffusion + 0.5 * ar
    total.backward()

    assert record["loss"] == pytest.approx(total.item(), rel=1e-6)
    assert record["dllm_loss"] == pytest.approx(diffusion.item(), rel=1e-6)
    assert record["tokens_per_step"] == 5 * L and record["supervised_tokens"] == int(lm.sum())
    right = (ref_model(ids).argmax(-1) == ids) & ar_mask
    assert record["acc"] == pytest.approx(right.sum().item() / ar_mask.sum().item())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_train_step_does_not_depend_on_the_micro_batch_split():
    settings = load_settings(train={"seed": 5})
    one, two = ToyBatches(), ToyBatches()
    one.split = [(0, 5)]
    records = []
    for batches in (one, two):
        records.append(train_step(_toy_model(), ToyStrategy(), batches, 0, settings, INFO, NO_AUTOCAST))
    assert records[0]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)
    assert records[0]["dllm_loss"] == pytest.approx(records[1]["dllm_loss"], rel=1e-6)


# ---- gradient clipping (the trainer's helper; run_training logs its return value as grad_norm) ------


def _with_grads():
    model = _toy_model()
    ids = torch.randint(0, V, (4, L), generator=torch.Generator().manual_seed(1))
    (F.cross_entropy(model(ids).transpose(1, 2), ids) * 100).backward()
    return model


def test_clip_returns_the_pre_clip_norm_and_clips_to_max_norm():
    model = _with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before))
    assert norm > 1.0
    got = clip_grad_norm(model, 1.0)
    assert got == pytest.approx(norm, rel=1e-5)
    after = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert after == pytest.approx(1.0, rel=1e-4)
    for g, p in zip(before, model.parameters()):  # one common scale, direction kept
        torch.testing.assert_close(p.grad, g / norm, rtol=1e-4, atol=1e-7)


def test_clip_without_max_norm_only_measures():
    model = _with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before))
    assert clip_grad_norm(model, None) == pytest.approx(norm, rel=1e-5)
    assert all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters()))
