"""`dllmflow register`: log a finished training run to MLflow, register its consolidated checkpoint
and apply the champion gate (what the flow's register step does, from a shell).

    dllmflow register --run-dir runs/tiny_mdlm --eval eval_llada.json [--sampler llada]

An evaluation is bound to its checkpoint: each `--eval` file must record the run's export, by the
weights' hash its protocol holds (`checkpoint_sha256`, evaluation/protocol.py), or by its path when
it records no hash (a file written before hashes); otherwise nothing is logged and the refusal names
both. The hash, not the path, decides when both are there: a run dir moved after its evaluation still
registers, another checkpoint's figure never does.
"""

from __future__ import annotations

import json
from pathlib import Path

from dllmflow.errors import UserError
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

    run_dir = Path(args.run_dir)
    settings = load_settings_json(RunLayout(run_dir).settings_json)
    evals = {}
    for f in args.eval_files:
        result = read_eval(f)
        check_eval_binding(f, result, run_dir)
        evals[result["protocol"]["sampler"]] = result
    prefetch_wheel()  # the model's wheel builds (a subprocess) while the run is logged
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


def read_eval(path: str | Path) -> dict:
    """An `evaluate --output` JSON file, or a UserError naming it."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--eval {path}: cannot read an evaluation ({e.__class__.__name__}: {e})") from None
    if (
        not isinstance(result, dict)
        or not isinstance(result.get("protocol"), dict)
        or "sampler" not in result["protocol"]
    ):
        raise UserError(f"--eval {path}: not an `dllmflow evaluate --output` file (no protocol.sampler)")
    return result


def check_eval_binding(path: str | Path, result: dict, run_dir: Path) -> None:
    """UserError unless the evaluation in `path` ran `run_dir`'s export (see the module docstring)."""
    from dllmflow.evaluation.protocol import checkpoint_record

    export = find_consolidated(run_dir).resolve()
    protocol = result["protocol"]
    ours = checkpoint_record(export)
    recorded = protocol.get("checkpoint_sha256")
    if recorded is not None and ours.get("checkpoint_sha256") is not None:
        bound = recorded == ours["checkpoint_sha256"]
    else:  # no hash on one side: the path decides
        where = protocol.get("checkpoint_dir") or protocol.get("checkpoint")
        bound = where is not None and _export_of(where) == export
    if not bound:
        raise UserError(
            f"--eval {path}: it evaluated {protocol.get('checkpoint_dir') or protocol.get('checkpoint')} "
            f"(weights sha256 {recorded}), not the export of --run-dir {run_dir}: {export} (weights sha256 "
            f"{ours.get('checkpoint_sha256')}); evaluate that export (`dllmflow evaluate --checkpoint {run_dir} "
            "--output FILE`) and register with that file"
        )


def _export_of(checkpoint: str) -> Path | None:
    from dllmflow.runs import resolve_checkpoint

    try:
        return resolve_checkpoint(checkpoint).resolve()
    except UserError:  # gone, or not a dir
        return None
