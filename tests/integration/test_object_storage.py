"""Object storage end to end on a real S3 endpoint (a `moto_server` started by the test):

  * training checkpoints mirrored to `checkpoint.remote_dir: s3://...` (every step dir + LATEST); a run
    that loses its whole local run dir resumes from the bucket with the losses of an uninterrupted run;
  * the endpoint down at checkpoint time: a UserError naming the store, and the remote LATEST (and the
    local one) stay on complete checkpoints; a later resume still works;
  * a DVC S3 remote: `dvc push`, lose cache and outputs, `dvc pull` gives byte-identical data.

The Metaflow S3 datastore and MLflow artifacts on S3 are checked by the production-stack flow run in
test_mlflow_postgres.py (one flow run covers both).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from _dvc_repo import copy_prepare_stage, file_hashes, init_repo, run
from _prepared import prepare_tiny, remote_run_settings

from _plugins.fault_hooks import FailAfterStep
from dllmflow.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=32)


def _settings(prep: Path, remote: str | None, max_steps: int = 4):
    return remote_run_settings(RECIPE, prep, remote, max_steps)


def test_checkpoints_mirror_to_s3_and_resume_after_losing_the_local_disk(s3, prep, tmp_path, monkeypatch):
    from dllmflow.training import storage
    from dllmflow.training.trainer import run_training

    reference = run_training(_settings(prep, None), tmp_path / "reference")

    remote = f"s3://{s3.bucket}/runs/tiny"
    settings = _settings(prep, remote)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure after step 2"):
        run_training(settings, run_dir, hooks=[FailAfterStep(2)])
    keys = s3.keys("runs/tiny/")
    assert "runs/tiny/LATEST" in keys and "runs/tiny/step_000002/trainer_state.json" in keys
    assert any(k.startswith("runs/tiny/step_000002/model/__0_") for k in keys)
    assert "runs/tiny/step_000002/rng/rank_00000.safetensors" in keys
    assert storage.remote_latest(remote) == "step_000002"

    shutil.rmtree(run_dir)  # the pod is gone, and its disk with it
    resumed = run_training(settings, run_dir, resume=True)
    assert resumed.final_step == 4
    assert resumed.losses == pytest.approx(reference.losses[2:], rel=1e-6)
    # the final step and its consolidated export are mirrored too; keep_last prunes nothing yet
    assert storage.remote_latest(remote) == "step_000004"
    keys = s3.keys("runs/tiny/")
    assert "runs/tiny/step_000004/model/consolidated/config.json" in keys
    assert "runs/tiny/step_000004/model/consolidated/settings.json" in keys
    assert {k.split("/")[2] for k in keys if k.count("/") > 2} == {"step_000002", "step_000004"}

    # a whole restored run: the consolidated export loads from a fresh dir restored from the bucket
    from dllmflow.runs import RunLayout

    fresh = tmp_path / "fresh" / "checkpoints"
    assert storage.restore_run(remote, fresh).name == "step_000004"
    assert RunLayout(fresh.parent).export() is not None
    assert storage.restore_run(remote, fresh) is None  # a local checkpoint exists: nothing to do


def test_endpoint_down_at_checkpoint_time_keeps_latest_on_the_last_complete_step(
    s3, prep, tmp_path, monkeypatch
):
    from dllmflow.runs import RunLayout
    from dllmflow.training import storage
    from dllmflow.training.trainer import run_training

    remote = f"s3://{s3.bucket}/runs/down"
    settings = _settings(prep, remote)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure"):
        run_training(settings, run_dir, hooks=[FailAfterStep(2)])
    # A copy of the bucket's state before the outage (moto keeps it in memory only).
    snapshot = tmp_path / "snapshot"
    storage.remote_fs(remote)[0].get(f"{s3.bucket}/runs/down/", str(snapshot) + "/", recursive=True)
    assert (snapshot / "LATEST").read_text().strip() == "step_000002"

    s3.stop()
    # Fail fast instead of botocore's retries against a dead endpoint.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    with pytest.raises(
        UserError, match=r"checkpoint.remote_dir s3://dllmflow/runs/down: upload of step_000004"
    ):
        run_training(settings, run_dir, resume=True)
    # Local: LATEST names a complete step dir (save_checkpoint published it before the upload).
    latest = RunLayout(run_dir).latest_step()
    assert latest is not None and (latest / "trainer_state.json").is_file()
    # Remote: the store was never told about step 4 (LATEST is written after every file is up).
    assert (snapshot / "LATEST").read_text().strip() == "step_000002"

    # Resuming against a remote store that is unreachable, with the local disk intact, works locally:
    # restore_run asks the store nothing when a local checkpoint exists.
    result = run_training(_settings(prep, None), run_dir, resume=True)
    assert result.final_step == 4


def test_dvc_s3_remote_push_pull(s3, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_prepare_stage(repo)
    params = repo / "params" / "tiny_mdlm.yaml"
    data = yaml.safe_load(params.read_text())
    data["dataset"]["limit"] = 32
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    init_repo(repo)

    run("dvc", "repro", cwd=repo)
    out = repo / "data" / "prepared" / "tiny"
    before = file_hashes(out)
    run("dvc", "remote", "add", "-d", "s3r", f"s3://{s3.bucket}/dvc", cwd=repo)
    run("dvc", "remote", "modify", "s3r", "endpointurl", s3.endpoint, cwd=repo)
    run("dvc", "push", cwd=repo)
    assert any(k.startswith("dvc/files/md5/") for k in s3.keys("dvc/"))

    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(out)
    run("dvc", "pull", cwd=repo)
    assert file_hashes(out) == before
