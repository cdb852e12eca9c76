"""A finished run dir restored from the object store (`checkpoint.remote_dir`), for the flow steps after
training: under Argo/Kubernetes `evaluate`, `register` and `end` each run in a pod of their own, which
does not see the disk the trainers wrote, so they take from the bucket exactly what they read.

    from dllmflow.workflow.restore import restore_run_dir
    restore_run_dir(settings, "runs/tiny_mdlm/flow-12")   # {"bytes": 0, "files": []}: the dir was complete
    # flows/finetune.py and flows/grpo.py: the first line of evaluate, register and end

What they read, per run dir the train step mirrored (`mirrored_runs`: the dLLM's, each curriculum
stage's, and with `eval.ar_control` the control's `<flow run>/ar_control`, each under the prefix
`workflow.finetune.train` gave it): `settings.json` and `metrics.jsonl` (mirrored by the trainer's rank 0,
training/storage.py), and of the last stage the final step dir's consolidated export (its files only,
checked against the step dir's manifest: no DCP shards, no optimizer state) with LATEST pointing at it.
A run dir that already holds them (one machine, a shared volume) asks the store nothing. A bucket whose
LATEST is not the final step (training did not finish there, or another `checkpoint.remote_dir`) is a
UserError naming the URL. Processes of one machine restore a run dir one at a time (a file lock), so
parallel `evaluate` branches on one host download it once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dllmflow import runs
from dllmflow.common.outputs import wait_beside
from dllmflow.errors import UserError
from dllmflow.settings import Settings
from dllmflow.workflow import ar_control
from dllmflow.workflow.stages import control_stages, training_stages, with_remote_run


def restore_run_dir(settings: Settings | dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Download what the steps after training read and the flow run dir `run_dir` lacks (see the module
    docstring); a no-op without `checkpoint.remote_dir` or when nothing is missing. Returns
    {"bytes": downloaded, "files": the local paths written}."""
    s = Settings.coerce(settings)
    done: dict[str, Any] = {"bytes": 0, "files": []}
    if not s.checkpoint.remote_dir:
        return done
    for stage, with_export in mirrored_runs(s, run_dir):
        _restore_once(stage, with_export, done)
    return done


def restore_export(stage: Settings) -> Path:
    """One finished run dir (`stage`: its settings as train launched it) restored on this disk with its
    export, as `restore_run_dir` restores each; its consolidated export's path."""
    _restore_once(stage, True, {"bytes": 0, "files": []})
    return runs.find_consolidated(stage.resolved_run_dir)


def _restore_once(stage: Settings, with_export: bool, done: dict[str, Any]) -> None:
    if _missing(stage, with_export):
        with wait_beside(stage.resolved_run_dir, "restore"):
            if _missing(stage, with_export):  # another process of this machine may have restored it
                _restore(stage, with_export, done)


def mirrored_runs(settings: Settings, run_dir: str) -> list[tuple[Settings, bool]]:
    """(settings of a run dir the train step mirrored, whether later steps read its export), as
    `workflow.finetune.train` (or `workflow.grpo.train`, `rl:`) trained them: each stage's
    `resolved_run_dir` and its `checkpoint.remote_dir` prefix."""
    if settings.rl is not None:  # GRPO mirrors its one run dir under the flow run's prefix
        return [(with_remote_run(settings.with_run_dir(run_dir), run_dir), True)]
    out = _last_with_export(training_stages(settings, run_dir))
    if ar_control.enabled(settings):
        out += _last_with_export(control_stages(settings, run_dir))
    return out


def _last_with_export(stages: list[Settings]) -> list[tuple[Settings, bool]]:
    return [(st, i == len(stages) - 1) for i, st in enumerate(stages)]


def _missing(stage: Settings, with_export: bool) -> list[str]:
    layout = runs.RunLayout(stage.resolved_run_dir)
    missing = [
        name for name in (runs.SETTINGS_JSON, runs.METRICS_JSONL) if not (layout.root / name).is_file()
    ]
    if with_export and not layout.is_finished(stage.train.max_steps):
        missing.append(runs.CHECKPOINTS)
    return missing


def _restore(stage: Settings, with_export: bool, done: dict[str, Any]) -> None:
    from dllmflow.training import storage

    remote, final = stage.checkpoint.remote_dir, runs.step_dir_name(stage.train.max_steps)
    layout = runs.RunLayout(stage.resolved_run_dir)
    latest = storage.remote_latest(remote)
    if latest != final:
        raise UserError(
            f"checkpoint.remote_dir {remote}: holds no finished run (LATEST: {latest or 'none'}; the run "
            f"ends at {final}), and {layout.root} lacks {', '.join(_missing(stage, with_export))}: run the "
            "train step to its end with this checkpoint.remote_dir, or these steps where the trainers' disk is"
        )
    layout.root.mkdir(parents=True, exist_ok=True)
    missing = _missing(stage, with_export)
    if runs.CHECKPOINTS in missing:
        done["bytes"] += storage.download_export(remote, final, layout.checkpoints)
        done["files"].append(str(runs.export_dir(layout.checkpoints / final)))
    for name in (runs.METRICS_JSONL, runs.SETTINGS_JSON):
        if name not in missing:
            continue
        upto = stage.train.max_steps if name == runs.METRICS_JSONL else None
        got = storage.download_run_file(remote, layout.root, name, upto_step=upto)
        recorded = layout.export()  # the export holds a copy of the run's settings.json
        if got is None and name == runs.SETTINGS_JSON and recorded is not None:
            shutil.copy2(recorded / name, layout.root / name)
        elif got is None:
            raise UserError(
                f"checkpoint.remote_dir {remote}: holds no {name}, which the steps after training read "
                f"(a run trained before the trainer mirrored it); run them where {layout.root} was written"
            )
        else:
            done["bytes"] += got
        done["files"].append(str(layout.root / name))
