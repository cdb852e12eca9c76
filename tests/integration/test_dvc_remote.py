"""DVC and the published prepared set agree (issue #52), on one moto S3 bucket: the DVC remote at
`s3://<bucket>/dvc`, the flow's `dataset.remote_dir` at `s3://<bucket>/prepared/tiny`.

  * a developer's repo (the repo's own `prepare` stage, in a throwaway git repo): `dvc repro`, `dvc push`
    to the S3 remote, dvc.lock and .dvc/config committed;
  * the cluster's plan step, in a fresh clone (no DVC cache, no prepared dir: a pod's disk): the flow's
    `plan_data` runs `dvc repro` of the stage and publishes the set to `dataset.remote_dir`; dvc.lock is
    unchanged (the stage made the very files it names);
  * a laptop, in another fresh clone: `dvc pull` restores the prepared dir whose manifest content hash, and
    the hash recomputed from its files, is the one the cluster published (what its trainers fetch), file
    for file the set's objects in the bucket.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from _dvc_repo import copy_prepare_stage, file_hashes, init_repo, run

from dllmflow.data.prepared_dir import content_hash, read_manifest
from dllmflow.settings import load_settings
from dllmflow.workflow.data_steps import pin_published, plan_data

ROOT = Path(__file__).resolve().parents[2]
OUT = Path("data/prepared/tiny")

pytestmark = pytest.mark.slow


@pytest.fixture()
def dev(tmp_path: Path, s3) -> Path:
    """The developer's repo: the repo's prepare stage, a DVC remote on the bucket, committed."""
    repo = tmp_path / "dev"
    repo.mkdir()
    copy_prepare_stage(repo)
    init_repo(repo)
    run("dvc", "remote", "add", "-d", "s3r", f"s3://{s3.bucket}/dvc", cwd=repo)
    run("dvc", "remote", "modify", "s3r", "endpointurl", s3.endpoint, cwd=repo)
    return repo


def _clone(src: Path, dest: Path) -> Path:
    run("git", "clone", "-q", str(src), str(dest), cwd=src.parent)
    return dest


def test_dvc_pull_gets_the_set_the_cluster_published(dev: Path, s3, tmp_path: Path, monkeypatch):
    # 1) the developer: repro, push the outs to the bucket's DVC remote, commit dvc.lock
    run("dvc", "repro", "prepare", cwd=dev)
    run("dvc", "push", cwd=dev)
    run("git", "add", "dvc.lock", ".dvc/config", cwd=dev)
    run("git", "commit", "-qm", "prepare", cwd=dev)
    locked = yaml.safe_load((dev / "dvc.lock").read_text())["stages"]["prepare"]["outs"]
    assert [o["path"] for o in locked] == [str(OUT)]

    # 2) the cluster's plan step on a fresh disk: the flow's plan_data (dvc repro, then publish)
    pod = _clone(dev, tmp_path / "pod")
    assert not (pod / OUT).exists() and not (pod / ".dvc" / "cache").exists()
    url = f"s3://{s3.bucket}/prepared/tiny"
    monkeypatch.chdir(pod)  # plan_data finds dvc.yaml in the working dir, as the flow's step does
    settings = load_settings(pod / "params" / "tiny_mdlm.yaml", dataset={"remote_dir": url})
    planned = plan_data(settings)
    assert planned["dvc_stage"] == "prepare" and planned["published"] is not None
    published = planned["published"]["content_hash"]
    assert published == read_manifest(pod / OUT)["content_hash"]
    assert run("git", "status", "--porcelain", "dvc.lock", cwd=pod) == ""  # the lock names these files
    pinned = pin_published(settings, {"content_hash": published, "published": planned["published"]})
    assert pinned["dataset"]["content_hash"] == published  # what every trainer fetches

    # 3) a laptop: a fresh clone, dvc pull; the exact set the cluster published
    monkeypatch.chdir(tmp_path)
    laptop = _clone(dev, tmp_path / "laptop")
    run("dvc", "pull", cwd=laptop)
    pulled = laptop / OUT
    manifest = read_manifest(pulled)
    assert manifest["content_hash"] == published
    assert content_hash(pulled, manifest) == published  # recomputed from the pulled files
    # file for file, the set's objects in the bucket (objects.json: their sha256, checked at upload)
    objects = json.loads(
        s3.client()
        .get_object(Bucket=s3.bucket, Key=f"prepared/tiny/sets/{published}/objects.json")["Body"]
        .read()
    )["files"]
    # (the DVC out also holds the dir's empty writer lock, .dllmflow.lock, which a set never publishes)
    pulled_files = {rel: h for rel, h in file_hashes(pulled).items() if not rel.startswith(".")}
    assert {rel: meta["sha256"] for rel, meta in objects.items()} == pulled_files
    assert (
        hashlib.sha256((pulled / "manifest.json").read_bytes()).hexdigest()
        == objects["manifest.json"]["sha256"]
    )
