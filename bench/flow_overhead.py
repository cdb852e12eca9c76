"""Wall time of the tiny FinetuneFlow against a bare `dllmflow train` of the same steps, and where the
flow's extra time goes (per step, from the Metaflow client).

    OMP_NUM_THREADS=1 python bench/flow_overhead.py                    # 200 steps, tiny_mdlm
    python bench/flow_overhead.py --steps 50 --recipe params/tiny_mdlm.yaml

Both run in a fresh temp project (its own Metaflow datastore and SQLite MLflow store, so the MLflow
database is created in both). Printed, not asserted:

    ratio = flow wall / bare train wall          (goal <= 1.5)
    ratio without evaluate = (flow wall - evaluate step) / bare train wall
    Metaflow floor = wall of an empty flow of the same graph (same steps, same foreach width, each
                     step doing nothing), run the same way: what Metaflow itself costs per run

The evaluate step is product work, not overhead: the recipe's samplers (tiny_mdlm: llada with the dual
cache and llada2 with its exact KV cache, in parallel) each generating `eval.limit` x
`eval.max_new_tokens` tokens (32 x 128) at each sweep point. The second figure is what the flow adds.

Measured earlier (200 steps, tiny_mdlm, 2 busy CPU cores, each step as a fraction of the bare train):
    ratio 3.30 -> 2.40 (without evaluate 1.59 -> 1.28) once every evaluation stopped running twice (the
    untrained baseline) and registration stopped loading the checkpoint again for MLflow's input example.

Measured 2026-12-01 (200 steps, 2 quiet AMD EPYC cores, OMP_NUM_THREADS=1):
    the flow before/after a step less (register is the join), DVC through its API and the card without
    matplotlib, back to back: 112.3 s -> 103.9 s (prepare 6.6 -> 1.8 s, end 2.4 -> 0.9 s, join 1.0 s gone).
    tiny_mdlm: bare 51.7 s (54.8 before, 48.6 after), flow 105.4 s: ratio 2.04, without evaluate 1.49;
               start 6.3, prepare 2.1, train 49.1, evaluate 28.5, register 7.7, end 0.9 s; Metaflow floor
               4.6 s (0.09).
    tiny_addition: bare 39.2 s, flow 69.3 s: ratio 1.77, without evaluate 1.50; Metaflow floor 3.8 s (0.10).
Measured 2026-12-02 (same machine, quiet): tiny_mdlm before/after its llada evaluates with the dual cache
    in blocks of 32 (eval.cache), back to back: bare 35.8 / 37.7 s, flow 75.7 / 64.4 s: ratio 2.12 -> 1.71,
    evaluate 24.4 -> 10.4 s (without evaluate 1.43 both); after: start 5.5, prepare 1.1, train 30.4,
    evaluate 10.4, register 5.4, end 0.5 s, ~11 s between tasks (each task's process start) and ~5 s
    before `start` (the run's own start; its recipe parse imports torch, 1.4 s, to check eval.cache).
Measured 2026-12-03 (same machine, quiet): before/after the evaluate branches stop logging to MLflow
    (register logs every sampler's result) and start stops re-running the eval samplers' check (the
    Config parse and the train step run it): bare 33.8 / 32.2 s, flow 63.7 / 55.0 s: ratio 1.88 -> 1.71
    (without evaluate 1.56 -> 1.46); start 5.0 -> 2.8 s, evaluate 11.1 -> 8.2 s; Metaflow floor 2.6 s.
    Each task spends ~0.5 s importing Metaflow and the flow module before its step; the end step's
    card is rendered in a subprocess (~1 s).
Measured 2026-12-03, later (same machine; its speed drifted: bare 31-43 s over the hour): 1.91 at the
    start, then, one change at a time, each a run:
    - the sampler configs torch-free (the recipe parse and register's signature stop importing torch;
      `show` 3.5 -> 0.75 s) and register's wheel built in the background: 1.63 (register 8.4 -> 5.3 s,
      the ~7 s before `start` -> ~3 s);
    - `lean_exit` on every step (gc.freeze once it succeeded: the interpreter's final collections had
      cost each torch/MLflow task 0.5-1.2 s before the next could start): 1.69 on a run whose bare
      train ran 33 s (1.56 on the next, bare 36 s); the gaps between tasks 1.2-1.7 s -> 0.1-0.4 s;
    - tiny_mdlm evaluating 16 prompts a batch: 1.47, 1.46 and 1.44 in three runs (bare 31.2 / 38.4 /
      36.0 s, flow 45.8 / 55.9 / 51.9 s; start 2.9 / 3.2 / 3.2, prepare 0.9 / 0.9 / 1.0, train 27.4 /
      31.4 / 31.8, evaluate 8.5 / 11.7 / 8.1, register 3.3 / 4.3 / 4.0, end 0.4 / 0.8 / 0.6 s; Metaflow
      floor 2.9-3.8 s).
What stays is per-process work the bare train does not do: start and register each import mlflow
(~2 s) and open its SQLite store (~1 s); each evaluate branch imports torch and transformers (~4.5 s)
before it generates (~3-4 s); Metaflow renders the end step's card twice, each in a subprocess (~1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The FinetuneFlow graph with empty steps: Metaflow's own process-per-task cost, nothing of ours.
_EMPTY_FLOW = """
from metaflow import FlowSpec, step


class EmptyFinetuneFlow(FlowSpec):
    @step
    def start(self):
        self.next(self.prepare)

    @step
    def prepare(self):
        self.next(self.train)

    @step
    def train(self):
        self.samplers = list(range(WIDTH))
        self.next(self.evaluate, foreach="samplers")

    @step
    def evaluate(self):
        self.next(self.register)

    @step
    def register(self, inputs):
        self.next(self.end)

    @step
    def end(self):
        pass


if __name__ == "__main__":
    EmptyFinetuneFlow()
"""

_STEPS = """
import json
from metaflow import Flow, namespace
namespace(None)
run = Flow("FinetuneFlow").latest_run
out, width = {}, 0
for step in run:
    tasks = list(step)
    out[step.id] = max((t.finished_at - t.created_at).total_seconds() for t in tasks)
    width = len(tasks) if step.id == "evaluate" else width
print("STEPS=" + json.dumps(out))
print("WIDTH=" + str(width))
"""


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="params/tiny_mdlm.yaml")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-flow-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLLMFLOW_", "DLLM_"))}
    env.update(
        USERNAME=env.get("USERNAME", "bench"),
        METAFLOW_DEFAULT_DATASTORE="local",
        METAFLOW_DEFAULT_METADATA="local",
        METAFLOW_DATASTORE_SYSROOT_LOCAL=str(tmp / "metaflow"),
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}",
        DLLMFLOW_RUN_DIR=str(tmp / "runs" / "flow"),
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
    )
    recipe = str(ROOT / args.recipe)
    # Data prep first, so neither side pays for it.
    timed([sys.executable, "-m", "dllmflow.cli", "prepare", "--params", recipe], env, ROOT)

    def bare_train(i: int) -> float:  # each in a fresh run dir and MLflow store, as the flow's
        bare_env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / f'bare{i}.db'}"}
        cmd = [sys.executable, "-m", "dllmflow.cli", "train", "--params", recipe]
        cmd += ["--set", f"train.max_steps={args.steps}", "--run-dir", str(tmp / "runs" / f"bare{i}")]
        return timed(cmd, bare_env, ROOT)

    # The bare train brackets the flow (before and after, mean): a 2-core machine's speed drifts by
    # 10-15% between runs minutes apart, which one bare run would put in the ratio.
    bare_runs = [bare_train(0)]
    flow_cmd = [
        sys.executable,
        "flows/finetune.py",
        "--config",
        "recipe",
        recipe,
        "run",
        "--max-steps",
        str(args.steps),
    ]
    flow = timed(flow_cmd, env, ROOT)
    bare_runs.append(bare_train(1))
    bare = sum(bare_runs) / len(bare_runs)

    proc = subprocess.run([sys.executable, "-c", _STEPS], cwd=ROOT, env=env, capture_output=True, text=True)
    steps = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("STEPS="))[6:])
    width = int(next(x for x in proc.stdout.splitlines() if x.startswith("WIDTH="))[6:])
    empty = tmp / "empty_flow.py"
    empty.write_text(_EMPTY_FLOW.replace("WIDTH", str(width)))
    floor = timed([sys.executable, str(empty), "run"], env, tmp)

    print(
        f"bare `dllmflow train` {args.steps} steps: {bare:.1f} s (before the flow {bare_runs[0]:.1f} s, after {bare_runs[1]:.1f} s)"
    )
    print(
        f"flow {args.steps} steps: {flow:.1f} s   per step: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in steps.items())
    )
    print(f"ratio (flow / bare train): {flow / bare:.2f}   (goal <= 1.5)")
    evaluate = steps.get("evaluate", 0.0)  # the longest branch: the samplers run in parallel
    print(f"ratio without evaluate ((flow - evaluate) / bare train): {(flow - evaluate) / bare:.2f}")
    print(
        f"Metaflow floor (the same graph, {width} evaluate branches, empty steps): {floor:.1f} s = "
        f"{floor / bare:.2f} of bare train; ratio without it ((flow - floor) / bare train): "
        f"{(flow - floor) / bare:.2f}"
    )


if __name__ == "__main__":
    main()
