# Environment for running dllmflow on one machine (sourced by the Makefile, .ci/run and tests).
# Local Metaflow datastore/metadata, offline Hugging Face, local MLflow (SQLite), no telemetry.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$here/.venv/bin:$PATH"
export USERNAME="${USERNAME:-${USER:-dllmflow}}"
export METAFLOW_DEFAULT_DATASTORE="${METAFLOW_DEFAULT_DATASTORE:-local}"
export METAFLOW_DEFAULT_METADATA="${METAFLOW_DEFAULT_METADATA:-local}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 DVC_NO_ANALYTICS=1 TOKENIZERS_PARALLELISM=false
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$here/mlflow.db}"
# Quiet logs (CI, pipes): no HF/transformers tqdm bars either ("Loading weights: 100%|...").
case "${DLLMFLOW_QUIET:-}" in ""|0|false|no) ;; *) export HF_HUB_DISABLE_PROGRESS_BARS=1 ;; esac
