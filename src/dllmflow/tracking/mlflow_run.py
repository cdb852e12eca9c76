"""The MLflow run of a training run: connect to the store, open it at the flow's start, log each
evaluation into it, complete it (tags, settings.json, missing training steps) at the end.

    from dllmflow.tracking.mlflow_run import log_eval, log_run, open_run
    run_id = open_run(settings, lineage={...})          # flow start: training logs into it live
    log_eval(settings, run_id, "llada", result)          # one sampler (log_run logs those missing)
    run_id = log_run(settings, run_dir, evals=..., lineage={...}, run_id=run_id)

Tracking URI: `registry.tracking_uri`, else `MLFLOW_TRACKING_URI`, else `sqlite:///<cwd>/mlflow.db`
(created and migrated once, under a file lock). Registration and the gate: `tracking.registry`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.runs import RunLayout, read_metrics
from dllmflow.settings import Settings
from dllmflow.tracking.dataset_input import log_dataset_input, prepared_dataset
from dllmflow.training.live import (
    MAX_BATCH_METRICS,
    create_run,
    is_number,
    resolve_tracking_uri,
    train_metrics,
)


def connect(settings: Settings | None = None) -> str:
    """Point MLflow at the tracking store; a dead server fails here with one clear line."""
    import mlflow

    uri = resolve_tracking_uri(settings)
    if uri.startswith(("http://", "https://")):
        import httpx

        try:
            httpx.get(uri.rstrip("/") + "/health", timeout=10.0).raise_for_status()
        except httpx.HTTPError as e:
            raise UserError(
                f"MLflow tracking server {uri} is not reachable ({type(e).__name__}); start it or fix "
                "registry.tracking_uri / MLFLOW_TRACKING_URI"
            ) from None
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    if uri.startswith("sqlite:///"):
        _init_sqlite_store(uri)
    return uri


_INITIALISED_STORES: set[str] = set()


def _init_sqlite_store(uri: str) -> None:
    """Create/migrate a SQLite store once, under a file lock: two processes opening a fresh store at
    once both run MLflow's schema migration and one fails (`duplicate column name`). Touching both
    stores (tracking, registry) here migrates them; later opens find the tables and skip it."""
    if uri in _INITIALISED_STORES:
        return
    from filelock import FileLock
    from mlflow import MlflowClient

    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{db}.lock"):
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)
    _INITIALISED_STORES.add(uri)


def git_sha(cwd: str | os.PathLike | None = None) -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def open_run(
    settings: Settings, *, lineage: dict[str, str] | None = None, run_name: str | None = None
) -> str:
    """The MLflow run of this flow run, opened at its start so that training and evaluation log into
    it live: reused when one is tagged with the same Metaflow pathspec (a resumed flow does not fork
    the record), else created RUNNING with the settings as params and the lineage as tags."""
    connect(settings)
    lineage = _tags(lineage)
    experiment = _experiment_id(settings)
    run_id = _existing_run(experiment, lineage.get("metaflow_run"))
    if run_id is None:
        run_id = create_run(settings, tags=_run_tags(settings, lineage), run_name=run_name)
    return run_id


def log_run(
    settings: Settings,
    run_dir: str | os.PathLike,
    *,
    evals: dict[str, dict[str, Any]] | None = None,
    lineage: dict[str, str] | None = None,
    run_name: str | None = None,
    run_id: str | None = None,
) -> str:
    """Complete the MLflow run of a training run: lineage tags, settings.json and eval results (each
    sampler once). `run_id` is the live run the flow opened at `start`; without it (a run dir trained
    before live tracking, or with it off) the run is found by Metaflow pathspec or created. Training
    curves normally arrived live; steps of metrics.jsonl the run lacks (no live tracking, or an outage
    that outlasted `registry.flush_timeout_s`) are backfilled. Returns the MLflow run id."""
    from mlflow import MlflowClient
    from mlflow.entities import RunTag

    connect(settings)
    lineage = _tags(lineage)
    opened_here = run_id is None
    if run_id is None:
        run_id = open_run(settings, lineage=lineage, run_name=run_name)
    client = MlflowClient()
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in _run_tags(settings, lineage).items()])
    dataset = prepared_dataset(settings, lineage.get("data_content_hash"))
    if dataset is not None:  # MLflow 3: the run's input; the eval metrics name it too (log_eval)
        log_dataset_input(client, run_id, dataset)
    backfill_train_metrics(client, run_id, run_dir)
    settings_json = RunLayout(run_dir).settings_json
    if settings_json.is_file():
        client.log_artifact(run_id, str(settings_json))
    logged = client.get_run(run_id).data.metrics
    for sampler, result in (evals or {}).items():
        if not any(k.startswith(f"eval/{sampler}/") for k in logged):  # evaluate logged it live
            log_eval(settings, run_id, sampler, result)
    if opened_here:
        client.set_terminated(run_id, "FINISHED")
    return run_id


def log_eval(settings: Settings, run_id: str, sampler: str, result: dict[str, Any]) -> None:
    """One sampler's evaluation into the run: `eval/<sampler>/<metric>` metrics (step 0; registration
    links them to the logged model and the dataset; the model before training, `eval.untrained_baseline`,
    as `eval/<sampler>/before/<metric>`; the AR base, `eval.ar_baseline`, is the evaluation `ar`) and the
    JSON result. The run's dataset input is `log_run`'s (the lineage's data hash) and registration's (the
    run's `data_content_hash`): not the manifest on disk now, which may be newer data than was trained on."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    connect(settings)
    client = MlflowClient()
    now = int(time.time() * 1000)
    metrics = [
        Metric(f"eval/{sampler}/{k}", float(v), now, 0)
        for k, v in result.get("metrics", {}).items()
        if is_number(v)
    ]
    metrics += [
        Metric(f"eval/{sampler}/before/{k}", float(v), now, 0)
        for k, v in result.get("baseline", {}).get("metrics", {}).items()
        if is_number(v)
    ]
    client.log_batch(run_id, metrics=metrics)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"eval_{sampler}.json"
        path.write_text(json.dumps(result, indent=2, default=str))
        client.log_artifact(run_id, str(path), artifact_path="eval")


def log_comparison(settings: Settings, run_id: str, side: dict[str, Any]) -> None:
    """The dLLM vs AR-control side by side (`eval.ar_control`) into the run: `control/dllm/<figure>`,
    `control/ar_control/<figure>` and `control/em_gap` metrics (step 0), `control.sampler` tag."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    connect(settings)
    now = int(time.time() * 1000)
    metrics = [Metric(f"control/{arm}/{k}", float(v), now, 0) for arm in ("dllm", "ar_control")
               for k, v in side[arm].items() if is_number(v)]  # fmt: skip
    if is_number(side.get("em_gap")):
        metrics.append(Metric("control/em_gap", float(side["em_gap"]), now, 0))
    client = MlflowClient()
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, "control.sampler", side["sampler"])


def backfill_train_metrics(client: Any, run_id: str, run_dir: str | os.PathLike) -> int:
    """Log the steps of metrics.jsonl that the run does not hold yet (by `train/loss` history), in
    batches. Returns how many steps were backfilled."""
    have = {m.step for m in client.get_metric_history(run_id, "train/loss")}
    missing = [row for row in read_metrics(run_dir) if int(row.get("step", 0)) not in have]
    mtime = RunLayout(run_dir).metrics_jsonl
    stamp = int(mtime.stat().st_mtime * 1000) if mtime.is_file() else None
    metrics = [m for row in missing for m in train_metrics(row, int(row.get("step", 0)), stamp)]
    for i in range(0, len(metrics), MAX_BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[i : i + MAX_BATCH_METRICS])
    return len(missing)


def _tags(lineage: dict[str, Any] | None) -> dict[str, str]:
    return {k: str(v) for k, v in (lineage or {}).items() if v is not None}


def _run_tags(settings: Settings, lineage: dict[str, str]) -> dict[str, str]:
    return {"dllmflow.mode": settings.dllm.mode, "git_sha": git_sha(), **lineage}


def _experiment_id(settings: Settings) -> str:
    import mlflow

    return mlflow.set_experiment(settings.registry.experiment_name).experiment_id


def _existing_run(experiment_id: str, pathspec: str | None) -> str | None:
    if not pathspec:
        return None
    import mlflow

    found = mlflow.search_runs(
        [experiment_id],
        filter_string=f"tags.metaflow_run = '{pathspec}'",
        output_format="list",
        max_results=1,
    )
    return found[0].info.run_id if found else None
