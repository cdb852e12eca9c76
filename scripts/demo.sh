#!/usr/bin/env bash
# The demo: the whole product on the embedded default (tiny random model, bundled GSM8K, local MLflow).
# prepare (DVC) -> train (torchx -> torchrun) -> evaluate -> register (MLflow, gated champion) -> card.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python flows/finetune.py --config recipe params/tiny_mdlm.yaml run "$@"
