"""The training runtime: a Trainer (build, resume, train_step, log, save, export) over one strategy.

    from dllmflow.training.trainer import Trainer, run_training
    result = run_training(settings, "runs/tiny", resume=False)   # in-process: one rank
    result = Trainer(settings, "runs/tiny", hooks=[MyHook()]).run()
    # or, one process per rank:  torchrun --nproc_per_node 2 -m dllmflow.training.main --run-dir runs/tiny

`Trainer.run`: refuse a fresh run over checkpoints (run_dir.py) -> process group -> lock the run dir
(rank 0 holds it until the end; a second writer is refused naming its pid) -> `build` (data,
tokenizer, model on meta -> parallelize -> materialise, optimizer, scheduler, Checkpointer) ->
`resume` (LATEST, or the newest complete checkpoint, restored from `checkpoint.remote_dir` when the
local disk lost it) -> `fit`: per step `train_step` (forward/backward with global normalisation,
step.py; clip; a NaN/inf loss or grad norm stops the run with `NonFiniteError` before the AdamW step,
or skips it within `train.max_nonfinite_skips`), `log` (metrics.jsonl, console, live MLflow, MFU),
`save` every `checkpoint.every_steps` (the last step always, with the consolidated `export`), then
every hook's `after_step`. The loop's own state (the completed step, the samples consumed, the
non-finite skips and any counter a subclass adds to `counters`) goes into each checkpoint's
trainer_state.json (`state_dict`) and comes back on resume (`load_state_dict`), so the skip budget is
the whole run's.

Hooks (`TrainerHook`) are passed in code only, never enabled from settings, env or a checkpoint; tests
use them to kill a run at a step (tests/_plugins). A second loop (RL) subclasses the Trainer and
overrides `build`/`train_step`, and reuses the Checkpointer as is.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dllmflow.common.progress import Progress
from dllmflow.errors import UserError
from dllmflow.models.lora import export_with_lora
from dllmflow.models.wrappers import unwrap
from dllmflow.runs import CONSOLIDATED, RunLayout, export_dir
from dllmflow.training.checkpoint import TRAINER_STATE, read_json
from dllmflow.training.checkpointer import Checkpointer, full_state_dict
from dllmflow.training.distributed import init_distributed
from dllmflow.training.fingerprint import check_fingerprint
from dllmflow.training.live import build_live_logger
from dllmflow.training.metrics import MetricsLog, console_line, memory_gib
from dllmflow.training.parallelize import build_parallel_model, compute_context
from dllmflow.training.run_dir import check_fresh_run, claim_run_dir
from dllmflow.training.step import clip_grad_norm, train_step

__all__ = [
    "NonFiniteError",
    "TrainResult",
    "Trainer",
    "TrainerHook",
    "build_optimizer",
    "check_finite",
    "lr_factor",
    "run_training",
    "train_step",
]


class NonFiniteError(UserError):
    """A step's global loss or grad norm is NaN/inf (the message names the step and the fixes)."""


@dataclass
class TrainResult:
    run_dir: Path
    final_step: int
    losses: list[float] = field(default_factory=list)  # this invocation's per-step global losses
    checkpoint_dir: Path | None = None
    consolidated_dir: Path | None = None

    @property
    def metrics_path(self) -> Path:
        return RunLayout(self.run_dir).metrics_jsonl


class TrainerHook:
    """Called by the loop on every rank; override what you need. Passed in code only."""

    def after_step(self, trainer: Trainer, step: int) -> None:
        """After completed step `step` was logged and (when due) checkpointed."""


def build_optimizer(model: torch.nn.Module, settings) -> torch.optim.Optimizer:
    t = settings.train
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=t.lr, betas=t.betas, eps=t.adam_eps, weight_decay=t.weight_decay)


def lr_factor(step: int, settings) -> float:
    """Multiplier of train.lr for the update after `step` completed steps: linear warmup, then cosine
    down to min_lr_ratio at max_steps (or constant)."""
    t = settings.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_finite(record: dict[str, Any], step: int, skips: int, settings) -> bool:
    """False for a finite step; True when this non-finite step may be skipped (fewer than
    `train.max_nonfinite_skips` skipped so far); else NonFiniteError naming the step."""
    loss, norm = record["loss"], record["grad_norm"]
    if math.isfinite(loss) and math.isfinite(norm):
        return False
    t = settings.train
    if skips < t.max_nonfinite_skips:
        return True
    skipped = (
        f" after {skips} skipped step(s) (train.max_nonfinite_skips={t.max_nonfinite_skips})" if skips else ""
    )
    raise NonFiniteError(
        f"step {step}: non-finite loss {loss} / grad_norm {norm}{skipped}; stopped before the optimizer "
        f"step, so no checkpoint holds these weights. Lower train.lr (now {t.lr:g}) or allow "
        "skipped steps with train.max_nonfinite_skips"
    )


def run_training(
    settings,
    run_dir: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    hooks: Sequence[TrainerHook] = (),
) -> TrainResult:
    """`Trainer(...).run()`. `resume`: continue from LATEST (or the newest complete checkpoint, see
    training/checkpointer.py); with no checkpoint at all it starts from step 0 (nothing is lost: only
    steps that never reached a checkpoint are rerun; an elastic restart before the first checkpoint
    lands here). Without `resume`, a run dir that holds checkpoints is refused unless `overwrite`
    (which deletes them and the metrics, in a dir that is a run dir: run_dir.py)."""
    return Trainer(settings, run_dir, resume=resume, overwrite=overwrite, hooks=hooks).run()


class Trainer:
    """One training run into one run dir. Attributes exist after `build`: info, tokenizer, dataset,
    batches, strategy, model, optimizer, scheduler, checkpointer, metrics, autocast, result."""

    def __init__(
        self,
        settings,
        run_dir: str | os.PathLike | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
        hooks: Sequence[TrainerHook] = (),
    ) -> None:
        # What settings.json (and so the export and MLflow params) records is the dir written to.
        self.settings = settings.with_run_dir(run_dir) if run_dir is not None else settings
        self.layout = RunLayout(run_dir if run_dir is not None else settings.resolved_run_dir)
        self.resuming = resume
        self.overwrite = overwrite and not resume  # a resume (an elastic restart) never deletes anything
        self.hooks = list(hooks)
        self.step = 0  # completed optimizer steps
        # The loop's counters, saved with each checkpoint and restored on resume (`state_dict`): over
        # the whole run, not per process. A subclass adds its own in `build`.
        self.counters: dict[str, int] = {"samples_seen": 0, "nonfinite_skips": 0}

    def run(self) -> TrainResult:
        """Collective: claim the run dir, build, resume, fit."""
        check_fresh_run(self.layout, self.resuming, self.overwrite)
        self.info = init_distributed(self.settings)
        with claim_run_dir(
            self.layout, self.settings, self.info, resume=self.resuming, overwrite=self.overwrite
        ):
            self.build()
            start = self.resume()
            return self.fit(start)

    # ---- build / resume -------------------------------------------------------------------------

    def build(self) -> None:
        """Data, tokenizer, strategy, model, optimizer, scheduler, checkpointer (identical init on every
        rank: seeded before building)."""
        from dllmflow.data.dataset import PreparedDataset
        from dllmflow.data.pack import build_collator
        from dllmflow.data.remote import local_prepared_dir
        from dllmflow.data.tokenizer import load_tokenizer
        from dllmflow.training.data import GlobalBatches

        s, t, info = self.settings, self.settings.train, self.info
        # this node's copy: fetched (verified, one process per machine) when dataset.remote_dir is set
        prepared = local_prepared_dir(s)
        self.tokenizer = load_tokenizer(prepared)
        self.dataset = PreparedDataset(prepared, "train")
        collator = build_collator(s, self.tokenizer)
        self.samples_per_step = t.global_batch_size
        self.batches = GlobalBatches(
            self.dataset,
            collator,
            t.global_batch_size,
            t.local_batch_size,
            info.rank,
            info.world_size,
            t.seed,
        )
        self.build_model()

    def build_model(self) -> None:
        """Strategy, model, optimizer, scheduler, checkpointer, metrics, after `self.tokenizer` (seeded
        first: identical init on every rank)."""
        from dllmflow.diffusion.strategies import build_strategy

        s, info = self.settings, self.info
        if s.model.remote_dir:  # the model is a run's export this disk may lack (uno on the AR control's)
            from dllmflow.training.storage import fetch_model_export

            fetch_model_export(s.model.remote_dir, s.model.pretrained_model_name_or_path)
        torch.manual_seed(s.train.seed)
        self.strategy = build_strategy(s)
        # meta build -> LoRA adapters -> activation checkpointing / compile / FSDP2 -> materialise ->
        # init or load (-> DDP)
        self.model = build_parallel_model(self.tokenizer, s, info)
        self.strategy.setup(self.model, self.tokenizer, info.device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.model.train()
        self.optimizer = build_optimizer(self.model, s)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda n: lr_factor(n, s))
        self.checkpointer = Checkpointer.from_settings(s, self.layout, info)
        self.metrics = MetricsLog(self.layout.metrics_jsonl, enabled=info.is_main)
        self.autocast = compute_context(s, info)

    def resume(self) -> int:
        """The step to start from (0 for a fresh run): never a silent restart over existing
        checkpoints, never another run's state. Drops metrics logged after it."""
        state = None
        if self.resuming and (step_dir := self.checkpointer.find()) is not None:
            self._check_before_load(step_dir)
            state = {
                **self.checkpointer.load(step_dir, self.model, self.optimizer, self.scheduler),
                "dir": step_dir,
            }
        latest = None if state is None else state["dir"]
        if state is not None:
            self.load_state_dict(state)
        start = self.step
        if self.resuming and state is None:
            self._print(f"--resume: no checkpoint under {self.checkpointer.root} yet; starting from step 0")
        elif latest is not None:
            self._print(f"resumed from {latest} at step {start}")
        self.metrics.truncate_after(start)
        self.result = TrainResult(run_dir=self.layout.root, final_step=start, checkpoint_dir=latest)
        if latest is not None and export_dir(latest).is_dir():  # a finished run resumed: nothing left
            self.result.consolidated_dir = export_dir(latest)
        return start

    def _check_before_load(self, step_dir: Path) -> None:
        """The checkpoint's settings, then its data position, before any weight loads: a prepared dir
        rebuilt with another vocabulary is the data refusal (`check_resume`), not a size-mismatch
        traceback from loading an embedding of the other size."""
        saved = read_json(step_dir / TRAINER_STATE)
        if self.checkpointer.fingerprint is not None:
            check_fingerprint(saved, self.checkpointer.fingerprint, step_dir)
        if hasattr(self, "batches"):
            self.batches.check_resume(saved.get("data"), int(saved["step"]))

    # ---- the loop -------------------------------------------------------------------------------

    def fit(self, start: int) -> TrainResult:
        """Steps `start` .. train.max_steps: train_step, log, save when due, hooks."""
        t = self.settings.train
        # MLflow on rank 0 when the launcher passed a run id; closed below, or at exit after a failure.
        self.live = build_live_logger(self.settings, self.info.is_main)
        # Rank 0: a live bar on a terminal, else (torchrun under the launcher, CI) a line every log_every.
        self.bar = Progress(
            "train", t.max_steps, unit="steps", every=t.log_every, start=start, enabled=self.info.is_main
        )
        tick = time.perf_counter()
        for step in range(start, t.max_steps):
            record = self.train_step(step)
            now = time.perf_counter()
            dt, tick = now - tick, now
            self.step = done = step + 1
            self.counters["samples_seen"] += self.samples_per_step
            self.log(record, done, dt)
            if self.checkpointer.due(done, last=done == t.max_steps):
                self.save(done)
            self.result.final_step = done
            for hook in self.hooks:
                hook.after_step(self, done)
        self.bar.close()
        if self.live is not None:
            self.live.close()
        return self.result

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer update after `step` completed steps; the step's globally reduced record."""
        record = train_step(
            self.model, self.strategy, self.batches, step, self.settings, self.info, self.autocast
        )
        record.update(self.update(record["loss"], step))
        self.scheduler.step()
        return record

    def update(self, loss: float, step: int, label: str = "") -> dict[str, Any]:
        """Clip, then the AdamW step, or none for a non-finite `loss` or grad norm within
        `train.max_nonfinite_skips` over the run (else NonFiniteError); gradients zeroed after.
        `loss` is the global loss: every rank sees the same loss and norm, so every rank decides the
        same way. -> {"grad_norm", "lr"[, "skipped"]}. The LR scheduler is the caller's."""
        t = self.settings.train
        norm = clip_grad_norm(self.model, t.max_grad_norm)
        out: dict[str, Any] = {"grad_norm": norm, "lr": self.optimizer.param_groups[0]["lr"]}
        skips = self.counters["nonfinite_skips"]
        if check_finite({"loss": loss, "grad_norm": norm}, step + 1, skips, self.settings):
            self.counters["nonfinite_skips"] = skips + 1
            out["skipped"] = True
            self._print(
                f"step {step + 1}{label}: non-finite loss/grad_norm, update skipped "
                f"({skips + 1}/{t.max_nonfinite_skips})"
            )
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def log(self, record: dict[str, Any], step: int, dt: float) -> None:
        """Complete the record of step `step` (took `dt` s) and write it: metrics.jsonl, console, MLflow."""
        t = self.settings.train
        epoch = self.counters["samples_seen"] / len(self.dataset)
        record.update(step=step, epoch=epoch, mode=self.settings.dllm.mode)
        record["mem"] = memory_gib(self.info.device)
        record["tps"] = record["tokens_per_step"] / dt
        if t.peak_tflops:
            flops = 6.0 * self.num_params * record["tokens_per_step"]
            record["mfu"] = 100.0 * flops / 1e12 / (self.info.world_size * dt) / t.peak_tflops
        self.result.losses.append(record["loss"])
        self.metrics.write(record)
        self.bar.advance(line=console_line(record, t.max_steps), loss=record["loss"], tok_s=record["tps"])
        if self.live is not None:
            self.live.log(record, step)

    # ---- checkpoint / export --------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Collective: checkpoint completed step `step` (with the consolidated export when
        `checkpoint.save_consolidated` asks for it at this step)."""
        mode, last = self.settings.checkpoint.save_consolidated, step == self.settings.train.max_steps
        export = self.export if mode == "every" or (mode == "final" and last) else None
        self.result.checkpoint_dir = self.checkpointer.save(
            step, self.model, self.optimizer, self.scheduler, extra_state=self.state_dict(), export=export
        )
        if export is not None:
            self.result.consolidated_dir = export_dir(self.result.checkpoint_dir)
        return self.result.checkpoint_dir

    def state_dict(self) -> dict[str, Any]:
        """The loop state saved with each checkpoint (trainer_state.json; the model, optimizer and
        scheduler are the Checkpointer's): the completed step, the samples consumed and every counter
        in `self.counters` (a subclass adds its own there in `build`)."""
        return {"step": self.step, **self.counters, **self._data_position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (`resume`, from the checkpoint's trainer_state.json)."""
        self.step = int(state["step"])
        if hasattr(self, "batches"):  # the SFT sampler: exactly the next sample, or refused
            self.batches.check_resume(state.get("data"), self.step)
        for key in self.counters:
            self.counters[key] = int(state.get(key, 0))

    def _data_position(self) -> dict[str, Any]:
        """{"data": consumed samples and what they index} when this trainer reads `GlobalBatches`."""
        return {"data": self.batches.state(self.step)} if hasattr(self, "batches") else {}

    def export(self, model_dir: Path) -> None:
        """Collective: the consolidated HF dir into `<model_dir>/consolidated` (rank 0 writes)."""
        state = full_state_dict(self.model)
        if self.info.is_main:
            out = model_dir / CONSOLIDATED
            out.mkdir(parents=True, exist_ok=True)
            strategy = self.strategy
            export_with_lora(
                strategy.export, unwrap(self.model), state, self.tokenizer, out, strategy.settings,
                merge=strategy.merge_adapters,
            )  # fmt: skip
            settings_json = self.layout.settings_json
            shutil.copy2(settings_json, out / settings_json.name)

    def _print(self, msg: str) -> None:
        if self.info.is_main:
            print(msg, flush=True)
