"""MLflow side of a run: one MLflow run per flow run, a pyfunc model that generates, registration with
`candidate` / `champion` aliases and a gate that decides whether `champion` moves.

    from dllmflow.tracking.registry import open_run, log_eval, log_run, register_model, apply_gate
    run_id = open_run(settings, lineage={...})          # flow start: training logs into it live
    log_eval(settings, run_id, "llada", result)          # each evaluate branch
    run_id = log_run(settings, run_dir, evals=..., lineage={...}, run_id=run_id)
    version = register_model(settings, run_id, consolidated_dir, sampler="llada")
    decision = apply_gate(settings, version, evals)

Consumers load the champion anywhere MLflow is reachable, with no access to the training directories:

    import mlflow
    mlflow.pyfunc.load_model("models:/dllmflow-tiny-mdlm@champion").predict(["What is 2 + 3?"])

Tracking URI: `registry.tracking_uri`, else `MLFLOW_TRACKING_URI`, else `sqlite:///<cwd>/mlflow.db`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dllmflow.errors import UserError
from dllmflow.runs import RunLayout, find_consolidated, read_metrics
from dllmflow.settings import Settings
from dllmflow.training.live import (
    MAX_BATCH_METRICS,
    create_run,
    is_number,
    resolve_tracking_uri,
    train_metrics,
)

CANDIDATE, CHAMPION = "candidate", "champion"
SPECULATIVE = "acceptance"  # the DFlash evaluation/decoding (see mlflow_model.py)


# ---- tracking ----------------------------------------------------------------------------------------


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
    """One sampler's evaluation into the run: `eval/<sampler>/<metric>` metrics and the JSON result."""
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
    client.log_batch(run_id, metrics=metrics)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"eval_{sampler}.json"
        path.write_text(json.dumps(result, indent=2, default=str))
        client.log_artifact(run_id, str(path), artifact_path="eval")


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


# ---- the pyfunc model ----------------------------------------------------------------------------------


def generate_texts(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    sampler: str = "llada",
    overrides: dict[str, Any] | None = None,
    **settings: Any,
) -> list[str]:
    """Chat-templated prompts -> generated texts with `sampler`: its preset, then the recorded
    `settings` (knobs it does not take are dropped: models registered before the per-sampler configs
    recorded every knob of every sampler), then the caller's `overrides` (one it does not take is an
    error naming it). A sampler that does not fit the checkpoint's training mode, or prompts + new
    tokens beyond the model's positions, are refused."""
    import torch

    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import TRAINING_SETTINGS_ATTR, build_sampler_config
    from dllmflow.inference.generate import decode_response, encode_prompt, validate_sampler_request
    from dllmflow.models.limits import check_generation_fits

    validate_sampler_request(sampler)
    trained = getattr(model, TRAINING_SETTINGS_ATTR, None)  # set by load_for_generation
    check_sampler_mode(sampler, getattr(getattr(trained, "dllm", None), "mode", None))
    config = build_sampler_config(sampler, overrides, tokenizer, defaults=settings)
    torch.manual_seed(config.seed)
    runner = SAMPLERS[sampler](model, tokenizer, config, mask_id=model.config.mask_token_id)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    check_generation_fits(model, max(map(len, ids), default=0), config.max_new_tokens, runner.mask_id)
    result = runner.generate(ids)
    return [decode_response(tokenizer, seq) for seq in result.sequences]


def check_sampler_mode(sampler: str, mode: str | None) -> None:
    """UserError naming the sampler, the mode and the samplers that fit it (`dllmflow generate` only
    warns; a served model must not answer with a sampler that decodes another mode's model)."""
    from dllmflow.inference.generate import sampler_misfit

    misfit = sampler_misfit(sampler, mode)
    if misfit is not None:
        raise UserError(misfit)


def recorded_params(sampler: str, sampler_settings: dict[str, Any]) -> dict[str, Any]:
    """What a registered model generates with (its signature's param defaults): the sampler and its
    preset under the recorded settings."""
    from dllmflow.diffusion.samplers.base import build_sampler_config

    if sampler == SPECULATIVE:
        return {"sampler": sampler, **sampler_settings}
    preset = build_sampler_config(sampler, defaults=sampler_settings).model_dump()
    return {"sampler": sampler, **sampler_settings, **preset}


def split_params(generation: dict[str, Any], params: dict[str, Any] | None) -> tuple[str, dict, dict]:
    """One `predict` call's (sampler, recorded settings, the caller's overrides). MLflow fills each param
    the caller left out with its signature default (the recorded value), so only a value that differs
    from the record is the caller's own, checked strictly against the sampler's options."""
    recorded = generation.get("sampler_settings", {})
    params = from_param_sentinels(params or {})
    base = recorded_params(generation["sampler"], recorded)
    overrides = {k: v for k, v in params.items() if base.get(k) != v}
    sampler = overrides.pop("sampler", None) or generation["sampler"]
    params.pop("sampler", None)
    return sampler, {**recorded, **params}, overrides


def speculative_texts(pair: tuple, prompts: list[str], max_new_tokens: int) -> list[str]:
    """DFlash: greedy speculative decoding with the draft against its frozen target (same text as the
    target's own greedy decoding, fewer target forwards)."""
    from dllmflow.evaluation.acceptance import speculative_generate
    from dllmflow.inference.generate import decode_response, encode_prompt

    draft, target, tokenizer, _, cfg = pair
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.mask_token_id
    out = []
    for prompt in prompts:
        result = speculative_generate(
            draft,
            target,
            encode_prompt(tokenizer, prompt),
            int(max_new_tokens),
            int(cfg.block_size),
            list(cfg.target_layer_ids),
            mask_id,
            tokenizer.eos_token_id,
        )
        out.append(decode_response(tokenizer, result.tokens))
    return out


def prompts_of(model_input: Any) -> list[str]:
    if hasattr(model_input, "columns"):  # pandas DataFrame from the signature
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(x) for x in model_input[column].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(x) for x in model_input]


# MLflow params need a typed default; a sampler knob that is unset (None) travels as this sentinel.
_UNSET = {"long": -1, "double": -1.0, "string": ""}
_PARAM_TYPES = {
    "sampler": "string",
    "steps": "long",
    "max_new_tokens": "long",
    "block_size": "long",
    "temperature": "double",
    "threshold": "double",
    "remasking": "string",
    "seed": "long",
}


def from_param_sentinels(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k in _PARAM_TYPES and v != _UNSET[_PARAM_TYPES[k]]}


def _signature(sampler: str, sampler_settings: dict[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    recorded = recorded_params(sampler, sampler_settings)
    params = []
    for name, dtype in _PARAM_TYPES.items():
        value = recorded.get(name)
        params.append(ParamSpec(name, dtype, _UNSET[dtype] if value is None else value))
    return ModelSignature(
        inputs=Schema([ColSpec("string")]),  # a plain list of prompts
        outputs=Schema([ColSpec("string", "text")]),
        params=ParamSchema(params),
    )


def register_model(
    settings: Settings,
    run_id: str,
    consolidated_dir: str | os.PathLike,
    *,
    sampler: str,
    sampler_settings: dict[str, Any] | None = None,
) -> Any:
    """Log the consolidated checkpoint as a pyfunc model in `run_id` and register it under
    `registry.model_name` with alias `candidate`. Idempotent: a run already registered returns its
    existing version. Returns the `ModelVersion`."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.models import Model

    connect(settings)
    consolidated_dir = Path(consolidated_dir)
    if not (consolidated_dir / "config.json").is_file():
        raise UserError(
            f"{consolidated_dir}: no consolidated checkpoint (config.json missing); did training finish?"
        )
    client = MlflowClient()
    name = settings.registry.model_name
    existing = _version_of_run(client, name, run_id)
    if existing is not None:
        client.set_registered_model_alias(name, CANDIDATE, existing.version)
        return existing

    sampler_settings = {k: v for k, v in (sampler_settings or {}).items() if v is not None}
    generation = {"sampler": sampler, "sampler_settings": sampler_settings, "mode": settings.dllm.mode}
    if settings.model.trust_remote_code:  # the registering run's decision; the pyfunc loads with it
        generation["trust_remote_code"] = True
    artifacts = {"checkpoint": str(consolidated_dir)}
    if sampler == SPECULATIVE:  # the draft is useless without its target: ship a local target along
        target = _local_target(settings)
        if target is not None:
            artifacts["target"] = target
        else:
            generation["target"] = settings.dflash.target_model_id
    with tempfile.TemporaryDirectory() as tmp:
        gen_path = Path(tmp) / "generation.json"
        gen_path.write_text(json.dumps(generation, indent=2))
        with mlflow.start_run(run_id=run_id):
            # What `mlflow.pyfunc.log_model` does, without MLflow's serving check (see _PYFUNC_FLAVOR).
            info = Model.log(
                artifact_path=None,  # deprecated in favour of `name`, still a required argument
                name="model",
                flavor=_PYFUNC_FLAVOR,
                flavor_name="pyfunc.ModelFromCode",  # what pyfunc.log_model records for a code model
                validate_serving_input=False,
                python_model=str(Path(__file__).with_name("pyfunc.py")),
                artifacts={**artifacts, "generation": str(gen_path)},
                code_paths=[str(Path(__file__).parent)],
                signature=_signature(sampler, sampler_settings),
                input_example=["What is 2 + 3?"],
                pip_requirements=_pip_requirements(),
            )
    version = mlflow.register_model(info.model_uri, name, tags={"run_id": run_id, "sampler": sampler})
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    return client.get_model_version(name, version.version)


def _save_pyfunc(path: str, mlflow_model: Any, validate_serving_input: bool = True, **kwargs: Any) -> None:
    """`mlflow.pyfunc.save_model` as the flavor of `Model.log`, which reads `validate_serving_input`
    itself and then hands it to the flavor (pyfunc's own save_model refuses it)."""
    import mlflow

    mlflow.pyfunc.save_model(path=path, mlflow_model=mlflow_model, **kwargs)


# `Model.log` takes any object with `save_model` as the flavor. This one lets registration switch off
# MLflow's serving check (load the saved model, predict the input example): it loads the checkpoint and
# generates once more, half of `register`'s time on a tiny model and a second copy in memory on a real
# one, right after the evaluate steps ran this checkpoint. The input example is still saved (with its
# serving payload) and checked against the signature. MLflow's transformers flavor skips it alike.
_PYFUNC_FLAVOR = SimpleNamespace(__name__="mlflow.pyfunc", save_model=_save_pyfunc)


def _local_target(settings: Settings) -> str | None:
    """The DFlash target as a local dir (a `tiny:<dir>` target or a path), None for a hub id."""
    target = settings.dflash.target_model_id if settings.dflash else None
    if not target:
        return None
    target = target.removeprefix("tiny:")
    return str(Path(target)) if (Path(target) / "config.json").is_file() else None


def _version_of_run(client: Any, name: str, run_id: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except MlflowException:
        return None
    return min(versions, key=lambda v: int(v.version)) if versions else None


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    pins = []
    for pkg in ("torch", "transformers", "safetensors", "tokenizers", "mlflow", "pydantic-settings"):
        try:
            pins.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except Exception:
            continue
    return pins


# ---- the gate ------------------------------------------------------------------------------------------


def gate_floor(gate: Any) -> float:
    """The absolute floor of the gate metric: `min_tau` for DFlash's acceptance length `tau`,
    `min_accuracy` for every other (accuracy) metric."""
    return gate.min_tau if gate.metric == "tau" else gate.min_accuracy


def gate_decision(
    gate: Any,
    value: float,
    tokens_per_s: float,
    *,
    sampler: str,
    version: str | int,
    champion_version: str | int | None = None,
    champion_value: float = float("nan"),
) -> tuple[bool, str]:
    """(promote, reason) for a version scoring `value` on `gate.metric` (a `GateConfig`), against the
    current champion (None = none yet). Checked in order: the metric exists, the speed floor, the
    metric's absolute floor (`gate_floor`: a version below it never becomes champion, the first one
    included), then no champion / already champion / not worse than the champion minus the tolerance."""
    floor = gate_floor(gate)
    if not math.isfinite(value):
        return False, f"metric {gate.metric} missing for sampler {sampler}"
    if tokens_per_s < gate.min_tokens_per_s:
        return False, f"tokens_per_s {tokens_per_s:.2f} below the floor {gate.min_tokens_per_s}"
    if value < floor:
        return (
            False,
            f"{gate.metric} {value:.4f} below the floor {floor} (registry.gate: not champion material)",
        )
    if champion_version is None:
        return True, f"no champion yet ({gate.metric} {value:.4f} >= floor {floor})"
    if str(champion_version) == str(version):
        return True, "already champion"
    if not math.isfinite(champion_value) or value >= champion_value - gate.tolerance:
        return True, (
            f"{gate.metric} {value:.4f} >= champion v{champion_version} {champion_value:.4f} - {gate.tolerance}"
        )
    return False, (
        f"{gate.metric} {value:.4f} < champion v{champion_version} {champion_value:.4f} - {gate.tolerance}"
    )


def apply_gate(
    settings: Settings, version: Any, evals: dict[str, dict[str, Any]], sampler: str
) -> dict[str, Any]:
    """Move `champion` to `version` when `gate_decision` says so (its metric at or above the absolute
    floor, not below the current champion's minus `registry.gate.tolerance`, its speed at or above
    `registry.gate.min_tokens_per_s`). The decision and its reason are written as tags on the model
    version and on its run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    connect(settings)
    gate = settings.registry.gate
    client = MlflowClient()
    name = settings.registry.model_name
    metrics = evals.get(sampler, {}).get("metrics", {})
    acc = float(metrics.get(gate.metric, float("nan")))
    speed = float(metrics.get("tokens_per_s", 0.0))
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    promote, reason = gate_decision(
        gate,
        acc,
        speed,
        sampler=sampler,
        version=version.version,
        champion_version=champion.version if champion is not None else None,
        champion_value=float(champion.tags.get(f"eval.{gate.metric}", "nan")) if champion else float("nan"),
    )

    client.set_model_version_tag(name, version.version, f"eval.{gate.metric}", f"{acc:.6f}")
    client.set_model_version_tag(name, version.version, "eval.tokens_per_s", f"{speed:.4f}")
    client.set_model_version_tag(
        name, version.version, "gate.decision", "promoted" if promote else "rejected"
    )
    client.set_model_version_tag(name, version.version, "gate.reason", reason)
    if version.run_id:
        client.set_tag(version.run_id, "gate.decision", "promoted" if promote else "rejected")
        client.set_tag(version.run_id, "gate.reason", reason)
    if promote:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return {
        "promoted": promote,
        "reason": reason,
        "version": int(version.version),
        "metric": gate.metric,
        "value": acc,
        "tokens_per_s": speed,
    }


# ---- CLI -----------------------------------------------------------------------------------------------


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
