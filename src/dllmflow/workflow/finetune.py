"""The library side of `flows/finetune.py`: one function per flow step, so steps stay a few lines.

Everything here also runs without Metaflow (tests call it directly):

    from dllmflow.workflow import finetune as pipeline
    settings = pipeline.resolve_flow_settings(yaml.safe_load(open("params/tiny_mdlm.yaml")))
    data = pipeline.prepare_data(settings)
    training = pipeline.train(settings, "runs/tiny_mdlm/manual")

Settings cross into a step as a dict (a Metaflow artifact): each function a step calls validates it
once with `Settings.coerce` (a no-op on a `Settings`) and passes the typed object down. Paths inside
a run come from `dllmflow.runs`.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

from dllmflow import runs
from dllmflow.common.files import atomic_write_json
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint
from dllmflow.settings import Settings, load_settings_text
from dllmflow.settings.pipeline import AR_CONTROL, AR_EVALUATION
from dllmflow.workflow import ar_control
from dllmflow.workflow.card import comparison_table, results_table
from dllmflow.workflow.data_steps import (  # noqa: F401 - steps
    data_units,
    join_data,
    pin_published,
    plan_data,
    prepare_data,
    prepare_unit,
)
from dllmflow.workflow.stages import (  # noqa: F401 - with_remote_run: grpo's and the tests' name
    control_settings,
    control_stages,
    training_stages,
    with_remote_run,
)

log = logging.getLogger(__name__)

SettingsLike = Settings | dict[str, Any]


# ---- start ---------------------------------------------------------------------------------------------


def parse_params_config(text: str) -> dict[str, Any]:
    """Metaflow `Config` parser: YAML text -> the fully validated settings (defaults filled in), so
    decorators can read `params.flow.resources.cpu` and a typo fails before any step runs."""
    return _checked(load_settings_text(text, source="--config recipe")).to_dict()


def _checked(s: Settings) -> Settings:
    """The eval section's sampler settings against the mode's samplers (`check_eval_settings`, torch-free:
    the sampler configs, not the samplers), at the parse and again before training (`eval_samplers`)."""
    from dllmflow.diffusion.modes import MODES, SamplerMisfitError, check_sampler
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.evaluation.protocol import check_eval_settings
    from dllmflow.settings import SettingsError

    extra = MODES[s.dllm.mode].extra_evaluations if s.dllm.mode in MODES else ()
    for name in [n for n in s.eval.samplers or () if n in SAMPLERS and n not in extra]:
        try:  # which samplers decode a mode is the registry's: refused here, before anything trains
            check_sampler(s.dllm.mode, name)
        except SamplerMisfitError:
            fits = ", ".join(MODES[s.dllm.mode].samplers) if s.dllm.mode in MODES else "none"
            raise SettingsError(
                f"eval.samplers: {name} does not decode dllm.mode={s.dllm.mode}; samplers that fit: {fits}"
            ) from None
    check_eval_settings(s)
    return s


def resolve_flow_settings(config: dict[str, Any], *, max_steps: int = 0, eval_limit: int = 0) -> Settings:
    """Apply the run-time `Parameter`s to the Config and validate. The flow keeps `.to_dict()` of it
    as the artifact every later step rehydrates."""
    data = json.loads(json.dumps(config))
    if max_steps:
        data["train"]["max_steps"] = int(max_steps)
    if eval_limit:
        data["eval"]["limit"] = int(eval_limit)
    # Validated again, but the eval samplers' check is not repeated: the Config parse ran it, and these
    # parameters cannot change its outcome (the train step runs it again).
    return Settings.coerce(data)


def start_tracking(settings: SettingsLike, *, pathspec: str | None = None) -> str | None:
    """Open the flow run's MLflow run (settings as params, lineage tags) so that training, evaluation and
    registration log into it as they happen. None when `registry.live_tracking` is off (then `register`
    records the run at the end, as before)."""
    from dllmflow.tracking import mlflow_run

    s = Settings.coerce(settings)
    if not s.registry.live_tracking:
        return None
    return mlflow_run.open_run(s, lineage={"metaflow_run": pathspec, "git_sha": mlflow_run.git_sha()})


def flow_run_dir(settings: SettingsLike, run_id: str) -> str:
    """One run dir per flow run; a resumed flow (`origin_run_id`) reuses it, so training resumes."""
    return str(runs.flow_run_dir(Settings.coerce(settings).resolved_run_dir, run_id))


# ---- train -----------------------------------------------------------------------------------------------


def train(settings: SettingsLike, run_dir: str, *, mlflow_run_id: str | None = None) -> dict[str, Any]:
    """Launch the torchx app and wait, once per training stage (one, or e.g. the I-DLM block_length
    curriculum, each stage starting from the previous one's export). A stage with a LATEST checkpoint
    in its run dir resumes from it (a Metaflow `@retry` or `resume` lands here again with the same
    run dir); a finished stage is not retrained. With `mlflow_run_id`, rank 0 logs metrics into it live."""
    from dllmflow.training.launch import launch

    s = Settings.coerce(settings).with_run_dir(run_dir)
    control = None
    if ar_control.enabled(s) and s.dllm.trains_on_control:  # uno: the adapter drafts for the control
        s, control = _on_trained_control(s, run_dir)
    stages = training_stages(s, run_dir)
    handles, resumed, log_dir = [], False, None
    for stage in stages:
        layout = runs.RunLayout(stage.resolved_run_dir)
        if layout.is_finished(stage.train.max_steps):
            continue
        # A retry on a fresh pod has no local checkpoint: the object-store mirror still has it.
        resume = layout.latest_step() is not None or _remote_latest(stage) is not None
        result = launch(stage, resume=resume, mlflow_run_id=mlflow_run_id)
        handles.append(result.app_handle)
        resumed, log_dir = resumed or resume, result.log_dir
    final_dir = str(stages[-1].resolved_run_dir)
    if ar_control.enabled(s) and control is None:  # the AR arm after the dLLM: same rows, optimizer, steps
        control = train(control_settings(s, run_dir), str(ar_control.control_dir(run_dir)))
    return {
        "ar_control": control,
        "run_dir": final_dir,
        "stages": [str(st.resolved_run_dir) for st in stages],
        "app_handle": handles[-1] if handles else None,
        "app_handles": handles,
        "log_dir": str(log_dir) if log_dir else None,
        "resumed": resumed,
        "consolidated_dir": _local_export(stages[-1]),
    }


def _on_trained_control(s: Settings, run_dir: str) -> tuple[Settings, dict[str, Any]]:
    """Train the AR control first (`trains_on_control`: uno's adapter drafts for it); the run's settings on
    its export, and its training result. An export only on its trainers' disks and in the bucket is
    restored here (this step's checks read it); the adapter's trainers fetch it from the control's own
    prefix when their disk lacks it (`model.remote_dir`)."""
    layout = runs.RunLayout(s.resolved_run_dir)
    if not layout.settings_json.is_file():  # claim the run dir before the control fills a subdir of it
        layout.root.mkdir(parents=True, exist_ok=True)
        s.write_json(layout.settings_json)
    control = train(control_settings(s, run_dir), str(ar_control.control_dir(run_dir)))
    final = control_stages(s, run_dir)[-1]  # as train launched it
    export = control["consolidated_dir"]
    if export is None:
        from dllmflow.workflow.restore import restore_export

        export = str(restore_export(final))
    return ar_control.on_control(s, export, final.checkpoint.remote_dir), control


def _local_export(stage: Settings) -> str | None:
    """The finished run's export on this disk; None when the trainers ran elsewhere (a cluster scheduler,
    no shared volume) and mirrored it to `checkpoint.remote_dir`: the steps after training restore it
    from there (workflow/restore.py) and find it in the run dir themselves."""
    try:
        return str(runs.find_consolidated(stage.resolved_run_dir))
    except UserError:
        if not stage.checkpoint.remote_dir or _remote_latest(stage) is None:
            raise
        return None


def _remote_latest(stage: Settings) -> str | None:
    from dllmflow.training.storage import remote_latest

    return remote_latest(stage.checkpoint.remote_dir) if stage.checkpoint.remote_dir else None


# ---- evaluate --------------------------------------------------------------------------------------------


def eval_samplers(settings: SettingsLike) -> list[str]:
    """The samplers valid for the trained mode (or `eval.samplers` when set), plus the mode's extra
    evaluations such as DFlash acceptance (a DFlash export is a draft, measured by speculative decoding
    against its frozen target). Both come from the mode's `ModeSpec`. Checks `eval.cache` and
    `eval.sweep` against those samplers (the flow calls it before training)."""
    from dllmflow.diffusion.modes import MODES
    from dllmflow.diffusion.samplers import SAMPLERS

    s = _checked(Settings.coerce(settings))
    spec = MODES[s.dllm.mode]
    extra = list(spec.extra_evaluations)
    # eval.ar_baseline: the AR base model greedy, one more evaluation beside the samplers
    ar = [AR_EVALUATION] if s.eval.ar_baseline else []
    ar += [AR_CONTROL] if ar_control.enabled(s) else []
    if s.eval.samplers:
        unknown = [n for n in s.eval.samplers if n not in SAMPLERS and n not in extra]
        if unknown:
            raise UserError(f"eval.samplers: unknown sampler(s) {unknown}; choose from {sorted(SAMPLERS)}")
        return list(s.eval.samplers) + ar
    # which samplers decode a mode is the registry's (one ModeSpec per objective), never a config's
    return [n for n in spec.samplers if _sampler_available(SAMPLERS, n)] + extra + ar


def _sampler_available(registry, name: str) -> bool:
    try:
        registry[name]
        return True
    except (ImportError, AttributeError):
        return False


def evaluate_sampler(settings: SettingsLike, run_dir: str, sampler: str) -> dict[str, Any]:
    """One sampler's evaluation of the run's export (at each sweep point, when `eval.sweep` is set), kept
    as the run dir's eval file. It reaches MLflow at `register`, which logs every sampler's result into
    the flow's run: the branches do not each pay MLflow's import and store open (~3 s a process)."""
    from dllmflow.inference.resolved import resolve_run

    s = Settings.coerce(settings)
    if sampler == AR_EVALUATION:  # the AR base model, untrained: no export of this run
        result = _evaluate_ar(s)
    else:  # the export of the run (or of its AR control arm), resolved once: what the evaluation is handed
        checkpoint = resolve_run(ar_control.arm_dir(run_dir, sampler))
        export_evaluation = EXPORT_EVALUATIONS.get(sampler, _evaluate_export)
        result = export_evaluation(s, checkpoint, sampler)
    atomic_write_json(runs.RunLayout(run_dir).eval_file(sampler), result, sort_keys=False, default=str)
    return result


def _evaluate_export(s: Settings, checkpoint: ResolvedCheckpoint, sampler: str) -> dict[str, Any]:
    """`sampler` decoding the run's export: at the sweep's chosen point when `eval.sweep` is set, beside
    the untrained baseline and, for the gated sampler against the AR control, the run's training."""
    from dllmflow.evaluation.accuracy import evaluate, run_sweep
    from dllmflow.evaluation.sweep import chosen_setting, sweep_table

    setting = None
    if s.eval.sweep is not None:  # the model is registered (and gated) at the chosen point
        result = run_sweep(
            checkpoint, s, sampler, s.eval.sweep.axes(), limit=s.eval.limit, strict=False,
            tolerance=s.eval.sweep_tolerance, metric=sweep_metric(s),
        )  # fmt: skip
        setting = chosen_setting(result)
        print(sweep_table(result), flush=True)
    else:
        result = evaluate(checkpoint, settings=s, sampler=sampler, limit=s.eval.limit)
    baseline = untrained_baseline(s, sampler, setting)
    if baseline is not None:
        result["baseline"] = baseline
    if ar_control.enabled(s) and sampler == _gated_sampler(s, dict.fromkeys(eval_samplers(s))):
        result["training"] = checkpoint.training  # its side (its speed: at register)
    return result


def _evaluate_acceptance(s: Settings, checkpoint: ResolvedCheckpoint, sampler: str) -> dict[str, Any]:
    """DFlash: the exported draft's acceptance length against its frozen target."""
    from dllmflow.evaluation.acceptance import evaluate_dflash

    return evaluate_dflash(checkpoint, settings=s, limit=s.eval.limit)


def _evaluate_ar(s: Settings) -> dict[str, Any]:
    """`eval.ar_baseline`: the AR base model (not the run's checkpoint) decoding greedily."""
    from dllmflow.evaluation.ar_baseline import evaluate_ar

    return evaluate_ar(s, limit=s.eval.limit)


# Evaluations of an export that are not `sampler` decoding it with the run's eval section:
# name -> (settings, the export resolved, name) -> result
EXPORT_EVALUATIONS = {"acceptance": _evaluate_acceptance, AR_CONTROL: ar_control.evaluate_control}


def sweep_metric(settings: Settings) -> str:
    """The exact match a sweep maximises: the gate's metric when it is one, else flexible."""
    metric = settings.registry.gate.metric
    return metric if metric.startswith("exact_match") else "exact_match_flexible"


def untrained_baseline(
    settings: SettingsLike, sampler: str, setting: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The same evaluation (sampler, examples, settings) of the model as it was before training: built
    fresh from `train.seed` as the trainer builds it, exported to a temp dir. What the results table shows
    as "EM before", so a reader sees what training added: a tiny model's untrained twin, a pretrained
    model converted to the mode but not fine-tuned. Only with `eval.untrained_baseline` (on in the demo
    recipe, params/tiny_addition.yaml, and the SmolLM2 A2D recipes): a second evaluation of every sampler.
    `setting`: the sweep point the trained model was chosen at, so both are measured alike."""
    import tempfile

    import torch

    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy
    from dllmflow.evaluation.accuracy import evaluate

    s = Settings.coerce(settings)
    if not s.eval.untrained_baseline:
        return None
    label = (
        f"untrained (train.seed {s.train.seed})"
        if s.model.tiny is not None
        else f"{s.model.pretrained_model_name_or_path} converted to {s.dllm.mode}, before fine-tuning"
    )
    print(f"baseline {label}, sampler {sampler}:", flush=True)
    tokenizer = load_tokenizer(s.dataset.prepared_dir)
    torch.manual_seed(s.train.seed)  # as the trainer seeds before its build
    strategy = build_strategy(s)
    model = build_mode_model(s, tokenizer)
    with tempfile.TemporaryDirectory(prefix="dllmflow-untrained-") as tmp:
        strategy.export(model, model.state_dict(), tokenizer, Path(tmp))
        s.write_json(Path(tmp) / "settings.json")
        result = evaluate(tmp, settings=s, sampler=sampler, limit=s.eval.limit, overrides=setting)
    return {"metrics": result["metrics"], "model": label}


# ---- register --------------------------------------------------------------------------------------------


def register(
    settings: SettingsLike,
    run_dir: str,
    evals: dict[str, dict[str, Any]],
    *,
    data: dict[str, Any],
    training: dict[str, Any],
    pathspec: str | None = None,
    mlflow_run_id: str | None = None,
) -> dict[str, Any]:
    """Complete the MLflow run (`mlflow_run_id`, opened at `start`; else found or created here), log
    and register the model into it, apply the gate."""
    from dllmflow.tracking.model_env import prefetch_wheel

    prefetch_wheel()  # the model's wheel builds (a subprocess) while MLflow imports and the run is logged
    from dllmflow.evaluation.sweep import chosen_setting
    from dllmflow.tracking import mlflow_run, registry

    s = Settings.coerce(settings)
    lineage = {
        "data_content_hash": data.get("content_hash"),
        "data_source_sha256": data.get("source_sha256"),
        "dvc_rev": data.get("dvc_rev") or "none",
        "dvc_stage": data.get("dvc_stage") or "none",
        "metaflow_run": pathspec,
        "torchx_app_handle": training.get("app_handle"),
        "git_sha": mlflow_run.git_sha(),
    }
    gated = _gated_sampler(s, evals)
    side = ar_control.comparison(s, run_dir, evals, gated)  # speeds measured here; unlike protocols refused
    run_id = mlflow_run.log_run(s, run_dir, evals=evals, lineage=lineage, run_id=mlflow_run_id)
    protocol = evals.get(gated, {}).get("protocol", {})
    sampler_settings = protocol.get("sampler_settings") or {"max_new_tokens": protocol.get("max_new_tokens")}
    from dllmflow.models.model_card import update_model_card

    # the train step's, else this pod's run dir's (restored from the bucket when the trainers ran elsewhere)
    export = training.get("consolidated_dir") or runs.find_consolidated(run_dir)
    update_model_card(export, evals)  # the registered export's card carries its evals
    version = registry.register_model(
        s, run_id, export, sampler=gated, sampler_settings=sampler_settings,
        setting=chosen_setting(evals.get(gated, {})),
    )  # fmt: skip
    if side is not None:
        mlflow_run.log_comparison(s, run_id, side)
    decision = registry.apply_gate(s, version, evals, gated, control=side)
    return {
        "tracking_uri": mlflow_run.resolve_tracking_uri(s),
        "run_id": run_id,
        "model_name": s.registry.model_name,
        "version": int(version.version),
        "sampler": gated,
        "setting": chosen_setting(evals.get(gated, {})),  # the sweep point it is registered at (or None)
        "lineage": lineage,
        **{f"gate_{k}": v for k, v in decision.items()},
        "ar_control": side,
    }


def _gated_sampler(s: Settings, evals: dict[str, dict[str, Any]]) -> str:
    """The sampler the version is registered and gated with: the first evaluated of the recipe's
    `eval.samplers` (in its order), else of the mode's samplers (its default first)."""
    from dllmflow.diffusion.modes import MODES

    for name in s.eval.samplers or MODES[s.dllm.mode].samplers:
        if name in evals:
            return name
    if not evals:
        raise UserError("no evaluation results to register (eval.samplers is empty for this mode?)")
    return next(iter(evals))


# ---- end: card and instructions ---------------------------------------------------------------------------


def fill_card(card, settings, run_dir, evals, data, training, registration) -> None:
    from dllmflow.workflow.card import build_card_components

    for component in build_card_components(
        Settings.coerce(settings), run_dir, evals, data, training, registration
    ):
        card.append(component)


def _pastable(text: str | None) -> bool:
    return bool(text) and len(text) <= 80 and not any(c in text for c in "'\"\\$`\n")


def next_steps_message(
    settings: SettingsLike,
    registration: dict[str, Any],
    pathspec: str,
    *,
    evals: dict[str, dict[str, Any]] | None = None,
    run_dir: str | None = None,
) -> str:
    """What the flow prints last: the results table (with `evals`), the champion decision and its
    reason, then the commands to try the model (generate on the run dir, the card, the champion)."""
    Settings.coerce(settings)  # validates the artifact, as every step function does
    uri = registration["tracking_uri"]
    flow_file = "flows/finetune.py"
    status = (
        "promoted to @champion" if registration.get("gate_promoted") else "kept as @candidate (not champion)"
    )
    gated = (evals or {}).get(registration.get("sampler"), {})
    # A held-out question of this run's task (short and quote-free, so it pastes into a shell), else a default.
    example = next(
        (p["prompt"] for p in gated.get("predictions", []) if _pastable(p.get("prompt"))), "What is 2 + 3?"
    )
    lines = ["", results_table(evals), ""] if evals else [""]
    if registration.get("ar_control"):
        lines += [comparison_table(registration["ar_control"]), ""]
    lines += [
        f"Model {registration['model_name']} v{registration['version']} {status}",
        f"  gate ({registration.get('sampler')}): {registration.get('gate_reason')}",
        "",
        "Next:",
    ]
    if run_dir:
        lines.append(
            f"  Generate:    dllmflow generate --checkpoint {run_dir} --prompt {shlex.quote(example)}"
        )
    lines += [
        f"  Card:        python {flow_file} card get end --id report card.html   ({pathspec}; or: card server)",
        f"  MLflow UI:   mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000)",
        '  Champion:    python -c "import mlflow; m = mlflow.pyfunc.load_model('
        f"'models:/{registration['model_name']}@champion'); print(m.predict([{example!r}]))\"",
    ]
    return "\n".join(lines)
