"""The training loop: one strategy, DDP/FSDP2, globally normalised losses, atomic checkpoints.

    from dllmflow.training.trainer import run_training
    result = run_training(settings, "runs/tiny", resume=False)   # in-process: one rank
    # or, one process per rank:  torchrun --nproc_per_node 2 -m dllmflow.training.main --settings runs/tiny/settings.json

One optimizer step (spec §1.3):
  1) every micro-batch of the step is collated and corrupted first (noise seeded per sample by its
     global position, so it does not depend on the topology);
  2) per-term token counts are summed over micro-batches and all-reduced over ranks;
  3) each micro-batch: total = sum_k w_k * sums_k / max(G_k, 1); backward of total * world_size
     (DDP/FSDP2 average gradients over ranks; this turns the average back into global sum / global count);
  4) clip; a NaN/inf loss or grad norm stops the run (`NonFiniteError`) before the AdamW step, so no
     checkpoint or export ever holds such weights (`train.max_nonfinite_skips` lets that many steps be
     skipped instead); AdamW step, LR schedule; metrics on rank 0; checkpoint every `checkpoint.every_steps`
     (mirrored to `checkpoint.remote_dir` when set, and restored from it on resume: storage.py).
The loss therefore does not depend on world size or gradient accumulation.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dllmflow.common.progress import Progress
from dllmflow.errors import UserError
from dllmflow.models.lora import export_with_lora
from dllmflow.models.wrappers import unwrap
from dllmflow.runs import CONSOLIDATED, RunLayout, export_dir
from dllmflow.training import checkpoint as ckpt
from dllmflow.training import storage
from dllmflow.training.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    grad_sync,
    init_distributed,
    shares_rank0_disk,
)
from dllmflow.training.live import build_live_logger
from dllmflow.training.metrics import MetricsLog, console_line, memory_gib
from dllmflow.training.parallelize import build_parallel_model, compute_context

# Fault injection for tests: raise after step N (after its checkpoint), on every rank or on one.
FAIL_AT_STEP_ENV = "DLLM_FAIL_AT_STEP"
FAIL_RANK_ENV = "DLLM_FAIL_RANK"


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


def run_training(
    settings, run_dir: str | os.PathLike | None = None, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """`resume`: continue from LATEST (or the newest complete checkpoint, see training/checkpoint.py);
    with no checkpoint at all it starts from step 0 (nothing is lost: only steps that never reached a
    checkpoint are rerun; an elastic restart before the first checkpoint lands here). Without `resume`, a
    run dir that holds checkpoints is refused unless `overwrite` (which deletes them and the metrics)."""
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.strategies import build_strategy
    from dllmflow.training.data import GlobalBatches

    # What settings.json (and so the export and MLflow params) records is the dir written to.
    settings = settings.with_run_dir(run_dir) if run_dir is not None else settings
    run = RunLayout(run_dir if run_dir is not None else settings.resolved_run_dir)
    run_dir = run.root
    ckpt.check_fresh_run(run, resume, overwrite)
    overwrite = overwrite and not resume  # a resume (e.g. an elastic restart) never deletes anything
    info = init_distributed(settings)
    t = settings.train
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:
            ckpt.clear_run(run)
        if overwrite or not run.settings_json.is_file():
            settings.write_json(run.settings_json)
    if overwrite and info.distributed:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not shares_rank0_disk(run_dir, info) and info.local_rank == 0:
            ckpt.clear_run(run)  # a node with a disk of its own clears its copy too
        barrier()  # no rank looks at the run dir before it is cleared

    # 1) data, tokenizer, model, strategy (identical init on every rank: seeded before building)
    prepared = settings.dataset.prepared_dir
    tokenizer = load_tokenizer(prepared)
    dataset = PreparedDataset(prepared, "train")
    collator = DLLMCollator.from_settings(settings, tokenizer)
    batches = GlobalBatches(
        dataset, collator, t.global_batch_size, t.local_batch_size, info.rank, info.world_size, t.seed
    )
    torch.manual_seed(t.seed)
    strategy = build_strategy(settings)
    # meta build -> LoRA adapters -> activation checkpointing / compile / FSDP2 -> materialise -> init or
    # load (-> DDP)
    model = build_parallel_model(strategy, tokenizer, settings, info)
    strategy.setup(model, tokenizer, info.device)
    num_params = sum(p.numel() for p in model.parameters())
    model.train()
    optimizer = build_optimizer(model, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, settings))

    # 2) resume: never a silent restart over existing checkpoints, never another run's state
    ckpt_root = run.checkpoints
    log = MetricsLog(run.metrics_jsonl, enabled=info.is_main)
    fingerprint = ckpt.settings_fingerprint(settings)  # stored in every checkpoint, checked on resume
    start, latest = 0, None
    remote = settings.checkpoint.remote_dir
    if resume and remote:  # a run that lost its local disk resumes from the object store
        storage.restore_run(remote, ckpt_root, info)
    if resume:
        # A node whose disk lacks the chosen step dir (no shared volume) fetches it from the remote.
        fetch = (lambda name: storage.download_step_dir(remote, name, ckpt_root)) if remote else None
        latest = ckpt.resume_checkpoint(ckpt_root, info, fetch)
        if latest is None:
            _print(info, f"--resume: no checkpoint under {ckpt_root} yet; starting from step 0")
    if latest is not None:
        start = ckpt.load_checkpoint(latest, model, optimizer, scheduler, info, fingerprint)["step"]
        _print(info, f"resumed from {latest} at step {start}")
    log.truncate_after(start)
    # MLflow on rank 0 when the launcher passed a run id; closed below, or at exit after a failure.
    live = build_live_logger(settings, info.is_main)

    # 3) loop
    result = TrainResult(run_dir=run_dir, final_step=start, checkpoint_dir=latest)
    if latest is not None and export_dir(latest).is_dir():  # a finished run resumed: nothing left to do
        result.consolidated_dir = export_dir(latest)
    autocast = compute_context(settings, info)
    fail_at = int(os.environ.get(FAIL_AT_STEP_ENV, 0))
    fail_rank = os.environ.get(FAIL_RANK_ENV)
    tick = time.perf_counter()
    skips = 0
    # Rank 0: a live bar on a terminal, else (torchrun under the launcher, CI) a line every log_every steps.
    bar = Progress("train", t.max_steps, unit="steps", every=t.log_every, start=start, enabled=info.is_main)
    for step in range(start, t.max_steps):
        record = train_step(model, strategy, batches, step, settings, info, autocast)
        record["grad_norm"] = _clip(model, t.max_grad_norm)
        record["lr"] = optimizer.param_groups[0]["lr"]
        # Every rank sees the same global loss and norm, so every rank decides the same way.
        if check_finite(record, step + 1, skips, settings):
            skips += 1
            record["skipped"] = True
            _print(
                info,
                f"step {step + 1}: non-finite loss/grad_norm, update skipped ({skips}/{t.max_nonfinite_skips})",
            )
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        now = time.perf_counter()
        dt, tick = now - tick, now
        done = step + 1
        record.update(step=done, epoch=done * t.global_batch_size / len(dataset), mode=settings.dllm.mode)
        record["mem"] = memory_gib(info.device)
        record["tps"] = record["tokens_per_step"] / dt
        if t.peak_tflops:
            flops = 6.0 * num_params * record["tokens_per_step"]
            record["mfu"] = 100.0 * flops / 1e12 / (info.world_size * dt) / t.peak_tflops
        result.losses.append(record["loss"])
        log.write(record)
        bar.advance(line=console_line(record, t.max_steps), loss=record["loss"], tok_s=record["tps"])
        if live is not None:
            live.log(record, done)

        # 4) checkpoint (the final step always saves, with the consolidated export)
        last = done == t.max_steps
        if done % settings.checkpoint.every_steps == 0 or last:
            mode = settings.checkpoint.save_consolidated
            export = None
            if mode == "every" or (mode == "final" and last):
                export = _exporter(model, strategy, tokenizer, run_dir, info)
            result.checkpoint_dir = ckpt.save_checkpoint(
                ckpt_root,
                done,
                model,
                optimizer,
                scheduler,
                info,
                settings.checkpoint.keep_last,
                extra_state={"samples_seen": done * t.global_batch_size, "settings_fingerprint": fingerprint},
                export=export,
            )
            if remote:
                storage.mirror_checkpoint(remote, ckpt_root, done, info, settings.checkpoint.keep_last)
            if export is not None:
                result.consolidated_dir = export_dir(result.checkpoint_dir)
        result.final_step = done
        if fail_at == done and fail_rank in (None, "", str(info.rank)):
            raise RuntimeError(f"injected failure after step {done} ({FAIL_AT_STEP_ENV}={fail_at})")
    bar.close()
    if live is not None:
        live.close()
    return result


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


def train_step(model, strategy, batches, step: int, settings, info: DistInfo, autocast) -> dict[str, Any]:
    """Forward/backward of every micro-batch of one step; returns globally reduced metrics."""
    from dllmflow.diffusion.seeding import sample_seed

    # 1) collate + corrupt everything first, so the denominators are known before any backward
    micro = []
    for mb in batches.step(step):
        positions = mb.pop("global_index").tolist()
        mb = {k: v.to(info.device) for k, v in mb.items()}
        mb.update(strategy.corrupt(mb, [sample_seed(settings.train.seed, step, p) for p in positions]))
        micro.append(mb)

    # 2) global counts per loss term (+ tokens and supervised tokens for the metrics)
    local = defaultdict(float)
    for mb in micro:
        for k, v in strategy.token_counts(mb).items():
            local[k] += float(v)
        local["__tokens"] += mb["input_ids"].numel()
        local["__supervised"] += float(mb["loss_mask"].sum())
    counts = _reduce(local, info)

    # 3) forward/backward with global denominators; gradients sync on the last micro-batch only
    loss_sums = {"loss": 0.0, "dllm_loss": 0.0}
    metric_sums: dict[str, float] = defaultdict(float)
    for j, mb in enumerate(micro):
        with grad_sync(model, enabled=j == len(micro) - 1):
            with autocast:
                out = strategy.loss(model, mb)
                terms = {k: out.weight(k) * s / max(counts[k], 1.0) for k, s in out.sums.items()}
                total = sum(terms.values())
            (total * info.world_size).backward()
        loss_sums["loss"] += float(total.detach())
        loss_sums["dllm_loss"] += float(sum(terms[k].detach() for k in out.dllm_terms if k in terms))
        for k, v in out.metric_sums.items():
            metric_sums[k] += float(v)

    # 4) global metrics
    record: dict[str, Any] = _reduce(loss_sums, info)
    if metric_sums:
        record.update(strategy.finalize_metrics(_reduce(metric_sums, info)))
    record["tokens_per_step"] = int(counts["__tokens"])
    record["supervised_tokens"] = int(counts["__supervised"])
    return record


def _reduce(values: dict[str, float], info: DistInfo) -> dict[str, float]:
    """SUM over ranks of a dict of scalars, in one collective (on the device: NCCL needs CUDA tensors)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=info.device)
    return dict(zip(keys, all_reduce_sum(t).tolist()))


def _clip(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
        norm = norm.full_tensor()
    return float(norm)


def _exporter(model, strategy, tokenizer, run_dir: Path, info: DistInfo):
    """Collective export of the consolidated HF dir into `<model_dir>/consolidated` (rank 0 writes)."""
    import shutil

    def export(model_dir: Path) -> None:
        state = ckpt.full_state_dict(model)
        if info.is_main:
            out = model_dir / CONSOLIDATED
            out.mkdir(parents=True, exist_ok=True)
            export_with_lora(strategy.export, unwrap(model), state, tokenizer, out, strategy.settings)
            settings_json = RunLayout(run_dir).settings_json
            shutil.copy2(settings_json, out / settings_json.name)

    return export


def _print(info: DistInfo, msg: str) -> None:
    if info.is_main:
        print(msg, flush=True)
