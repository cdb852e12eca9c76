"""Prepared data through an object store (`dataset.remote_dir`, data/remote.py) on a real S3 endpoint
(a `moto_server` started by each test):

  * publish, then fetch into an empty dir of another "machine": the same files and content hash, bytes
    moved within 1.1x the set's size; a second fetch reuses it (0 bytes); a local dir holding another
    set is replaced whole (no file of the old set left);
  * an object changed or deleted in the bucket after publishing: one line naming the object and the
    manifest hash; nothing written locally;
  * two publishers of one URL that planned at the same pointer: the first wins, the second is refused,
    and the pointer names the winner's complete set;
  * the store unreachable: retried, then one line naming the URL;
  * a trainer whose `dataset.prepared_dir` is an empty dir of its own fetches the set and trains the
    losses of a run on the original dir, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from _prepared import prepare_tiny

from dllmflow.common import store
from dllmflow.data import remote as remote_mod
from dllmflow.data.prepared_dir import PreparedDataError, read_manifest
from dllmflow.data.remote import PublishRaceError, fetch_prepared, pointer_etag, publish_prepared
from dllmflow.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=32)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=16)


def _files(d: Path) -> dict[str, str]:
    """Every published file of a prepared dir -> its sha256 (an independent reading of the bytes)."""
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts)
    }


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_publish_then_fetch_gives_the_same_set_and_reuses_it(s3, prep, other, tmp_path):
    url = f"s3://{s3.bucket}/prepared/tiny"
    assert pointer_etag(url) is None
    out = publish_prepared(prep, url, expect=None)
    digest = read_manifest(prep)["content_hash"]
    assert out["content_hash"] == digest
    keys = set(s3.keys("prepared/tiny/"))
    assert "prepared/tiny/manifest.json" in keys and f"prepared/tiny/sets/{digest}/manifest.json" in keys
    assert (
        json.loads(
            s3.client().get_object(Bucket=s3.bucket, Key="prepared/tiny/manifest.json")["Body"].read()
        )["content_hash"]
        == digest
    )
    assert _size(prep) <= out["uploaded_bytes"] <= 1.1 * _size(prep)

    node = tmp_path / "node" / "prepared"  # another machine's empty disk
    got = fetch_prepared(url, node)
    assert got == {"content_hash": digest, "reused": False, "fetched_bytes": got["fetched_bytes"]}
    assert _files(node) == _files(prep)
    assert got["fetched_bytes"] <= 1.1 * _size(prep)
    assert fetch_prepared(url, node)["reused"] and fetch_prepared(url, node)["fetched_bytes"] == 0

    # a local copy of another set is replaced whole: no file of the old set stays
    stale = tmp_path / "stale" / "prepared"
    stale.parent.mkdir()
    import shutil

    shutil.copytree(other, stale)
    assert read_manifest(stale)["content_hash"] != digest
    fetch_prepared(url, stale)
    assert _files(stale) == _files(prep)
    assert not [p for p in stale.parent.iterdir() if p.name.startswith(".stale") or ".tmp-" in p.name]


def test_a_changed_or_missing_object_is_named_and_nothing_is_written(s3, prep, tmp_path):
    url = f"s3://{s3.bucket}/prepared/tiny"
    digest = publish_prepared(prep, url, expect=None)["content_hash"]
    client, prefix = s3.client(), f"prepared/tiny/sets/{digest}/"
    shard = next(k[len(prefix) :] for k in s3.keys(prefix) if k.endswith(".parquet"))
    good = client.get_object(Bucket=s3.bucket, Key=prefix + shard)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=prefix + shard, Body=good[:-1] + bytes([good[-1] ^ 1]))
    node = tmp_path / "node" / "prepared"
    with pytest.raises(PreparedDataError) as changed:
        fetch_prepared(url, node)
    assert f"{url}/sets/{digest}/{shard}: changed" in str(changed.value) and digest[:12] in str(changed.value)
    assert "\n" not in str(changed.value)
    assert not node.exists() and [p.name for p in node.parent.iterdir()] == [".prepared.fetch.lock"]

    client.delete_object(Bucket=s3.bucket, Key=prefix + shard)
    with pytest.raises(PreparedDataError, match=rf"{shard}: missing from the set of manifest {digest[:12]}"):
        fetch_prepared(url, node)
    assert not node.exists()


def test_two_publishers_of_one_url_one_wins(s3, prep, other):
    url = f"s3://{s3.bucket}/prepared/race"
    planned = pointer_etag(url)  # both planned when nothing was published
    first = publish_prepared(other, url, expect=planned)
    with pytest.raises(PublishRaceError, match=r"another prepare published .* since this one planned"):
        publish_prepared(prep, url, expect=planned)
    pointer = json.loads(
        s3.client().get_object(Bucket=s3.bucket, Key="prepared/race/manifest.json")["Body"].read()
    )
    assert pointer["content_hash"] == first["content_hash"] == read_manifest(other)["content_hash"]
    # the pointer moves again only for a publisher that saw where it was (If-Match on its ETag)
    seen = pointer_etag(url)
    publish_prepared(prep, url, expect=seen)
    with pytest.raises(
        PublishRaceError, match=rf"published {read_manifest(prep)['content_hash'][:12]} since"
    ):
        publish_prepared(other, url, expect=seen)  # planned before that move
    assert pointer_etag(url) != seen


def test_an_unreachable_store_is_retried_then_named(s3, prep, tmp_path, monkeypatch):
    url = f"s3://{s3.bucket}/prepared/tiny"
    publish_prepared(prep, url, expect=None)
    s3.stop()
    monkeypatch.setattr(store, "RETRY_WAIT_S", (0.05, 0.1))  # the backoff only: every try is real
    node = tmp_path / "node" / "prepared"
    with pytest.raises(UserError) as down:
        fetch_prepared(url, node)
    message = str(down.value)
    assert f"dataset.remote_dir {url}:" in message and f"failed {remote_mod.RETRY_ATTEMPTS} times" in message
    assert s3.endpoint in message and not node.exists()


@pytest.mark.slow
def test_a_trainer_fetches_the_set_and_trains_the_same_losses(s3, prep, tmp_path):
    from dllmflow.runs import read_metrics
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    url = f"s3://{s3.bucket}/prepared/tiny"
    publish_prepared(prep, url, expect=None)

    def losses(run: Path, **dataset) -> dict[int, float]:
        s = load_settings(RECIPE, dataset={"limit": 32, **dataset}, train={"max_steps": 3, "warmup_steps": 1})
        run_training(s, run)
        return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}

    reference = losses(tmp_path / "ref", prepared_dir=str(prep))
    node = tmp_path / "node" / "prepared"  # empty: the trainer fetches it
    fetched = losses(tmp_path / "run", prepared_dir=str(node), remote_dir=url)
    assert sorted(reference) == [1, 2, 3] and fetched == reference
    assert _files(node) == _files(prep)


def test_the_prepare_fan_out_shares_nothing_but_the_bucket(s3, tmp_path):
    """The flow's data steps, each a "pod" with a disk of its own (the plan's gone before the units run):
    the units fetch the plan's tokenizer from the bucket's staging and upload their shards there, a
    retried unit rewrites the same objects, and the join downloads, checks, publishes and clears the
    staging. The published set is the one a one-machine prepare makes, byte for byte."""
    import shutil

    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings
    from dllmflow.workflow.data_steps import data_units, join_data, plan_data, prepare_unit

    url = f"s3://{s3.bucket}/prepared/fan"

    def settings(pod: str, **dataset):
        return load_settings(RECIPE, dataset={"task_rows": 500, "prepared_dir": str(tmp_path / pod / "prepared"),
                                              **dataset})  # fmt: skip

    planned = plan_data(settings("plan", remote_dir=url))
    units = data_units(planned)
    assert planned["remote_staging"].startswith(f"{url}/staging/") and len(units) == 3
    shutil.rmtree(tmp_path / "plan")  # that pod is gone, its disk with it
    for k in units:
        prepare_unit(settings(f"unit{k}", remote_dir=url), planned, k)
    staged = {
        k: s3.client().head_object(Bucket=s3.bucket, Key=k)["ETag"] for k in s3.keys("prepared/fan/staging/")
    }
    prepare_unit(settings("unit1-retry", remote_dir=url), planned, 1)  # a unit killed and retried elsewhere
    assert {
        k: s3.client().head_object(Bucket=s3.bucket, Key=k)["ETag"] for k in s3.keys("prepared/fan/staging/")
    } == staged
    assert [p.name for p in tmp_path.glob("unit*/*")] == []  # a unit staged on its own disk, then cleared it

    data = join_data(settings("join", remote_dir=url), planned)
    assert data["published"]["content_hash"] == data["content_hash"] and not s3.keys("prepared/fan/staging/")
    one_machine = prepare(settings("ref"))
    assert data["content_hash"] == one_machine["content_hash"]
    assert _files(tmp_path / "join" / "prepared") == _files(tmp_path / "ref" / "prepared")
    fetched = fetch_prepared(url, tmp_path / "trainer" / "prepared", data["content_hash"])
    assert fetched["content_hash"] == data["content_hash"] and not fetched["reused"]


def test_dllmflow_prepare_publishes_when_remote_dir_is_set(s3, tmp_path, capsys):
    import argparse

    import yaml

    from dllmflow.data.prepare import cli_main

    url = f"s3://{s3.bucket}/prepared/cli"
    recipe = tmp_path / "remote.yaml"
    recipe.write_text(
        yaml.safe_dump({"dataset": {"limit": 16, "prepared_dir": str(tmp_path / "p"), "remote_dir": url}})
    )
    assert cli_main(argparse.Namespace(params=[str(RECIPE), str(recipe)], force=False, workers=1)) == 0
    digest = read_manifest(tmp_path / "p")["content_hash"]
    assert f"published {url}/sets/{digest}" in capsys.readouterr().out.replace("\n", "")  # rich wraps lines
    pointer = json.loads(
        s3.client().get_object(Bucket=s3.bucket, Key="prepared/cli/manifest.json")["Body"].read()
    )
    assert pointer["content_hash"] == digest
