"""Two nodes that share no disk, checkpointing to S3 (a `moto_server` started by the test).

Each "node" is its own `torchrun --nnodes 2 --node_rank N --nproc_per_node 1` on this machine, with its
own run dir (as two Kubernetes pods with their own local disks). Each gets its settings as the torchx
AppDef hands them (`build_app`: inline in $DLLMFLOW_SETTINGS, with --run-dir), never a settings.json
another machine wrote; rank 0 records them on its own disk:

  * a checkpoint mid-way: each node's disk holds the part of the step dir its rank wrote plus the
    complete manifest, and the remote step dir holds every rank's files; the remote manifest lists both
    ranks' DCP shards and RNG files with the sha256 of the bytes in the bucket (recomputed here);
  * the remote copy of rank 1's shard corrupted: the resume (whose node 0 lacks that shard and fetches
    the step dir) fails on every rank naming that file;
  * both disks lost: the resume restores from S3 on both nodes (node 1 verifies what it downloaded
    against rank 0's manifest) and gives the losses of an uninterrupted two-node run, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _prepared import prepare_tiny

from _plugins.fault_hooks import with_fault_env
from dllmflow.common.net import free_port
from dllmflow.runs import read_metrics
from dllmflow.settings import SETTINGS_ENV, load_settings, settings_env_value

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
BIN = Path(sys.executable).parent
STEP = "step_000002"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=32)


def _settings(prep: Path, remote: str | None):
    return load_settings(
        RECIPE,
        dataset={"limit": 32, "prepared_dir": str(prep)},
        train={"max_steps": 4, "global_batch_size": 4, "local_batch_size": 2, "warmup_steps": 1},
        checkpoint={"every_steps": 2, "keep_last": 2, "remote_dir": remote},
        distributed={"strategy": "ddp", "backend": "gloo"},
    )


def _node_dirs(base: Path) -> list[Path]:
    """One run dir per node: a pod's own (empty) disk."""
    nodes = [base / f"node{i}" for i in range(2)]
    for node in nodes:
        _lose_disk(node)
    return nodes


def _lose_disk(node: Path) -> None:
    """The pod is gone and its disk with it."""
    shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True)


def _train(
    nodes: list[Path], settings, resume: bool = False, fail_at: int | None = None
) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun at once (static rendezvous on 127.0.0.1), each given the settings as the
    AppDef gives them: $DLLMFLOW_SETTINGS and --run-dir (its own disk)."""
    env = with_fault_env(dict(os.environ), fail_at)  # fault injection only from the test side
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    procs = []
    for rank, node in enumerate(nodes):
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            "-m", "dllmflow.training.main", "--run-dir", str(node),
        ]  # fmt: skip
        if resume:
            cmd.append("--resume")
        node_env = {**env, SETTINGS_ENV: settings_env_value(settings.with_run_dir(node))}
        out = open(node.parent / f"{node.name}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (subprocess.Popen(cmd, env=node_env, stdout=out, stderr=subprocess.STDOUT, text=True), out)
        )
    # A node that fails (e.g. its rendezvous) leaves the other waiting for it: stop that one too, at once.
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p, _ in procs):
            for p, _ in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    done = []
    for proc, out in procs:
        proc.wait(timeout=60)
        out.close()
        log = Path(out.name).read_text()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, log, ""))
    return done


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _files(step_dir: Path) -> set[str]:
    return {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}


def test_two_nodes_without_a_shared_disk_resume_from_s3(s3, prep, tmp_path):
    # 0) the uninterrupted two-node run (no remote): the losses a resume must reproduce exactly
    ref_settings = _settings(prep, None)
    ref_nodes = _node_dirs(tmp_path / "reference")
    assert all(p.returncode == 0 for p in _train(ref_nodes, ref_settings)), (
        tmp_path / "reference" / "node1.log"
    ).read_text()[-3000:]
    reference = _losses(ref_nodes[0])
    assert sorted(reference) == [1, 2, 3, 4]
    # each node recorded the settings it was handed on its own disk (what it resumes under)
    for node in ref_nodes:
        assert json.loads((node / "settings.json").read_text()) == ref_settings.with_run_dir(node).to_dict()

    # 1) both nodes stop after step 3; the last checkpoint is step 2, on each disk and in the bucket
    remote = f"s3://{s3.bucket}/runs/nodes"
    settings = _settings(prep, remote)
    nodes = _node_dirs(tmp_path / "run")
    failed = _train(nodes, settings, fail_at=3)
    assert all(p.returncode != 0 for p in failed)
    assert all("injected failure after step 3" in p.stdout for p in failed), failed[1].stdout[-3000:]
    assert {s: reference[s] for s in (1, 2, 3)} == _losses(nodes[0])
    local = [n / "checkpoints" / STEP for n in nodes]
    assert all(os.readlink(n / "checkpoints" / "LATEST") == STEP for n in nodes)
    own_part = {"manifest.json", "model/__1_0.distcp", "optim/__1_0.distcp", "rng/rank_00001.safetensors"}
    assert _files(local[1]) == own_part  # node 1 published only what its rank wrote (+ the manifest)
    assert (local[0] / "trainer_state.json").is_file() and not list(nodes[1].glob("checkpoints/.*.tmp"))
    assert json.loads((local[1] / "manifest.json").read_text()) == json.loads(
        (local[0] / "manifest.json").read_text()
    )

    # the remote manifest lists both ranks' files with the sha256 of the bytes in the bucket
    client, prefix = s3.client(), f"runs/nodes/{STEP}/"
    keys = {k[len(prefix) :] for k in s3.keys(prefix)}

    def remote_bytes(rel: str) -> bytes:
        return client.get_object(Bucket=s3.bucket, Key=prefix + rel)["Body"].read()

    manifest = json.loads(remote_bytes("manifest.json"))["files"]
    assert set(manifest) == keys - {"manifest.json"}
    for rank in (0, 1):
        for rel in (
            f"model/__{rank}_0.distcp",
            f"optim/__{rank}_0.distcp",
            f"rng/rank_{rank:05d}.safetensors",
        ):
            assert rel in manifest, rel
    for rel, want in manifest.items():
        data = remote_bytes(rel)
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (want["sha256"], want["bytes"]), rel

    # 2) the bucket's copy of rank 1's shard is corrupt: node 0's disk lacks that shard, so the resume
    # fetches the step dir, and it fails on every rank naming the file
    shard = "model/__1_0.distcp"
    good = remote_bytes(shard)
    client.put_object(Bucket=s3.bucket, Key=prefix + shard, Body=bytes([good[0] ^ 0xFF]) + good[1:])
    corrupt = _train(nodes, settings, resume=True)
    assert all(p.returncode != 0 for p in corrupt)
    named = f"{nodes[0]}/checkpoints/{STEP}/{shard}: checksum mismatch"
    assert all(named in p.stdout for p in corrupt), corrupt[1].stdout[-3000:]

    # 3) the good bytes back; both disks lost: both nodes restore from S3 and finish the run exactly
    client.put_object(Bucket=s3.bucket, Key=prefix + shard, Body=good)
    for node in nodes:
        _lose_disk(node)
    resumed = _train(nodes, settings, resume=True)
    assert all(p.returncode == 0 for p in resumed), resumed[1].stdout[-3000:]
    assert all("resumed from" in p.stdout for p in resumed[:1])
    # the whole loss log: steps 1-2 back from the bucket's metrics.jsonl, 3-4 trained again
    assert _losses(nodes[0]) == reference
    assert all(os.readlink(n / "checkpoints" / "LATEST") == "step_000004" for n in nodes)
    assert "runs/nodes/LATEST" in s3.keys("runs/nodes/")
