"""Training metrics: one JSON object per step in `RUN/metrics.jsonl` (rank 0) and a console line.

Each line is written with a single `os.write` on an O_APPEND descriptor, so a reader (the flow, a
tail -f) never sees half a record. On resume the log is cut back to the checkpoint's step so it
reads as one uninterrupted run.

    log = MetricsLog(RunLayout(run_dir).metrics_jsonl, enabled=rank == 0)   # dllmflow.runs
    rows = read_metrics(run_dir)                                            # dllmflow.runs
    log.write({"step": 1, "loss": 2.3, ...}); print(console_line(record))
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from dllmflow.common.files import atomic_write_text

CONSOLE_KEYS = ("loss", "reward_mean", "dllm_loss", "grad_norm", "lr", "mem", "tps", "mfu")


class MetricsLog:
    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = (json.dumps(_jsonable(record), sort_keys=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def truncate_after(self, step: int) -> None:
        """Drop records with `step` > step (a resumed run rewrites them), atomically."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        atomic_write_text(self.path, "".join(kept))


def console_line(record: dict[str, Any], max_steps: int | None = None) -> str:
    step = f"step {record['step']}" + (f"/{max_steps}" if max_steps else "")
    parts = [step, f"epoch {record.get('epoch', 0):.2f}"]
    for key in CONSOLE_KEYS:
        value = record.get(key)
        if value is None:
            continue
        if key == "lr":
            parts.append(f"lr {value:.3e}")
        elif key == "mem":
            parts.append(f"mem {value:.2f} GiB")
        elif key == "tps":
            parts.append(f"tps {value:,.0f}")
        else:
            parts.append(f"{key} {value:.4f}")
    parts.append(str(record.get("mode", "")))
    return " | ".join(parts)


def memory_gib(device: torch.device) -> float:
    """Peak CUDA memory since the last call (then reset), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf  # drop torn or foreign lines


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None if math.isnan(v) else str(v)
        out[k] = v
    return out
