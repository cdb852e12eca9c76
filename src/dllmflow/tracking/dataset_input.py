"""The prepared data as an MLflow dataset (MLflow 3's model-centric tracking): logged as the run's
training input, and named by the eval metrics that registration links to the logged model.

    dataset = prepared_dataset(settings, content_hash)   # None when there is nothing to name it by
    log_dataset_input(client, run_id, dataset)           # the run's input, context "training"
    Metric(..., dataset_name=dataset.name, dataset_digest=dataset.digest)

Only metadata travels (no rows): the prepared dir's location, and its manifest's `content_hash` as the
digest (its first 32 hex digits: MLflow stores at most 36 characters; the flow's run also holds the
whole hash as its `data_content_hash` lineage tag).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from dllmflow.settings import Settings

DIGEST_CHARS = 32  # MLflow's datasets.digest column is VARCHAR(36)


def prepared_dataset(settings: Settings, content_hash: str | None = None) -> Any | None:
    """The prepared data of `settings` as an `mlflow.data` MetaDataset. Its digest: `content_hash` (the
    flow's lineage, recorded when it prepared the data the model trained on), else the manifest now in
    `dataset.prepared_dir`; None when neither is known."""
    from mlflow.data.meta_dataset import MetaDataset

    from dllmflow.data.prepared_dir import read_manifest

    prepared = settings.dataset.prepared_dir
    if not content_hash and "://" not in prepared:
        content_hash = (read_manifest(prepared) or {}).get("content_hash")
    if not content_hash:
        return None
    data = settings.dataset
    name = data.dataset_name or data.path_or_dataset_id
    return MetaDataset(_source(prepared), name=name, digest=content_hash[:DIGEST_CHARS])


def log_dataset_input(client: Any, run_id: str, dataset: Any, context: str = "training") -> None:
    """`dataset` as an input of the run (MLflow skips one it already holds). Runs registering at once
    all insert the experiment's one row for this dataset; the losers of that race (an integrity error,
    which MLflow does not retry) find the row on a second try."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.exceptions import MlflowException
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
    for attempt in range(3):
        try:
            client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags)])
            return
        except MlflowException:
            if attempt == 2:
                raise


def _source(prepared: str) -> Any:
    """MLflow's source for the dir: a local path, or s3://, gs://, ... (its artifact-repository schemes)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    uri = prepared if "://" in prepared else str(Path(prepared).resolve())
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": the first one fits
        warnings.simplefilter("ignore")
        return resolve_dataset_source(uri)
