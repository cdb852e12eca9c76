"""The model registry: a finished run's consolidated checkpoint registered as a pyfunc model that
generates (alias `candidate`), and the gate that decides whether `champion` moves to it.

    from dllmflow.tracking.registry import apply_gate, register_model
    version = register_model(settings, run_id, consolidated_dir, sampler="llada")
    decision = apply_gate(settings, version, evals, "llada")    # gate_decision: the rule, a plain function

Consumers load the champion anywhere MLflow is reachable, with no access to the training directories:

    import mlflow
    mlflow.pyfunc.load_model("models:/dllmflow-tiny-mdlm@champion").predict(["What is 2 + 3?"])

The MLflow run it registers from: `tracking.mlflow_run`; what the model does at predict:
`tracking.pyfunc` and `tracking.pyfunc_runtime`; the `dllmflow register` command: `tracking.register_cli`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dllmflow.errors import UserError
from dllmflow.settings import Settings
from dllmflow.tracking.champion import PROTOCOL_TAG, ChampionFigure, champion_figure, recorded_protocol
from dllmflow.tracking.dataset_input import log_dataset_input, prepared_dataset
from dllmflow.tracking.mlflow_run import connect
from dllmflow.tracking.model_env import build_model_env
from dllmflow.tracking.pyfunc_runtime import SPECULATIVE, build_signature

CANDIDATE, CHAMPION = "candidate", "champion"


# ---- registration ----------------------------------------------------------------------------------------


def register_model(
    settings: Settings,
    run_id: str,
    consolidated_dir: str | os.PathLike,
    *,
    sampler: str,
    sampler_settings: dict[str, Any] | None = None,
    setting: dict[str, Any] | None = None,
) -> Any:
    """Log the consolidated checkpoint as a pyfunc model in `run_id` and register it under
    `registry.model_name` with alias `candidate`. Idempotent: a run already registered returns its
    existing version. `setting`: the `eval.sweep` point it was chosen and gated at (already part of
    `sampler_settings`), recorded in the `generation` artifact and as the version tag `setting`.
    Returns the `ModelVersion`."""
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
    if setting is not None:
        generation["setting"] = setting
    # Recorded only: a consumer runs the checkpoint's code with its own consent (--trust-remote-code).
    if settings.model.trust_remote_code:
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
        env = build_model_env(tmp)  # the model installs dllmflow itself: no code_paths (tracking.model_env)
        with mlflow.start_run(run_id=run_id):
            # What `mlflow.pyfunc.log_model` does, without MLflow's serving check (see _PYFUNC_FLAVOR).
            # `step`: the training step that made the model; MLflow links the run's metrics at that
            # step (the final training loss) to it. The eval metrics (step 0) are linked below, with
            # their dataset, which the link MLflow makes would drop.
            info = Model.log(
                step=_final_step(client, run_id, settings),
                artifact_path=None,  # deprecated in favour of `name`, still a required argument
                name="model",
                flavor=_PYFUNC_FLAVOR,
                flavor_name="pyfunc.ModelFromCode",  # what pyfunc.log_model records for a code model
                validate_serving_input=False,
                python_model=str(Path(__file__).with_name("pyfunc.py")),
                artifacts={**artifacts, "generation": str(gen_path), **env.artifacts},
                signature=build_signature(sampler, sampler_settings),
                input_example=["What is 2 + 3?"],
                pip_requirements=env.pip_requirements,
            )
    _link_eval_metrics(client, run_id, info.model_id, settings)
    tags = {"run_id": run_id, "sampler": sampler}
    if setting is not None:
        tags["setting"] = json.dumps(setting, sort_keys=True)
    # From the LoggedModel (models:/<model_id>): the version links to it, its metrics and its run.
    version = mlflow.register_model(f"models:/{info.model_id}", name, tags=tags)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    return client.get_model_version(name, version.version)


def _final_step(client: Any, run_id: str, settings: Settings) -> int:
    """The last training step the run recorded (else the recipe's), never 0 where the evals are."""
    history = client.get_metric_history(run_id, "train/loss")
    return max((m.step for m in history), default=0) or max(int(settings.train.max_steps), 1)


def _link_eval_metrics(client: Any, run_id: str, model_id: str, settings: Settings) -> None:
    """The run's `eval/...` metrics, linked to the logged model and (MLflow 3) to the prepared dataset
    they were measured on, which also becomes the run's input. Same values and timestamps: the run's
    own history gains nothing."""
    from mlflow.entities import Metric

    run = client.get_run(run_id)
    dataset = prepared_dataset(settings, run.data.tags.get("data_content_hash"))
    on = {}
    if dataset is not None:
        log_dataset_input(client, run_id, dataset)
        on = {"dataset_name": dataset.name, "dataset_digest": dataset.digest}
    metrics = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, **on)
        for key in run.data.metrics
        if key.startswith("eval/")
        for m in client.get_metric_history(run_id, key)
    ]
    client.log_batch(run_id, metrics=metrics)


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
    setting: str | None = None,
    champion_note: str = "",
) -> tuple[bool, str]:
    """(promote, reason) for a version scoring `value` on `gate.metric` (a `GateConfig`), against the
    current champion (None = none yet) scoring `champion_value` under the same protocol
    (`tracking.champion`; `champion_note`: how that figure was obtained, or why there is none). Checked
    in order: the metric exists, the speed floor, the metric's absolute floor (`gate_floor`: a version
    below it never becomes champion, the first one included), then no champion / already champion / a
    champion figure to compare with (none: refused) / not worse than the champion minus the tolerance.
    `setting`: the sweep point both numbers were measured at (named in the speed reason)."""
    floor = gate_floor(gate)
    if not math.isfinite(value):
        return False, f"metric {gate.metric} missing for sampler {sampler}"
    if gate.min_tokens_per_s > 0 and not tokens_per_s >= gate.min_tokens_per_s:  # NaN fails a set floor
        at = f" at {setting}" if setting else ""
        return (
            False,
            f"tokens_per_s {tokens_per_s:.2f}{at} below the floor {gate.min_tokens_per_s} (registry.gate.min_tokens_per_s)",
        )
    if value < floor:
        return (
            False,
            f"{gate.metric} {value:.4f} below the floor {floor} (registry.gate: not champion material)",
        )
    if champion_version is None:
        return True, f"no champion yet ({gate.metric} {value:.4f} >= floor {floor})"
    if str(champion_version) == str(version):
        return True, "already champion"
    note = f" ({champion_note})" if champion_note else ""
    if not math.isfinite(champion_value):  # nothing to compare with is no licence to replace the champion
        return False, f"no {gate.metric} of champion v{champion_version} to compare with{note}"
    if value >= champion_value - gate.tolerance:
        return True, (
            f"{gate.metric} {value:.4f} >= champion v{champion_version} {champion_value:.4f} - {gate.tolerance}{note}"
        )
    return False, (
        f"{gate.metric} {value:.4f} < champion v{champion_version} {champion_value:.4f} - {gate.tolerance}{note}"
    )


def control_decision(
    promote: bool, reason: str, side: dict[str, Any] | None, max_gap: float | None
) -> tuple[bool, str]:
    """The AR-control rule after `gate_decision` (`eval.ar_control.max_em_gap`): a version the gate
    would promote stays a candidate unless the dLLM's exact match is >= the AR control's minus
    `max_gap`. `side`: `evaluation.control.compare_arms`; no rule without it or without `max_gap`."""
    if side is None or max_gap is None or not promote:
        return promote, reason
    dllm, control = side["dllm"]["exact_match_flexible"], side["ar_control"]["exact_match_flexible"]
    if dllm is None or control is None:
        return False, "AR control exact match missing (eval.ar_control.max_em_gap is set)"
    rule = f"dLLM EM {dllm:.4f} {{}} AR control EM {control:.4f} - {max_gap} (eval.ar_control.max_em_gap)"
    if dllm >= control - max_gap:
        return True, f"{reason}; {rule.format('>=')}"
    return False, rule.format("<")


def apply_gate(
    settings: Settings,
    version: Any,
    evals: dict[str, dict[str, Any]],
    sampler: str,
    control: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Move `champion` to `version` when `gate_decision` says so (its metric at or above the absolute
    floor, not below the current champion's minus `registry.gate.tolerance`, its speed at or above
    `registry.gate.min_tokens_per_s`), all measured at the setting the model is registered at (the
    chosen `eval.sweep` point, tag `gate.setting`). The champion's figure is one measured under this
    version's protocol (`tracking.champion`: recorded, re-measured, or none and refused); the protocol
    is recorded as the version's `eval.protocol`. The decision and its reason are written as tags on
    the model version and on its run. `control`: the dLLM vs AR-control side by side (`eval.ar_control`),
    tagged on the version (`control.<arm>.<figure>`, `control.em_gap`) and gated by `control_decision`."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from dllmflow.evaluation.sweep import chosen_setting, setting_label

    connect(settings)
    gate = settings.registry.gate
    client = MlflowClient()
    name = settings.registry.model_name
    metrics = evals.get(sampler, {}).get("metrics", {})
    acc = float(metrics.get(gate.metric, float("nan")))
    speed = float(metrics.get("tokens_per_s", 0.0))
    setting = chosen_setting(evals.get(sampler, {}))
    protocol = evals.get(sampler, {}).get("protocol", {})
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    decide = partial(gate_decision, gate, acc, speed, sampler=sampler, version=version.version,
                     setting=setting_label(setting) if setting is not None else None)  # fmt: skip
    promote, reason = decide()  # its own floors first: a version below them needs no champion figure
    if promote and champion is not None:
        figure = ChampionFigure(float("nan"), "")
        if str(champion.version) != str(version.version):
            figure = champion_figure(settings, champion, protocol, gate.metric)
        promote, reason = decide(
            champion_version=champion.version, champion_value=figure.value, champion_note=figure.note
        )
    ar_control = settings.eval.ar_control
    promote, reason = control_decision(
        promote, reason, control, ar_control.max_em_gap if ar_control else None
    )
    for key, value in control_tags(control).items():
        client.set_model_version_tag(name, version.version, key, value)

    client.set_model_version_tag(name, version.version, PROTOCOL_TAG, recorded_protocol(protocol))
    client.set_model_version_tag(name, version.version, f"eval.{gate.metric}", f"{acc:.6f}")
    client.set_model_version_tag(name, version.version, "eval.tokens_per_s", f"{speed:.4f}")
    client.set_model_version_tag(
        name, version.version, "gate.decision", "promoted" if promote else "rejected"
    )
    client.set_model_version_tag(name, version.version, "gate.reason", reason)
    if setting is not None:
        client.set_model_version_tag(
            name, version.version, "gate.setting", json.dumps(setting, sort_keys=True)
        )
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
        "setting": setting,
    }


def control_tags(side: dict[str, Any] | None) -> dict[str, str]:
    """The side by side as version tags: `control.dllm.<figure>`, `control.ar_control.<figure>`,
    `control.em_gap` and `control.sampler` (none without a control)."""
    if side is None:
        return {}
    tags = {f"control.{arm}.{k}": f"{v:.6g}" for arm in ("dllm", "ar_control") for k, v in side[arm].items()
            if v is not None}  # fmt: skip
    tags["control.sampler"] = side["sampler"]
    if side["em_gap"] is not None:
        tags["control.em_gap"] = f"{side['em_gap']:.6f}"
    if "identical" in side:  # a model whose answers must be the control's (uno): how many are
        from dllmflow.evaluation.control import identity_line

        tags["control.identical_answers"] = f"{side['identical']}/{side['answers']}"
        tags["control.identity"] = identity_line(side)
    return tags
