"""One resolution of a checkpoint: the export a path stands for and what was recorded with it, read once
at an entry (evaluate, generate, serve, the pyfunc, the gate's re-measure) and passed on instead of the path.

    ckpt = resolve("runs/tiny_mdlm")         # runs.resolve_checkpoint + runs.recorded_settings, once
    ckpt.path, ckpt.settings, ckpt.mode      # the HF export dir, its training Settings (or None), their mode
    ckpt.default_sampler                     # the export's own (config.json `dllm`), else its mode's first
    ckpt.record                              # what an evaluation records of the weights it ran (their sha256)
    ckpt = resolve_run("runs/x/flow-12")     # a finished run dir's export (checkpoints/LATEST/...)
    ckpt.training                            # ... and its steps, tokens and seconds (metrics.jsonl)
    ckpt = of_export(export_dir)             # a dir already found to be the export: no search

Functions that took a path keep taking one (`resolve` of a `ResolvedCheckpoint` is itself, so a caller
that resolved already pays nothing). `str(ckpt)` is the checkpoint as the caller named it: what messages
and an evaluation's protocol (`checkpoint`) name, as they did when the path itself was passed on.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.runs import read_finished_run, recorded_settings, resolve_checkpoint


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint as resolved once: where its export is and what was recorded with it."""

    given: str  # as the caller named it (a run dir, a step dir, the export itself, ...)
    path: Path  # the Hugging Face export dir it stands for (config.json, weights, tokenizer)
    settings: Any = None  # the training Settings recorded beside the weights (settings.json), or None
    dllm: dict[str, Any] = field(default_factory=dict)  # config.json's `dllm` block ({} when none)
    training: dict[str, float] | None = None  # a finished run's steps, tokens, seconds (`resolve_run`)

    def __str__(self) -> str:
        return self.given

    @property
    def mode(self) -> str | None:
        """The recorded training mode (`dllm.mode` of settings.json), None when nothing was recorded."""
        return self.settings.dllm.mode if self.settings is not None else None

    @property
    def record(self) -> dict[str, str | None]:
        """What an evaluation's protocol records of the weights it ran, so `dllmflow register` can bind it
        to a run's export: `checkpoint` as given, `checkpoint_dir` (the export) and `checkpoint_sha256`."""
        export = self.path.resolve()
        return {
            "checkpoint": self.given,
            "checkpoint_dir": str(export),
            "checkpoint_sha256": weights_sha256(export),
        }

    @property
    def tokenizer_dir(self) -> Path:
        """Where its tokenizer files are: saved with the weights by every export."""
        return self.path

    @property
    def default_sampler(self) -> str:
        """The sampler it decodes with when none is asked for: its `dllm.default_sampler` (config.json,
        written at export), else the first sampler of its recorded mode, else llada (an export from
        before either was recorded). A mode no sampler decodes alone (DFlash) is a UserError."""
        from dllmflow.diffusion.modes import MODES

        if self.dllm.get("default_sampler"):
            return self.dllm["default_sampler"]
        if self.settings is None:
            return "llada"
        if MODES[self.mode].default_sampler is None:
            raise UserError(
                f"checkpoint {self.path} was trained with dllm.mode={self.mode}; no sampler decodes it "
                "alone (evaluate a DFlash draft with its target: the flow's acceptance evaluation); or pass "
                "--sampler"
            )
        return MODES[self.mode].default_sampler


def resolve(checkpoint: str | os.PathLike | ResolvedCheckpoint) -> ResolvedCheckpoint:
    """The export `checkpoint` stands for (`runs.resolve_checkpoint`: a UserError naming what was looked
    for when there is none) and its records; a `ResolvedCheckpoint` as it is."""
    if isinstance(checkpoint, ResolvedCheckpoint):
        return checkpoint
    return _read(resolve_checkpoint(checkpoint), checkpoint)


def resolve_run(run_dir: str | os.PathLike) -> ResolvedCheckpoint:
    """A finished run dir's export (`runs.find_consolidated`), named by the export's own path (what the
    flow's evaluations record as their `checkpoint`), with the run's training summary."""
    from dllmflow.models.model_card import read_dllm_block

    export, settings, training = read_finished_run(run_dir)
    return ResolvedCheckpoint(str(export), export, settings, read_dllm_block(export) or {}, training)


def of_export(
    export: str | os.PathLike | ResolvedCheckpoint, given: str | os.PathLike | None = None
) -> ResolvedCheckpoint:
    """`export`, a dir already known to be the export (`runs.find_export`'s answer, a downloaded
    artifact), with its records read; no search below it."""
    if isinstance(export, ResolvedCheckpoint):
        return export
    return _read(Path(export), given if given is not None else export)


def _read(export: Path, given: str | os.PathLike) -> ResolvedCheckpoint:
    """The records beside an export: its training settings and its config.json `dllm` block."""
    from dllmflow.models.model_card import read_dllm_block

    return ResolvedCheckpoint(str(given), export, recorded_settings(export), read_dllm_block(export) or {})


def weights_sha256(export: str | os.PathLike) -> str | None:
    """sha256 over each weight file's name and sha256 (streamed; each file version hashed once per
    process: a sweep evaluates one checkpoint many times); None for a dir without safetensors."""
    from dllmflow.common.files import sha256_file_once
    from dllmflow.models.integrity import weight_files

    files = weight_files(export)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_file_once(f)}\n".encode())
    return h.hexdigest()
