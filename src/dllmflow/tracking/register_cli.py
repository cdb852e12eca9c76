"""`dllmflow register`: log a finished training run to MLflow, register its consolidated checkpoint
and apply the champion gate (what the flow's register step does, from a shell).

    dllmflow register --run-dir runs/tiny_mdlm --eval eval_llada.json [--sampler llada]
"""

from __future__ import annotations

import json
from pathlib import Path

from dllmflow.runs import RunLayout, find_consolidated
from dllmflow.tracking.mlflow_run import git_sha, log_run
from dllmflow.tracking.registry import apply_gate, register_model


def add_cli_args(parser) -> None:
    from dllmflow.common.cli_args import add_flag

    add_flag(
        parser, "--run-dir", required=True, help="A finished training run directory (holds settings.json)."
    )
    parser.add_argument(
        "--eval", dest="eval_files", action="append", default=[], help="evaluate --output JSON files."
    )
    parser.add_argument(
        "--sampler",
        default=None,
        help="Sampler recorded for the pyfunc (default: the first eval's, else the export's own).",
    )


def cli_main(args) -> int:
    from dllmflow.settings import load_settings_json
    from dllmflow.tracking.model_env import prefetch_wheel

    prefetch_wheel()  # the model's wheel builds (a subprocess) while the run is logged
    run_dir = Path(args.run_dir)
    settings = load_settings_json(RunLayout(run_dir).settings_json)
    evals = {}
    for f in args.eval_files:
        result = json.loads(Path(f).read_text())
        evals[result["protocol"]["sampler"]] = result
    if not (sampler := args.sampler or next(iter(evals), None)):
        from dllmflow.inference.generate import resolve_default_sampler

        sampler = resolve_default_sampler(find_consolidated(run_dir))  # the export's, else its mode's
    run_id = log_run(settings, run_dir, evals=evals, lineage={"git_sha": git_sha()})
    version = register_model(
        settings,
        run_id,
        find_consolidated(run_dir),
        sampler=sampler,
        sampler_settings=evals.get(sampler, {}).get("protocol", {}).get("sampler_settings"),
    )
    decision = apply_gate(settings, version, evals, sampler)
    print(json.dumps({"run_id": run_id, **decision}, indent=2))
    return 0
