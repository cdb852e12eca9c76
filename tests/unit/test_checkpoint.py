"""Checkpoint bookkeeping: the atomic LATEST pointer, pruning, save/load round trip on one rank (the
stateless global sampler that makes "resume = step" true is tested in test_training_data.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dllmflow.training import checkpoint as ckpt
from dllmflow.training.parallel import DistInfo

INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)


def _fake_step(root, step):
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    return d


def test_latest_is_a_relative_symlink_replaced_in_place(tmp_path):
    a, b = _fake_step(tmp_path, 10), _fake_step(tmp_path, 20)
    assert ckpt.latest_checkpoint(tmp_path) is None
    ckpt.update_latest(tmp_path, a.name)
    assert os.readlink(tmp_path / "LATEST") == "step_000010"  # relative: the run dir can move
    ckpt.update_latest(tmp_path, b.name)
    assert ckpt.latest_checkpoint(tmp_path) == b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_000010", "step_000020"]


def test_latest_txt_fallback_when_symlinks_fail(tmp_path, monkeypatch):
    a = _fake_step(tmp_path, 5)

    def no_symlinks(*args, **kwargs):
        raise OSError("symlinks not supported")

    monkeypatch.setattr(ckpt.os, "symlink", no_symlinks)
    ckpt.update_latest(tmp_path, a.name)
    assert (tmp_path / "LATEST.txt").read_text().strip() == "step_000005"
    assert ckpt.latest_checkpoint(tmp_path) == a


def test_prune_keeps_newest_and_latest_target(tmp_path):
    dirs = [_fake_step(tmp_path, s) for s in (2, 4, 6, 8)]
    (tmp_path / ".step_000010.tmp").mkdir()  # a save that died half-way
    ckpt.update_latest(tmp_path, dirs[0].name)  # LATEST on an old one must survive pruning
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "LATEST",
        "step_000002",
        "step_000006",
        "step_000008",
    ]


def test_save_then_load_restores_model_optimizer_scheduler(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    x = torch.randn(16, 4)
    for step in range(1, 4):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ckpt.save_checkpoint(tmp_path, step, model, opt, sched, INFO, keep_last=2)
    assert [p.name for _, p in ckpt.checkpoint_steps(tmp_path)] == ["step_000002", "step_000003"]
    assert not list(tmp_path.glob(".*.tmp"))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2(x).sum().backward()  # materialise optimizer state so DCP has tensors to load into
    opt2.step()
    opt2.zero_grad()
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), model2, opt2, sched2, INFO)
    assert state["step"] == 3
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    for p, exp_avg in zip(model2.parameters(), want_exp_avg):
        assert torch.equal(opt2.state[p]["exp_avg"], exp_avg)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)


def test_failed_export_leaves_latest_on_previous_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, INFO, keep_last=3)

    def broken_export(model_dir):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, sched, INFO, keep_last=3, export=broken_export)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    assert not (tmp_path / "step_000002").exists()
