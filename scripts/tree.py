"""Print the project tree, one line per tracked file, with the first line of each module's docstring.

python scripts/tree.py            # prints the tree (the README's "Layout" section is this output)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = {
    ".ci/run": "CI entry point: runs the README's test command (make test)",
    ".dvc/config": "DVC repo config (add a remote: dvc remote add -d store <dir|s3://...>)",
    ".dvc/.gitignore": "DVC internals kept out of git",
    ".dvcignore": "paths DVC does not scan",
    ".gitignore": "run outputs, caches, local stores",
    "Makefile": "make demo | make test | make test-fast | make lint | make bench",
    "README.md": "this file",
    "docs/contracts.md": "interfaces the modules agree on",
    "docs/strategies.md": "the math of every mode and sampler, the shared conventions, the papers (cited as docs/strategies.md §X)",
    "bench/gpu.sh": "GPU check (one short script for a lent H200): SmolLM2 A2D full + LoRA, bf16 FSDP2 + AC, MFU, memory vs plan, sampler tok/s",
    "docs/adding_a_mode.md": "adding a seventh dllm.mode: config, strategy, ModeSpec, samplers, tests",
    "docs/data_formats.md": "bring your own data: formats, field mapping, weighted mixtures, held-out split",
    "docs/lm_eval.md": "lm-evaluation-harness: the dllmflow model, the Monte-Carlo ELBO estimator, the local GSM8K task",
    "docs/memory_planner.md": "`dllmflow plan`: what it counts and how it was validated",
    "docs/security.md": "who may run a checkpoint's code, input checks, concurrent runs and registrations",
    "src/dllmflow/evaluation/tasks/gsm8k.yaml": "lm-eval task: the held-out GSM8K split scored like `dllmflow evaluate`",
    "dvc.lock": "DVC record of the last reproduced stages (hashes of deps, params, outs)",
    "dvc.yaml": "DVC stages: prepare; regenerate -> prepare_dflash",
    "pyproject.toml": "package, console script `dllmflow`, ruff + pytest config",
    "requirements.lock": "exact versions CI tested (torch==2.13.0 CPU wheel here)",
    "infra/.torchxconfig": "torchx scheduler settings: local_cwd, kubernetes, slurm (TORCHXCONFIG names it)",
    "infra/Dockerfile": "training image (CUDA torch + the lock)",
    "infra/README.md": "leaving this machine: image, schedulers, multi-node",
    "infra/argo.md": "production: the flows on Argo (project, schedule, GPU placement), torchx component",
    "infra/k8s/mlflow.yaml": "MLflow server + registry on Kubernetes (Postgres, S3)",
    "scripts/demo.sh": "the demo: FinetuneFlow on params/tiny_mdlm.yaml",
    "scripts/env.sh": "environment: venv on PATH, local Metaflow/MLflow, offline HF",
    "scripts/lock.sh": "re-freeze requirements.lock",
    "scripts/setup.sh": "create .venv and install exactly the lock (idempotent)",
    "src/dllmflow/data/templates/chat.jinja": "chat template with {% generation %} tags (assistant mask)",
    "src/dllmflow/py.typed": "typing marker",
}


def describe(path: str) -> str:
    if path in NOTES:
        return NOTES[path]
    p = ROOT / path
    if p.suffix == ".py":
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""
    if path.startswith("tests/golden/") and p.suffix == ".json":
        return f"golden {p.stem} trajectory (float64): loss + grad norm of the first optimizer steps, one recording for every machine (test_golden.py)"
    if p.suffix == ".yaml" and path.startswith("params/"):
        first = next((ln for ln in p.read_text().splitlines() if ln.startswith("#")), "# recipe")
        return first.lstrip("# ").strip()
    return ""


def tree_lines(limit: int = 100) -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = sorted(out.split())
    width = max(len(f) for f in files) + 2
    lines = []
    for f in files:
        note = describe(f)
        note = note if len(note) <= limit else note[: limit - 1].rstrip() + "…"
        lines.append(f"{f:<{width}}# {note}".rstrip(" #"))
    return lines


def main() -> None:
    lines = tree_lines()
    if "--readme" not in sys.argv:
        print("\n".join(lines))
        return
    readme = ROOT / "README.md"
    head, _, rest = readme.read_text().partition("## Layout")
    before, _, after = rest.partition("```text\n")
    _, _, tail = after.partition("```\n")
    readme.write_text(head + "## Layout" + before + "```text\n" + "\n".join(lines) + "\n```\n" + tail)


if __name__ == "__main__":
    main()
