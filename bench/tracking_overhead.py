"""Cost of live MLflow tracking per training step: the tiny recipe trained in-process with and without
rank 0's live logger (training/live.py) pointed at a local SQLite store.

    OMP_NUM_THREADS=1 python bench/tracking_overhead.py                 # 60 steps, 3 rounds
    python bench/tracking_overhead.py --steps 200 --rounds 5 --recipe params/tiny_mdlm.yaml

Rounds alternate (off, on, off, on, ...) so machine-load drift hits both alike. A step's time is the
trainer's own per-step duration (tokens_per_step / tps in metrics.jsonl), the first step of each round
dropped (warm-up); the median over all rounds is reported. Also times `LiveLogger.log` alone (all the
training thread pays per step; sending happens on the logger's thread). Printed, not asserted:

    ratio = median step with tracking / median step without      (goal: < 1.02)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from dllmflow.settings import load_settings
from dllmflow.training import live as live_tracking


def step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_step"] / r["tps"] for r in rows[1:]]  # the first step compiles/warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="params/tiny_mdlm.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from dllmflow.data.prepare import prepare
    from dllmflow.training.trainer import run_training

    tmp = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    settings = load_settings(
        args.recipe,
        dataset={"prepared_dir": str(tmp / "prepared"), "limit": 64},
        train={"max_steps": args.steps, "log_every": 10**6},
        checkpoint={"every_steps": 10**6, "save_consolidated": "false"},
        registry={"tracking_uri": uri},  # default flush_every_s
    )
    prepare(settings)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            os.environ.pop(live_tracking.RUN_ID_ENV, None)
            if mode == "on":
                os.environ[live_tracking.RUN_ID_ENV] = live_tracking.create_run(settings)
            run_dir = tmp / f"{mode}{r}"
            run_training(settings, run_dir)
            times[mode] += step_times(run_dir)
    os.environ.pop(live_tracking.RUN_ID_ENV, None)

    class Null:
        def log_batch(self, *a, **k):
            pass

    live = live_tracking.LiveLogger(Null(), "x", flush_every_s=1.0)
    record = json.loads((tmp / "on0" / "metrics.jsonl").read_text().splitlines()[-1])
    t0 = time.perf_counter()
    for i in range(2000):
        live.log(record, i)
    per_log = (time.perf_counter() - t0) / 2000
    live.close()

    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"median step without tracking: {off * 1e3:.2f} ms   with: {on * 1e3:.2f} ms")
    print(
        f"LiveLogger.log on the training thread: {per_log * 1e6:.1f} us/step ({100 * per_log / off:.2f}% of a step)"
    )
    print(f"ratio (tracking / none): {on / off:.3f}   (goal < 1.02)")


if __name__ == "__main__":
    main()
