"""The flow steps after training (evaluate, register, end) on a pod without the trainers' disk, on a real S3
endpoint (a `moto_server` started and stopped by this module):

  * the trainer's rank 0 mirrors metrics.jsonl and settings.json beside the step dirs (only changed
    bytes go up), and a resume on a fresh disk gets the loss log back;
  * a fresh run dir on "another pod": `restore_run_dir` downloads the final export (no DCP shards, no
    optimizer state), the loss log and the settings, and the evaluation there equals the one of the
    trainers' own run dir (exact match, answers, the weights' sha256); a complete run dir asks the
    store nothing; a corrupt object in the bucket is named;
  * a bucket without the finished run: one UserError line naming the URL;
  * `mirrored_runs` names the run dirs and prefixes `workflow.finetune.train` mirrors (a curriculum's
    stages, the AR control), checked against what train hands the launcher.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from _prepared import prepare_tiny, remote_run_settings
from _services import moto_s3

from _plugins.fault_hooks import FailAfterStep
from dllmflow import runs
from dllmflow.errors import UserError
from dllmflow.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3("dllmflow", log=tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=32)


def _settings(prep: Path, remote: str | None, max_steps: int = 4):
    eval_ = {"limit": 4, "sweep": None, "max_new_tokens": 32, "batch_size": 4}
    return remote_run_settings(RECIPE, prep, remote, max_steps, eval=eval_)


@pytest.fixture(scope="module")
def trained(s3, prep, tmp_path_factory):
    """A flow run's training on pod A (its pod lost once after step 2, resumed from the bucket on a fresh
    disk) and pod A's evaluation of it."""
    from dllmflow.training.trainer import run_training
    from dllmflow.workflow.finetune import eval_samplers, evaluate_sampler, with_remote_run

    settings = _settings(prep, f"s3://{s3.bucket}/runs/tiny_mdlm")
    run_dir = tmp_path_factory.mktemp("pod_a") / "flow-1"
    stage = with_remote_run(settings.with_run_dir(run_dir), str(run_dir))  # as workflow.finetune.train
    assert stage.checkpoint.remote_dir == f"s3://{s3.bucket}/runs/tiny_mdlm/flow-1"
    with pytest.raises(RuntimeError, match="injected failure after step 2"):
        run_training(stage, run_dir, hooks=[FailAfterStep(2)])
    shutil.rmtree(run_dir)  # the trainer's pod is gone, and its disk with it
    assert run_training(stage, run_dir, resume=True).final_step == 4
    sampler = eval_samplers(settings)[0]
    result = evaluate_sampler(settings, str(run_dir), sampler)
    return SimpleNamespace(
        settings=settings, run_dir=run_dir, remote=stage.checkpoint.remote_dir, sampler=sampler, result=result
    )


def _accuracy(result: dict) -> dict:
    """What must not change with where the export was read from (speed figures do)."""
    keys = [k for k in result["metrics"] if k.startswith("exact_match")]
    answers = [p.get("completion", p.get("prediction")) for p in result["predictions"]]
    return {
        "metrics": {k: result["metrics"][k] for k in keys},
        "answers": answers,
        "sha256": result["protocol"]["checkpoint_sha256"],
    }


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_trainer_mirrors_the_loss_log_and_settings(trained, s3):
    from dllmflow.training import storage

    run_dir, prefix = trained.run_dir, "runs/tiny_mdlm/flow-1/"
    client = s3.client()

    def remote_bytes(name: str) -> bytes:
        return client.get_object(Bucket=s3.bucket, Key=prefix + name)["Body"].read()

    # the resume on a fresh disk got steps 1-2 back from the bucket, then logged 3-4: the whole log
    assert [r["step"] for r in runs.read_metrics(run_dir)] == [1, 2, 3, 4]
    assert remote_bytes("metrics.jsonl") == (run_dir / "metrics.jsonl").read_bytes()
    assert remote_bytes("settings.json") == (run_dir / "settings.json").read_bytes()
    # unchanged bytes are not uploaded again; a changed log is
    assert storage.mirror_run_files(run_dir, trained.remote) == []
    extra = run_dir.parent / "extra"
    shutil.copytree(run_dir, extra, ignore=shutil.ignore_patterns("checkpoints"))
    with open(extra / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0}\n')
    assert storage.mirror_run_files(extra, trained.remote) == ["metrics.jsonl"]
    assert remote_bytes("metrics.jsonl").endswith(b'{"step": 5, "loss": 1.0}\n')
    storage.mirror_run_files(run_dir, trained.remote)  # the true log back for the other tests
    assert remote_bytes("metrics.jsonl") == (run_dir / "metrics.jsonl").read_bytes()


def test_another_pod_restores_what_evaluate_reads(trained, tmp_path, monkeypatch):
    from dllmflow.training import storage
    from dllmflow.workflow.card import loss_chart
    from dllmflow.workflow.finetune import evaluate_sampler
    from dllmflow.workflow.restore import restore_run_dir

    pod_b = tmp_path / "pod_b" / "flow-1"  # the same flow run dir, on a disk that never saw training
    restored = restore_run_dir(trained.settings, str(pod_b))
    export = runs.RunLayout(pod_b).export()
    assert export is not None and export.resolve().parent.parent.name == "step_000004"
    assert runs.read_metrics(pod_b) == runs.read_metrics(trained.run_dir)
    assert (pod_b / "settings.json").read_bytes() == (trained.run_dir / "settings.json").read_bytes()
    # only the export: no DCP shards, no optimizer state, no RNG files
    assert sorted(p.name for p in (pod_b / "checkpoints" / "step_000004").iterdir()) == [
        "model",
        "trainer_state.json",
    ]
    assert [p.name for p in (pod_b / "checkpoints" / "step_000004" / "model").iterdir()] == ["consolidated"]
    export_bytes = _bytes(runs.RunLayout(trained.run_dir).export())
    ratio = restored["bytes"] / export_bytes
    step_bytes = _bytes(trained.run_dir / "checkpoints" / "step_000004")
    print(
        f"restore: {restored['bytes']:,} bytes; export {export_bytes:,} ({ratio:.3f}x); step dir {step_bytes:,}"
    )
    assert 1.0 <= ratio < 1.05

    # what end's card and register's MLflow backfill read: the same loss curve
    curve = loss_chart(str(pod_b))["data"]["values"]
    assert len(curve) == 8 and curve == loss_chart(str(trained.run_dir))["data"]["values"]
    result = evaluate_sampler(trained.settings, str(pod_b), trained.sampler)
    assert _accuracy(result) == _accuracy(trained.result)
    assert result["protocol"]["checkpoint"] != trained.result["protocol"]["checkpoint"]  # pod B's copy

    # complete now, as the trainers' own run dir is: nothing is asked of the store
    def no_store(*args, **kwargs):
        raise AssertionError("the store was asked")

    monkeypatch.setattr(storage, "remote_fs", no_store)
    assert restore_run_dir(trained.settings, str(pod_b)) == {"bytes": 0, "files": []}
    assert restore_run_dir(trained.settings, str(trained.run_dir)) == {"bytes": 0, "files": []}
    monkeypatch.undo()

    # a run dir that lost only its loss log gets only that
    (pod_b / "metrics.jsonl").unlink()
    again = restore_run_dir(trained.settings, str(pod_b))
    assert again == {
        "bytes": (trained.run_dir / "metrics.jsonl").stat().st_size,
        "files": [str(pod_b / "metrics.jsonl")],
    }


def test_corrupt_export_object_is_named(trained, s3, tmp_path):
    from dllmflow.workflow.restore import restore_run_dir

    client, key = s3.client(), "runs/tiny_mdlm/flow-1/step_000004/model/consolidated/config.json"
    good = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=key, Body=good.replace(b"{", b"{ ", 1))
    try:
        with pytest.raises(
            UserError,
            match=r"step_000004's export does not match its manifest.json .*config.json: checksum mismatch",
        ):
            restore_run_dir(trained.settings, str(tmp_path / "pod_c" / "flow-1"))
    finally:
        client.put_object(Bucket=s3.bucket, Key=key, Body=good)
    assert runs.RunLayout(tmp_path / "pod_c" / "flow-1").export() is None  # nothing half-restored in place


def test_bucket_without_the_finished_run_is_one_line(trained, s3, prep, tmp_path):
    from dllmflow.workflow.restore import restore_run_dir

    empty = _settings(prep, f"s3://{s3.bucket}/runs/empty")
    with pytest.raises(UserError) as e:
        restore_run_dir(empty, str(tmp_path / "flow-1"))
    assert str(e.value).startswith(
        f"checkpoint.remote_dir s3://{s3.bucket}/runs/empty/flow-1: holds no finished run (LATEST: none;"
    )
    assert "\n" not in str(e.value)
    # the bucket's run stopped short of the recipe's end (here: a recipe of 8 steps)
    longer = trained.settings.model_copy(
        update={"train": trained.settings.train.model_copy(update={"max_steps": 8})}
    )
    with pytest.raises(
        UserError, match=r"holds no finished run \(LATEST: step_000004; the run ends at step_000008\)"
    ):
        restore_run_dir(longer, str(tmp_path / "other" / "flow-1"))
    assert not (tmp_path / "other" / "flow-1").exists()


def test_trainer_fetches_a_model_export_it_lacks(trained, s3, tmp_path):
    """`model.remote_dir` (uno's adapter on the AR control): a trainer whose disk lacks the export named by
    `pretrained_model_name_or_path` fetches that step's export (through LATEST: the bucket's), verified;
    once there it asks nothing; a path that is no run's export, or a prefix without a run, is one line."""
    from dllmflow.models.drafting_adapter import weights_digest
    from dllmflow.training.storage import fetch_model_export

    local = runs.find_consolidated(trained.run_dir)
    via_latest = tmp_path / "pod_d" / "checkpoints" / runs.LATEST / runs.MODEL / runs.CONSOLIDATED
    assert fetch_model_export(trained.remote, via_latest) > 0
    assert weights_digest(via_latest) == weights_digest(local)
    assert (tmp_path / "pod_d" / "checkpoints" / "step_000004").is_dir()  # the bucket's LATEST, in place
    assert fetch_model_export(trained.remote, via_latest) == 0  # already here: the store is not asked
    named = tmp_path / "pod_e" / "checkpoints" / "step_000004" / runs.MODEL / runs.CONSOLIDATED
    assert fetch_model_export(trained.remote, named) > 0 and weights_digest(named) == weights_digest(local)
    with pytest.raises(UserError, match=r"is not a run's export \(<run>/checkpoints/<step_NNNNNN or LATEST>"):
        fetch_model_export(trained.remote, tmp_path / "pod_f" / "model")
    with pytest.raises(
        UserError, match=rf"model.remote_dir s3://{s3.bucket}/runs/nothing: holds no checkpoint"
    ):
        fetch_model_export(
            f"s3://{s3.bucket}/runs/nothing", tmp_path / "pod_g" / via_latest.relative_to(tmp_path / "pod_d")
        )


@pytest.mark.parametrize(
    ("recipe", "what", "overrides"),
    [
        ("tiny_addition.yaml", "ar_control", {}),
        ("tiny_idlm.yaml", "stages", {"dllm": {"block_length": [1, 2]}}),
    ],
)
def test_mirrored_runs_are_what_train_mirrored(recipe, what, overrides, tmp_path, monkeypatch):
    """What `workflow.finetune.train` hands the launcher (each stage's run dir and remote prefix) is what
    `restore_run_dir` restores: the launcher replaced by one that records and writes a finished export."""
    from dllmflow.training import launch as launch_module
    from dllmflow.workflow import finetune
    from dllmflow.workflow.restore import mirrored_runs

    calls = []

    def fake_launch(stage, resume=False, mlflow_run_id=None, **kwargs):
        calls.append((Path(stage.resolved_run_dir), stage.checkpoint.remote_dir))
        layout = runs.RunLayout(stage.resolved_run_dir)
        export = runs.export_dir(layout.step_dir(stage.train.max_steps))
        export.mkdir(parents=True)
        (export / runs.HF_CONFIG).write_text("{}")
        runs.write_latest(layout.checkpoints, runs.step_dir_name(stage.train.max_steps))
        return SimpleNamespace(app_handle="fake", log_dir=None)

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    remote = str(tmp_path / "bucket" / "recipe")  # any fsspec URL; this one holds nothing
    settings = load_settings(ROOT / "params" / recipe, checkpoint={"remote_dir": remote}, **overrides)
    run_dir = str(tmp_path / "runs" / "flow-7")
    finetune.train(settings, run_dir)
    mirrored = mirrored_runs(settings, run_dir)
    assert sorted((Path(st.resolved_run_dir), st.checkpoint.remote_dir) for st, _ in mirrored) == sorted(
        calls
    )
    assert len(calls) == 2, calls  # the dLLM and its control, or a curriculum of two stages
    exports = [Path(st.resolved_run_dir).name for st, with_export in mirrored if with_export]
    assert exports == (["flow-7", "ar_control"] if what == "ar_control" else ["stage_1"])


def test_control_prefix_is_the_flow_runs(tmp_path):
    """Each flow run's AR control mirrors under that run's prefix: a second run of the recipe never finds
    the first's finished control in the bucket and takes it for its own (train and restore agree on the
    prefix: test_mirrored_runs_are_what_train_mirrored)."""
    from dllmflow.workflow.restore import mirrored_runs

    remote = str(tmp_path / "bucket" / "recipe")
    settings = load_settings(ROOT / "params" / "tiny_addition.yaml", checkpoint={"remote_dir": remote})
    first = mirrored_runs(settings, str(tmp_path / "runs" / "flow-7"))
    second = mirrored_runs(settings, str(tmp_path / "runs" / "flow-8"))
    assert [st.checkpoint.remote_dir for st, _ in first] == [
        f"{remote}/flow-7",
        f"{remote}/flow-7/ar_control",
    ]
    assert second[-1][0].checkpoint.remote_dir == f"{remote}/flow-8/ar_control"
