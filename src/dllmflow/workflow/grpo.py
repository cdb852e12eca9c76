"""`dllmflow rl` and the library side of `flows/grpo.py`: GRPO from a supervised model, launched like training.

    dllmflow rl --params params/tiny_addition_grpo.yaml --init-from runs/tiny_addition [--set rl.kl_beta=0.02]
    dllmflow rl --params params/tiny_addition_grpo.yaml --init-from models:/dllmflow-tiny-addition@champion

    from dllmflow.workflow import grpo
    settings, parent = grpo.starting_settings(load_settings("params/tiny_addition_grpo.yaml"), "runs/sft")
    training = grpo.train(settings, "runs/grpo", parent=parent)       # torchx -> torchrun -> dllmflow.rl

`rl.init_from` (or `--init-from`, which wins) is a run dir, an export dir or a registered model
(`models:/<name>@<alias>` or `models:/<name>/<version>`, downloaded from MLflow). `starting_settings`
resolves it to a local export (`model.pretrained_model_name_or_path`; the mode it was trained with must
be the recipe's) and returns its lineage (`parent`: the export, and for a registered model its name,
version and run id), which the MLflow run and the registered version carry as `parent_*` tags. The
checks that need the torch side (rollout sampler options and its fit to the mode, estimator params)
run before anything is launched (`check_rl_settings`). The flow's evaluate/register/card reuse the
fine-tune flow's functions (workflow/finetune.py); the evaluation also scores the starting model, as
the results table's "before" column.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dllmflow import runs
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint, resolve
from dllmflow.settings import Settings

SettingsLike = Settings | dict[str, Any]


# ---- the starting model ----------------------------------------------------------------------------------


def resolve_init_from(init_from: str, settings: Settings) -> tuple[ResolvedCheckpoint, dict[str, str]]:
    """(local export, resolved once, lineage) of a run dir / export dir / models:/ URI."""
    if init_from.startswith("models:/"):
        return _registered_export(init_from, settings)
    export = resolve(init_from)
    return export, {"parent_init_from": init_from, "parent_export": str(export.path.absolute())}


def _registered_export(uri: str, settings: Settings) -> tuple[ResolvedCheckpoint, dict[str, str]]:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from dllmflow.tracking.champion import download_checkpoint
    from dllmflow.tracking.mlflow_run import connect

    connect(settings)
    ref = uri.removeprefix("models:/")
    name, alias = ref.split("@", 1) if "@" in ref else (ref.rsplit("/", 1)[0], None)
    client = MlflowClient()
    try:
        version = (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, ref.rsplit("/", 1)[1])
        )
        checkpoint = download_checkpoint(name, version.version)
    except (MlflowException, IndexError) as e:
        raise UserError(
            f"rl.init_from={uri!r}: no such registered model version ({str(e).splitlines()[0]}); "
            "write models:/<name>@<alias> or models:/<name>/<version>"
        ) from None
    export = resolve(checkpoint)
    return export, {
        "parent_init_from": uri,
        "parent_export": str(export.path),
        "parent_model": f"{name}/{version.version}",
        "parent_run_id": version.run_id or "",
    }


def starting_settings(
    settings: SettingsLike, init_from: str | None = None
) -> tuple[Settings, dict[str, str]]:
    """`settings` starting from `init_from` (else `rl.init_from`): the model is that export, its
    lineage returned. UserError naming rl.init_from when it is missing or of another mode."""
    s = Settings.coerce(settings)
    if s.rl is None:
        raise UserError("the recipe has no `rl:` section; add one (see params/tiny_addition_grpo.yaml)")
    init = init_from or s.rl.init_from
    if not init:
        raise UserError(
            "rl.init_from: no starting model; pass --init-from <run dir | export | models:/name@alias>"
        )
    export, parent = resolve_init_from(init, s)
    trained = export.settings
    if trained is not None and trained.dllm.mode != s.dllm.mode:
        raise UserError(
            f"rl.init_from={init!r} was trained with dllm.mode={trained.dllm.mode}; the recipe says "
            f"{s.dllm.mode}: use a recipe of that mode"
        )
    data = s.to_dict()
    data["model"] = {
        **data["model"],
        "pretrained_model_name_or_path": str(export.path.absolute()),
        "tiny": None,
    }
    data["rl"] = {**data["rl"], "init_from": init}
    return Settings.coerce(data), parent


def check_rl_settings(settings: Settings, *, import_user: bool = True) -> None:
    """What the settings cannot check without the torch side: the rollout sampler (its options, its
    fit to the mode) and the estimator's and rewards' construction."""
    from dllmflow.rl.estimators import build_rl_estimator
    from dllmflow.rl.rewards import build_rewards
    from dllmflow.rl.rollout import rollout_sampler_config

    rl = settings.rl
    try:
        rollout_sampler_config(settings)
    except UserError as e:
        raise UserError(f"rl.sampler / rl.sampler_overrides: {e}") from None
    build_rl_estimator(settings)  # and its fit to the rollouts (ar_order: left-to-right decoding)
    build_rewards(rl.rewards, rl.reward_weights, import_user=import_user)


# ---- the flow's start ------------------------------------------------------------------------------------


def start(
    config: dict[str, Any],
    *,
    init_from: str = "",
    max_steps: int = 0,
    eval_limit: int = 0,
    pathspec: str | None = None,
) -> tuple[Settings, dict[str, str], str | None]:
    """The flow's start: the Config with the run-time Parameters, started from `init_from` (else
    `rl.init_from`), checked in full (sampler, estimator, rewards); the MLflow run opened with the
    parent's lineage. -> (settings, parent, MLflow run id or None)."""
    from dllmflow.tracking import mlflow_run
    from dllmflow.workflow import finetune

    s, parent = starting_settings(
        finetune.resolve_flow_settings(config, max_steps=max_steps, eval_limit=eval_limit), init_from or None
    )
    check_rl_settings(s)
    run_id = None
    if s.registry.live_tracking:
        lineage = {"metaflow_run": pathspec, "git_sha": mlflow_run.git_sha(), "stage": "grpo", **parent}
        run_id = mlflow_run.open_run(s, lineage=lineage)
    return s, parent, run_id


# ---- train -----------------------------------------------------------------------------------------------


def train(
    settings: SettingsLike,
    run_dir: str,
    *,
    parent: dict[str, str] | None = None,
    mlflow_run_id: str | None = None,
    resume: bool | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Launch GRPO through torchx and wait; resumes from the run dir's LATEST when there is one (a flow
    retry, a rerun) unless `resume` says otherwise; a finished run is not rerun."""
    from dllmflow.training.launch import launch
    from dllmflow.training.run_dir import check_overwritable
    from dllmflow.workflow.stages import with_remote_run

    # mirrored under this flow run's own prefix (`<checkpoint.remote_dir>/flow-<id>`), as the fine-tune's
    s = with_remote_run(Settings.coerce(settings).with_run_dir(run_dir), run_dir)
    if not Path(
        s.model.pretrained_model_name_or_path
    ).exists():  # resolved on another machine (a flow's start pod)
        s, _ = starting_settings(s, s.rl.init_from)
    check_rl_settings(s)
    layout = runs.RunLayout(s.resolved_run_dir)
    check_overwritable(layout)  # a file or a dir not ours: refused before its state is read
    handle, log_dir = None, None
    if overwrite or not layout.is_finished(s.train.max_steps):
        resume = layout.latest_step() is not None and not overwrite if resume is None else resume
        result = launch(
            s, resume=resume, overwrite=overwrite, mlflow_run_id=mlflow_run_id, entry="dllmflow.rl"
        )
        handle, log_dir = result.app_handle, result.log_dir
    return {
        "run_dir": str(s.resolved_run_dir),
        "app_handle": handle,
        "log_dir": str(log_dir) if log_dir else None,
        "consolidated_dir": str(runs.find_consolidated(s.resolved_run_dir)),
        "parent": dict(parent or {}),
    }


# ---- evaluate / register / card (the fine-tune flow's, plus the starting model) ----------------------------


def evaluate(settings: SettingsLike, run_dir: str, sampler: str) -> dict[str, Any]:
    """The fine-tune flow's evaluation of the GRPO export, with the starting model's exact match (same
    sampler, examples and setting) as its `baseline` ("EM before" in the table)."""
    from dllmflow.evaluation.accuracy import evaluate as evaluate_checkpoint
    from dllmflow.evaluation.sweep import chosen_setting
    from dllmflow.workflow import finetune

    s = Settings.coerce(settings)
    result = finetune.evaluate_sampler(s, run_dir, sampler)
    if sampler != "acceptance":
        before = evaluate_checkpoint(
            s.model.pretrained_model_name_or_path, settings=s, sampler=sampler, limit=s.eval.limit,
            overrides=chosen_setting(result),
        )  # fmt: skip
        result["baseline"] = {"metrics": before["metrics"], "model": f"before RL ({s.rl.init_from})"}
    return result


def register(
    settings: SettingsLike,
    run_dir: str,
    evals: dict[str, dict[str, Any]],
    *,
    training: dict[str, Any],
    pathspec: str | None = None,
    mlflow_run_id: str | None = None,
) -> dict[str, Any]:
    """Register as the fine-tune flow does (its gate against the current champion), then tag the
    version and its run with the SFT parent (`parent_*`: init_from, export, model version, run id)."""
    from mlflow import MlflowClient

    from dllmflow.workflow import finetune

    s = Settings.coerce(settings)
    data = _prepared_lineage(s)
    registration = finetune.register(
        s, run_dir, evals, data=data, training=training, pathspec=pathspec, mlflow_run_id=mlflow_run_id
    )
    client = MlflowClient(registration["tracking_uri"])
    parent = {k: v for k, v in training.get("parent", {}).items() if v}
    for key, value in {**parent, "stage": "grpo"}.items():
        client.set_model_version_tag(s.registry.model_name, str(registration["version"]), key, value)
        client.set_tag(registration["run_id"], f"dllmflow.{key}", value)
    return {**registration, "parent": parent}


def _prepared_lineage(s: Settings) -> dict[str, Any]:
    from dllmflow.data.prepared_dir import read_manifest

    manifest = read_manifest(s.dataset.prepared_dir) or {}
    return {"content_hash": manifest.get("content_hash"), "source_sha256": manifest.get("source_sha256")}


def fill_card(card, settings, run_dir, evals, training, registration) -> None:
    """The fine-tune card (results, curves, samples) plus the reward and held-out accuracy curves."""
    from metaflow.cards import Markdown, VegaChart

    from dllmflow.workflow.card import build_card_components

    s = Settings.coerce(settings)
    data = _prepared_lineage(s)
    parent = training.get("parent", {})
    card.append(Markdown(f"## GRPO from `{parent.get('parent_init_from', s.rl.init_from)}`"))
    records = runs.read_metrics(runs.RunLayout(run_dir).metrics_jsonl)
    for key, title in (
        ("reward_mean", "Mean reward per step"),
        ("heldout_em", "Held-out exact match (greedy)"),
    ):
        points = [{"step": r["step"], key: r[key]} for r in records if isinstance(r.get(key), (int, float))]
        if points:
            card.append(Markdown(f"### {title}"))
            card.append(VegaChart(_line_chart(points, key)))
    for component in build_card_components(s, run_dir, evals, data, training, registration):
        card.append(component)


def _line_chart(points: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {
        "$schema": "https://vega.github.io/schema/vega-lite/v5.json",
        "width": 480,
        "height": 200,
        "data": {"values": points},
        "mark": {"type": "line", "point": True},
        "encoding": {
            "x": {"field": "step", "type": "quantitative"},
            "y": {"field": key, "type": "quantitative"},
        },
    }


# ---- CLI -------------------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from dllmflow.common.cli_args import add_flag
    from dllmflow.training.launch import add_cli_args as add_train_args

    add_train_args(parser)
    add_flag(
        parser,
        "--init-from",
        default=None,
        help="starting model: run dir, export dir or models:/<name>@<alias>",
    )


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.settings import load_settings, parse_overrides
    from dllmflow.training.launch import owned_run
    from dllmflow.training.run_dir import check_overwritable

    recipe = load_settings(*args.params, **parse_overrides(args.set))
    run_dir = args.run_dir or str(recipe.resolved_run_dir)
    check_overwritable(runs.RunLayout(run_dir))  # not ours: refused before anything is read or opened
    settings, parent = starting_settings(recipe, args.init_from)
    tags = {"dllmflow.source": "rl", **{f"dllmflow.{k}": v for k, v in parent.items()}}
    with owned_run(settings, tags) as run_id:
        result = train(
            settings, run_dir, parent=parent, mlflow_run_id=run_id, resume=args.resume,
            overwrite=args.overwrite,
        )  # fmt: skip
    print(
        f"rl done: {result['run_dir']} (export {result['consolidated_dir']})"
        + (f", MLflow run {run_id}" if run_id else "")
    )
    return 0
