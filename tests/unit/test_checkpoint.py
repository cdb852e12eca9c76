"""Checkpoint bookkeeping: the atomic LATEST pointer, pruning, save/load round trip on one rank (the
stateless global sampler that makes "resume = step" true is tested in test_training_data.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dllmflow.training import checkpoint as ckfiles
from dllmflow.training import checkpointer as ckpt
from dllmflow.training import fingerprint
from dllmflow.training.distributed import DistInfo

INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)


def _fake_step(root, step):
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    return d


def test_latest_is_a_relative_symlink_replaced_in_place(tmp_path):
    a, b = _fake_step(tmp_path, 10), _fake_step(tmp_path, 20)
    assert ckpt.latest_checkpoint(tmp_path) is None
    ckpt.write_latest(tmp_path, a.name)
    assert os.readlink(tmp_path / "LATEST") == "step_000010"  # relative: the run dir can move
    ckpt.write_latest(tmp_path, b.name)
    assert ckpt.latest_checkpoint(tmp_path) == b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_000010", "step_000020"]


def test_latest_txt_fallback_when_symlinks_fail(tmp_path, monkeypatch):
    a = _fake_step(tmp_path, 5)

    def no_symlinks(*args, **kwargs):
        raise OSError("symlinks not supported")

    monkeypatch.setattr(ckpt.os, "symlink", no_symlinks)
    ckpt.write_latest(tmp_path, a.name)
    assert (tmp_path / "LATEST.txt").read_text().strip() == "step_000005"
    assert ckpt.latest_checkpoint(tmp_path) == a


def test_prune_keeps_newest_and_latest_target(tmp_path):
    dirs = [_fake_step(tmp_path, s) for s in (2, 4, 6, 8)]
    (tmp_path / ".step_000010.tmp").mkdir()  # a save that died half-way
    ckpt.write_latest(tmp_path, dirs[0].name)  # LATEST on an old one must survive pruning
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


def _tiny_run(root, steps=3):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in range(1, steps + 1):
        ckpt.save_checkpoint(root, step, model, opt, sched, INFO, keep_last=steps)
    return model, opt, sched


def test_save_writes_a_manifest_and_no_pickled_rng(tmp_path):
    _tiny_run(tmp_path, steps=1)
    step = tmp_path / "step_000001"
    manifest = json.loads((step / "manifest.json").read_text())
    files = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"trainer_state.json", "rng/rank_00000.safetensors", "model/.metadata", "optim/.metadata"} <= files
    assert not list(step.rglob("*.pt"))
    ckfiles.verify_checkpoint(step)


def test_file_owner_names_the_rank_that_wrote_each_file():
    owners = {
        "model/__1_0.distcp": 1,
        "optim/__0_3.distcp": 0,
        "rng/rank_00001.safetensors": 1,
        "rng/rank_00000.safetensors": 0,
        "model/.metadata": None,
        "trainer_state.json": None,
        "model/consolidated/model.safetensors": None,
        "model/__2_0.distcp": None,  # no rank 2 in a world of 2
    }
    assert {rel: ckfiles.file_owner(rel, world_size=2) for rel in owners} == owners


def test_resume_fetches_a_step_dir_this_disk_holds_only_part_of(tmp_path):
    root, remote = tmp_path / "node" / "checkpoints", tmp_path / "bucket"
    _tiny_run(root, steps=2)
    shutil.copytree(root / "step_000002", remote / "step_000002")
    (root / "step_000002" / "rng" / "rank_00000.safetensors").unlink()  # another node's file, say
    with pytest.warns(ckfiles.CheckpointWarning, match="resuming from step_000001"):
        assert ckpt.resume_checkpoint(root, INFO) == root / "step_000001"

    fetched = []

    def fetch(name):
        fetched.append(name)
        shutil.rmtree(root / name)
        shutil.copytree(remote / name, root / name)

    assert ckpt.resume_checkpoint(root, INFO, fetch) == root / "step_000002"
    assert fetched == ["step_000002"]
    ckfiles.verify_checkpoint(root / "step_000002")

    # a fetched copy that is corrupt too: named, then the fallback as before
    (remote / "step_000002" / "model" / "__0_0.distcp").write_bytes(b"garbage")
    (root / "step_000002" / "trainer_state.json").write_text("{}")
    with pytest.warns(ckfiles.CheckpointWarning, match=r"step_000002/model/__0_0.distcp: checksum mismatch"):
        assert ckpt.resume_checkpoint(root, INFO, fetch) == root / "step_000001"


def test_rng_round_trip_through_safetensors_and_json(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    ckfiles.save_rng(tmp_path / "rng.safetensors", ckfiles.rng_state())
    want = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    (tmp_path / "rng").mkdir()
    (tmp_path / "rng.safetensors").rename(tmp_path / "rng" / "rank_00000.safetensors")
    ckfiles.set_rng_state(ckfiles.load_rng(tmp_path, 0))
    assert torch.equal(torch.rand(4), want[0]) and random.random() == want[1] and np.random.rand() == want[2]
    assert ckfiles.load_rng(tmp_path, 1) is None  # more ranks than were saved


def test_select_checkpoint_falls_back_past_garbage_latest_and_corrupt_dirs(tmp_path):
    _tiny_run(tmp_path, steps=3)
    assert ckpt.select_checkpoint(tmp_path) == tmp_path / "step_000003"
    (tmp_path / "LATEST").unlink()
    (tmp_path / "LATEST.txt").write_text("../../../etc\n")
    (tmp_path / "step_000003" / "trainer_state.json").write_text("{}")
    with pytest.warns(ckfiles.CheckpointWarning, match="'../../../etc'.*resuming from step_000002"):
        assert ckpt.select_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert ckpt.select_checkpoint(tmp_path / "empty") is None


def test_fingerprint_ignores_run_length_and_names_what_changed():
    from dllmflow.settings import load_settings

    base = fingerprint.settings_fingerprint(load_settings())
    assert fingerprint.settings_fingerprint(load_settings(train={"max_steps": 999, "log_every": 7})) == base
    other = fingerprint.settings_fingerprint(load_settings(train={"lr": 0.5}, dataset={"seq_length": 64}))
    with pytest.raises(
        ckfiles.CheckpointError, match=r"dataset\.seq_length: 256 -> 64; train\.lr: 0\.001 -> 0\.5\)"
    ):
        fingerprint.check_fingerprint({"settings_fingerprint": base}, other, "step_000001")


def test_a_causal_blocks_run_checkpointed_before_the_mode_split_resumes():
    """A checkpoint of `block_causal` + `block_attention: causal` (the fields an older dllmflow saved, written
    out here by hand) resumes under today's `causal_blocks` recipe; a real change is still refused."""
    from pathlib import Path

    from dllmflow.settings import load_settings

    recipe = Path(__file__).resolve().parents[2] / "params" / "tiny_causal_blocks.yaml"
    now = fingerprint.settings_fingerprint(load_settings(recipe))
    fields = {k: v for k, v in now["fields"].items()}
    assert fields["dllm.mode"] == "causal_blocks"
    fields.update({"dllm.mode": "block_causal", "dllm.block_attention": "causal", "dllm.mask_pattern": "suffix",
                   "dllm.logit_shift": True})  # fmt: skip
    saved = {"sha256": "recorded-before-the-split", "fields": fields}
    fingerprint.check_fingerprint({"settings_fingerprint": saved}, now, "step_000002")  # resumes
    other = fingerprint.settings_fingerprint(load_settings(recipe, train={"lr": 0.5}))
    with pytest.raises(ckfiles.CheckpointError, match=r"train\.lr: .* -> 0\.5"):
        fingerprint.check_fingerprint({"settings_fingerprint": saved}, other, "step_000002")
    bidirectional = {**fields, "dllm.block_attention": "bidirectional"}  # not causal blocks: another run
    with pytest.raises(ckfiles.CheckpointError, match=r"dllm\.mode: 'block_causal' -> 'causal_blocks'"):
        fingerprint.check_fingerprint(
            {"settings_fingerprint": {"sha256": "x", "fields": bidirectional}}, now, "s"
        )
