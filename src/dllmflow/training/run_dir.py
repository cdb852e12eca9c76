"""The run dir a training writes: one writer at a time, never a silent restart, never a dir not ours.

    check_fresh_run(run, resume, overwrite)      # every rank, before the process group: nothing written yet
    with claim_run_dir(run, settings, info, resume=False, overwrite=True):   # collective
        ...                                      # rank 0 holds RUN/.dllmflow.lock for the whole block

One writer: rank 0 (the process that owns the run dir) holds `common.outputs.hold_dir_lock` on the run
dir for the whole training or resume; a second writer is refused with one line naming the holder's
pid, and every other rank of the refused run fails with the same line instead of waiting for rank 0.
Never a dir not ours: `--overwrite` deletes checkpoints, evaluations and metrics only in a dir that
carries RUN_MARKER, `settings.json`, which every entry (`dllmflow train`, the flow, `run_training`)
writes into the run dir before anything else; any other non-empty dir is refused and left untouched.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator

import torch

from dllmflow.common.outputs import (
    DirLockedError,
    OutputPathError,
    check_output_dir,
    hold_dir_lock,
    json_object_with,
)
from dllmflow.errors import UserError
from dllmflow.runs import METRICS_JSONL, SETTINGS_JSON, RunLayout
from dllmflow.training.distributed import DistInfo, barrier, shares_rank0_disk

RUN_MARKER = SETTINGS_JSON  # what proves a dir is one of our run dirs (see the module docstring)
RUN_KEYS = ("dllm", "model", "train")  # ... by its content: sections every dllmflow settings.json has


def check_fresh_run(run: RunLayout, resume: bool, overwrite: bool) -> None:
    """A run dir that is a file, or a non-empty dir (or a symlink to one) that is not one of our run
    dirs, is refused for any run (`check_overwritable`): nothing is written into it. A fresh run
    (neither `resume` nor `overwrite`) into a run dir that holds checkpoints would mix with that run's
    state: refused too, naming the dir and the fix."""
    check_overwritable(run)
    if not resume and not overwrite and run.has_checkpoints():
        raise UserError(
            f"run dir {run.root} already holds checkpoints ({run.checkpoints}); continue that run with "
            "--resume, start over with --overwrite (deletes its checkpoints and metrics), or pick "
            "another --run-dir"
        )


def check_overwritable(run: RunLayout) -> None:
    """OutputPathError naming the dir unless it is absent, empty or one of our run dirs (its
    settings.json a dllmflow settings file: RUN_KEYS, not merely a file of that name); a symlink is
    refused whatever it points to (README: output paths)."""
    field = "run_dir (--run-dir)"
    if run.root.is_symlink():  # written through, the link's target would take a run it was not named for
        raise OutputPathError(
            f"{field} = {run.root} is a symlink (to {run.root.readlink()}); refusing to write through it: "
            f"pass the directory itself ({run.root.resolve()})"
        )
    if check_output_dir(run.root, marker=RUN_MARKER, kind="dllmflow run dir", field=field):
        if not json_object_with(run.settings_json, RUN_KEYS):
            raise OutputPathError(
                f"{field} = {run.root}: its {RUN_MARKER} is not dllmflow's (no {'/'.join(RUN_KEYS)}); refusing "
                "to write into it: choose an empty or new path"
            )


def clear_run(run: RunLayout) -> None:
    """What `--overwrite` deletes: the old run's checkpoints, metrics and evaluations (logs stay)."""
    check_overwritable(run)
    shutil.rmtree(run.checkpoints, ignore_errors=True)
    shutil.rmtree(run.eval_dir, ignore_errors=True)
    (run.root / METRICS_JSONL).unlink(missing_ok=True)


@contextlib.contextmanager
def claim_run_dir(
    run: RunLayout, settings, info: DistInfo, *, resume: bool, overwrite: bool
) -> Iterator[None]:
    """Collective: lock the run dir on rank 0 (refused: DirLockedError on every rank), then, with
    `overwrite`, clear the old run on every disk, and record `settings` as settings.json where it is missing
    or differs (the launcher hands them inline: a resume with changed settings records what now runs)."""
    with contextlib.ExitStack() as stack:
        refused = None
        if info.is_main:
            try:
                stack.enter_context(hold_dir_lock(run.root, "resume" if resume else "train"))
            except DirLockedError as e:
                refused = str(e)
        if info.distributed:  # the others learn rank 0's answer instead of waiting in a collective
            box = [refused]
            torch.distributed.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused is not None:
            raise DirLockedError(refused)
        if info.is_main:
            _record(run, settings, overwrite)
        if info.distributed:
            run.root.mkdir(parents=True, exist_ok=True)
            # A node with a disk of its own clears its copy too, and records the settings it was handed
            # there: its dir then reads as a run dir when it resumes from its own checkpoints.
            if not shares_rank0_disk(run.root, info) and info.local_rank == 0:
                _record(run, settings, overwrite)
            barrier()  # no rank looks at the run dir before it is cleared and recorded
        yield


def _record(run: RunLayout, settings, overwrite: bool) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    if overwrite:
        clear_run(run)
    if overwrite or _recorded(run.settings_json) != settings.to_dict():
        settings.write_json(run.settings_json)


def _recorded(path) -> dict | None:
    """The settings a run dir records (None: none, or unreadable: then they are written afresh)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
