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

The evaluate step is product work, not overhead: the recipe's samplers (tiny_mdlm: llada and llada2,
in parallel) each generating `eval.limit` x `eval.max_new_tokens` tokens (32 x 128), which on a busy
2-core machine costs about as much as the 200 training steps. The second figure is what the flow adds.

Measured (200 steps, tiny_mdlm, 2 busy CPU cores; before and after back to back, each step as a
fraction of the bare train wall):
    before: ratio 3.30, without evaluate 1.59 (evaluate 1.71, register 0.27): every evaluation ran
            twice (the untrained baseline), and registration loaded the checkpoint again to predict
            MLflow's input example.
    after:  ratio 2.40, without evaluate 1.28 (evaluate 1.12, register 0.14, train step 0.79,
            start + prepare + join + end 0.17).
    quiet 2 cores (load < 1, after): bare 43.3 s, flow 85.9 s: ratio 1.98, without evaluate 1.46
            (evaluate 0.52, train step 0.83, start + prepare 0.23, register 0.14, join + end 0.06, and
            ~0.2 of Metaflow's own scheduling between steps).
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
out = {}
for step in run:
    tasks = list(step)
    out[step.id] = max((t.finished_at - t.created_at).total_seconds() for t in tasks)
print("STEPS=" + json.dumps(out))
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

    bare_env = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'bare.db'}"}
    bare_cmd = [sys.executable, "-m", "dllmflow.cli", "train", "--params", recipe]
    bare = timed(
        bare_cmd + ["--set", f"train.max_steps={args.steps}", "--run-dir", str(tmp / "runs" / "bare")],
        bare_env,
        ROOT,
    )
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

    proc = subprocess.run([sys.executable, "-c", _STEPS], cwd=ROOT, env=env, capture_output=True, text=True)
    steps = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("STEPS="))[6:])
    width = _foreach_width(env)
    empty = tmp / "empty_flow.py"
    empty.write_text(_EMPTY_FLOW.replace("WIDTH", str(width)))
    floor = timed([sys.executable, str(empty), "run"], env, tmp)

    print(f"bare `dllmflow train` {args.steps} steps: {bare:.1f} s")
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


def _foreach_width(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", _WIDTH], cwd=ROOT, env=env, capture_output=True, text=True)
    return int(next(x for x in proc.stdout.splitlines() if x.startswith("WIDTH="))[6:])


_WIDTH = """
from metaflow import Flow, namespace
namespace(None)
print("WIDTH=" + str(len(list(Flow("FinetuneFlow").latest_run["evaluate"]))))
"""


if __name__ == "__main__":
    main()
