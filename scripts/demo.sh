#!/usr/bin/env bash
# The demo: the whole product on the embedded default (a tiny random model learning 2-digit addition,
# local MLflow): prepare -> train (torchx -> torchrun) -> evaluate (untrained vs trained, per sampler)
# -> register (MLflow, gated champion) -> card, then a results table and the next commands.
# ~1-4 min of training, ~5 min in all with setup, on 2 quiet CPU cores. Quiet CI logs: DLLMFLOW_QUIET=1 bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python flows/finetune.py --config recipe params/tiny_addition.yaml run "$@"
