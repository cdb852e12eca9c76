"""The one owner of the run layout: run dirs, step dirs, LATEST, exports, stages, flow runs.

    runs/<name>/                          Settings.resolved_run_dir (`run_dir`, default runs/<name>): the recipe dir
      cli/                                `dllmflow train` without --run-dir or `run_dir` (`cli_run_dir`), beside:
      flow-<run_id>/                      one Metaflow run (`flow_run_dir`); each run dir below holds
        settings.json                     what ran (Settings.write_json); copied into every export
        metrics.jsonl                     one record per step (rank 0)
        logs/                             torchx/torchrun logs of the local schedulers
        eval/<sampler>.json               one evaluation per sampler
        checkpoints/
          step_000040/model/              DCP state (see training/checkpoint.py)
          step_000040/model/consolidated/ the Hugging Face export (config.json, weights, tokenizer)
          step_000040/manifest.json       sha256 of every file: a step dir holding it is complete
          LATEST -> step_000040           relative symlink, or LATEST.txt holding the name (missing,
                                          dangling or garbage: a resume falls back to the newest
                                          complete step dir)
        stage_0/, stage_1/, ...           a curriculum (I-DLM block_length): one run dir per stage

    layout = RunLayout("runs/tiny_mdlm/flow-12")
    layout.metrics_jsonl, layout.eval_file("llada"), layout.latest_step(), layout.export()
    training_summary("runs/tiny_mdlm/flow-12")  # steps, tokens, supervised tokens, wall seconds
    resolve_checkpoint("runs/tiny_mdlm")  # -> the newest run's (flow or cli) consolidated export

Stdlib only (no torch): everything from settings up may ask it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
LATEST_TXT = "LATEST.txt"
MODEL = "model"
CONSOLIDATED = "consolidated"
SETTINGS_JSON = "settings.json"
METRICS_JSONL = "metrics.jsonl"
EVAL = "eval"
LOGS = "logs"
FLOW_PREFIX = "flow-"
CLI_RUN = "cli"  # `dllmflow train`'s default run dir inside the recipe dir, beside the flow runs
STAGE_PREFIX = "stage_"
HF_CONFIG = "config.json"  # what makes a dir a loadable Hugging Face model
MANIFEST = "manifest.json"  # sha256 of every file of a step dir (training/checkpoint.py)

TMP_STEP_GLOB = ".step_*.tmp"  # matches every `tmp_step_dir_name`
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_STAGE_RE = re.compile(rf"^{STAGE_PREFIX}(\d+)$")


# ---- step dirs and the LATEST pointer ------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def tmp_step_dir_name(step: int) -> str:
    """Where a step dir is written before it is renamed into place (pruned when left by a crash)."""
    return f".{step_dir_name(step)}.tmp"


def latest_name(root: str | os.PathLike) -> str | None:
    """What the LATEST pointer holds (its symlink target, or LATEST.txt's text), valid or not; None when
    there is no pointer. Callers name it in messages; `read_latest` decides whether it is usable."""
    root = Path(root)
    link = root / LATEST
    try:
        if link.is_symlink():
            return os.readlink(link)
        if link.is_dir():
            return LATEST
        txt = root / LATEST_TXT
        return txt.read_text(errors="replace").strip() if txt.is_file() else None
    except OSError:
        return ""


def read_latest(root: str | os.PathLike) -> Path | None:
    """The dir `root/LATEST` (symlink) or `root/LATEST.txt` names, or None when there is none or it is
    dangling or garbage (not the name of a dir directly in `root`: our `step_XXXXXX`, or another
    trainer's `epoch_0_step_499`; never a path that leaves `root`). The path goes through the link
    (`root/LATEST`), so callers see the stable name."""
    root = Path(root)
    link = root / LATEST
    name = latest_name(root)
    if name is None or (name != LATEST and not _is_child_name(name)):
        return None
    target = link if link.is_symlink() or name == LATEST else root / name
    return target if target.is_dir() else None


def _is_child_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not name.startswith(".") and not set(name) & {"/", "\\"}


def latest_target(root: str | os.PathLike) -> Path | None:
    """Like `read_latest`, but the real step dir (`root/step_XXXXXX`), not the link."""
    latest = read_latest(root)
    if latest is None or latest.name != LATEST:
        return latest
    return Path(root) / os.readlink(latest) if latest.is_symlink() else latest


def complete_steps(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Step dirs holding a checksum manifest (written last, before the rename that publishes a step
    dir), oldest first. Whether the files still match it is checked by training/checkpoint.py."""
    return [(s, p) for s, p in checkpoint_steps(root) if (p / MANIFEST).is_file()]


def write_latest(root: str | os.PathLike, name: str) -> None:
    """Point LATEST at `root/name` atomically: a relative symlink (the run dir can move), or LATEST.txt
    where symlinks fail."""
    from dllmflow.common.files import atomic_write_text, fsync_dir

    root = Path(root)
    tmp = root / f".{LATEST}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(name, tmp)
        os.replace(tmp, root / LATEST)
        (root / LATEST_TXT).unlink(missing_ok=True)  # a stale fallback must not win
        fsync_dir(root)
    except OSError:
        tmp.unlink(missing_ok=True)
        atomic_write_text(root / LATEST_TXT, name + "\n")


def export_dir(step_dir: str | os.PathLike) -> Path:
    """The consolidated Hugging Face export inside a step dir."""
    return Path(step_dir) / MODEL / CONSOLIDATED


# ---- one run dir ---------------------------------------------------------------------------------


class RunLayout:
    """Paths of one run dir (a `dllmflow train` run, a flow run or one curriculum stage)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    @property
    def settings_json(self) -> Path:
        return self.root / SETTINGS_JSON

    @property
    def metrics_jsonl(self) -> Path:
        return self.root / METRICS_JSONL

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS

    @property
    def eval_dir(self) -> Path:
        return self.root / EVAL

    def eval_file(self, sampler: str) -> Path:
        return self.eval_dir / f"{sampler}.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    def latest_step(self) -> Path | None:
        """The step dir LATEST points at (its real name); where LATEST is missing, dangling or garbage,
        the newest complete step dir (a resume falls back to it, warning); else None."""
        latest = latest_target(self.checkpoints)
        if latest is None and (complete := complete_steps(self.checkpoints)):
            return complete[-1][1]
        return latest

    def has_checkpoints(self) -> bool:
        """Any step dir or LATEST pointer: a fresh run here would mix with another run's state."""
        return bool(checkpoint_steps(self.checkpoints)) or latest_name(self.checkpoints) is not None

    @property
    def latest_export(self) -> Path:
        """`checkpoints/LATEST/model/consolidated`: where the newest export will be, written before it
        exists (the next curriculum stage starts from it)."""
        return export_dir(self.checkpoints / LATEST)

    def export(self) -> Path | None:
        """The consolidated export LATEST points at, when it was written."""
        latest = read_latest(self.checkpoints)
        return export_dir(latest) if latest is not None and _is_hf_dir(export_dir(latest)) else None

    def is_finished(self, max_steps: int) -> bool:
        """LATEST is the final step and holds its export: nothing is left to train."""
        latest = self.latest_step()
        return latest is not None and latest.name == step_dir_name(max_steps) and export_dir(latest).is_dir()

    def stage(self, index: int) -> RunLayout:
        return RunLayout(self.root / f"{STAGE_PREFIX}{index}")

    def stages(self) -> list[RunLayout]:
        """Curriculum stage dirs present, in stage order."""
        return [RunLayout(p) for _, p in _numbered_children(self.root, _STAGE_RE)]

    def flow_runs(self) -> list[RunLayout]:
        """`flow-*` run dirs below this recipe dir."""
        if not self.root.is_dir():
            return []
        return [RunLayout(p) for p in sorted(self.root.glob(f"{FLOW_PREFIX}*")) if p.is_dir()]

    def recipe_runs(self) -> list[RunLayout]:
        """The run dirs below this recipe dir: its flow runs and the CLI's (`cli_run_dir`)."""
        cli = self.root / CLI_RUN
        return self.flow_runs() + ([RunLayout(cli)] if cli.is_dir() else [])


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a run's metrics.jsonl (`path`: the run dir or the file itself); [] before the
    first step, a line cut by a killed writer skipped."""
    from dllmflow.common.files import read_jsonl

    path = Path(path)
    return read_jsonl(RunLayout(path).metrics_jsonl if path.is_dir() else path)


def training_summary(run_dir: str | os.PathLike) -> dict[str, float]:
    """A run's optimizer steps, tokens read (padding included) and supervised tokens, and the wall
    seconds of its steps (metrics.jsonl: tokens_per_step / tps per step; checkpoint saves excluded)."""
    records = read_metrics(run_dir)
    return {
        "train_steps": max((int(r["step"]) for r in records), default=0),
        "train_tokens": sum(int(r.get("tokens_per_step", 0)) for r in records),
        "train_supervised_tokens": sum(int(r.get("supervised_tokens", 0)) for r in records),
        "train_seconds": sum(r["tokens_per_step"] / r["tps"] for r in records if r.get("tps")),
    }


def run_training(run_dir: str | os.PathLike) -> dict[str, float]:
    """`training_summary` of a run, summed over its curriculum stages when it has some (`run_dir` may be
    the flow run's dir or its last stage's, as `workflow.finetune.train` reports it)."""
    path = Path(run_dir)
    root = path.parent if path.name.startswith(STAGE_PREFIX) else path
    parts = [training_summary(st.root) for st in RunLayout(root).stages()] or [training_summary(path)]
    return {k: sum(p[k] for p in parts) for k in parts[0]}


def flow_run_dir(base: str | os.PathLike, run_id: str) -> Path:
    """One run dir per flow run under the recipe's run dir; a resumed flow (origin run id) reuses it."""
    return Path(base) / f"{FLOW_PREFIX}{run_id}"


def cli_run_dir(base: str | os.PathLike) -> Path:
    """`dllmflow train`'s run dir when neither --run-dir nor `run_dir` names one: `cli/` under the recipe's
    run dir, beside its flow runs (so a flow and the CLI of one recipe never write the same dir)."""
    return Path(base) / CLI_RUN


# ---- checkpoint resolution ---------------------------------------------------------------------------


def checkpoint_candidates(path: str | os.PathLike) -> list[Path]:
    """docs/strategies.md §1.6 order, then our run-dir layout (`<run>/checkpoints/LATEST/model/consolidated`)."""
    p = Path(path)
    out = [p / CONSOLIDATED, p]
    latest = read_latest(p)
    if latest is not None:
        out += [export_dir(latest), latest / MODEL]
    out += [export_dir(p), p / MODEL]
    run_latest = read_latest(p / CHECKPOINTS)
    if run_latest is not None:
        out += [export_dir(run_latest), run_latest / MODEL]
    return out


def find_export(path: str | os.PathLike) -> Path | None:
    """The Hugging Face dir `path` stands for, or None. In order: a consolidated dir as is, a step dir,
    a checkpoint root (LATEST), a run dir (checkpoints/LATEST), a curriculum run (its last stage with an
    export), a recipe dir of runs (the newest flow or CLI run with an export)."""
    p = Path(path)
    for cand in checkpoint_candidates(p):
        if _is_hf_dir(cand):
            return cand
    for stage in reversed(RunLayout(p).stages()):
        found = find_export(stage.root)
        if found is not None:
            return found
    return newest_run_export(p)


def newest_run_export(base: str | os.PathLike) -> Path | None:
    """The export of the newest run under the recipe dir `base` (a `flow-*` run or the CLI's `cli`) that
    has one (newest = mtime of its LATEST target, else of the run dir)."""
    best: tuple[float, str, Path] | None = None
    for run in RunLayout(base).recipe_runs():
        found = find_export(run.root)
        if found is not None:
            key = (_export_time(found, run.root), run.root.name, found)
            best = max(best, key) if best else key
    return best[2] if best else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`find_export`, or a UserError naming the path and what was looked for."""
    p = Path(path)
    if not p.exists():
        raise UserError(
            f"checkpoint {p} does not exist; pass a consolidated dir, a step dir, a checkpoint root or a run dir"
        )
    found = find_export(p)
    if found is None:
        raise UserError(
            f"checkpoint {p} holds no HF model ({HF_CONFIG}) in any of: consolidated/, ./, "
            "LATEST/model/consolidated/, LATEST/model/, model/consolidated/, model/, "
            "checkpoints/LATEST/model/consolidated/, stage_<i>/..., flow-<id>/..., cli/... "
            "(was the consolidated export written? checkpoint.save_consolidated)"
        )
    return found


def find_consolidated(run_dir: str | os.PathLike) -> Path:
    """The consolidated export of a finished run dir (checkpoints/LATEST/model/consolidated)."""
    return resolve_checkpoint(RunLayout(run_dir).checkpoints)


def read_finished_run(run_dir: str | os.PathLike) -> tuple[Path, Any, dict[str, float]]:
    """-> (its export, the Settings recorded beside it or None, `run_training`): what the evaluation of a
    finished run reads of it, in one look (inference/resolved.py `resolve_run`)."""
    export = find_consolidated(run_dir)
    return export, recorded_settings(export), run_training(run_dir)


def recorded_settings(export: str | os.PathLike):
    """The training `Settings` recorded next to an export's weights (settings.json), or None."""
    from dllmflow.settings import load_settings_json

    path = Path(export) / SETTINGS_JSON
    return load_settings_json(path) if path.is_file() else None


def _is_hf_dir(path: Path) -> bool:
    return (path / HF_CONFIG).is_file()


def _export_time(export: Path, run_root: Path) -> float:
    step = export.parent.parent if export.parent.name == MODEL else None
    if step is not None and step.parent.name == CHECKPOINTS:
        return step.resolve().stat().st_mtime
    return run_root.stat().st_mtime


def _numbered_children(root: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := pattern.match(p.name))]
    return sorted(found)


def checkpoint_steps(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete step dirs under a checkpoint root, oldest first."""
    return _numbered_children(Path(root), _STEP_RE)
