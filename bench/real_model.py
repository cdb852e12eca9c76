"""A2D on a real model, end to end: prepare, train, then evaluate the AR base, the converted model before
fine-tuning and the fine-tuned one on the same held-out problems. Opt-in (minutes to hours on CPU; pytest
does not collect bench/).

    OMP_NUM_THREADS=2 python bench/real_model.py --recipe params/smollm2_idlm.yaml --minutes 30
    python bench/real_model.py --recipe params/smollm2_mdlm.yaml --max-steps 40 --eval-limit 32
    python bench/real_model.py --recipe params/smollm2_idlm.yaml --skip-train --run-dir /tmp/bench-real-model-XXXX

Steps: `prepare` (into the bench's dir, `--run-dir` or a new temp dir; reused when unchanged); training through torchx as
`dllmflow train` runs it, capped at `--minutes` of training: without `--max-steps`, a 3-step
calibration run measures s/step first and max_steps becomes min(the recipe's, what fits); then the
`ar` evaluation (evaluation/ar_baseline.py: the base causal LM, greedy), the converted model before
fine-tuning (`workflow.finetune.untrained_baseline`) and the fine-tuned export, each with the recipe's
first sampler and eval section. Prints:

    model                         EM (flex)  EM (strict)  tok/s  NFE
    AR base (greedy)              ...
    converted, before fine-tune   ...
    fine-tuned (N steps)          ...

and the training figures beside the planner's prediction (`dllmflow plan`): s/step and tokens/s
(median over logged steps after the first; tokens = supervised + context tokens the trainer counts),
peak RSS (the trainer's `mem`) against the planned peak per rank. `--output FILE` writes all of it
as JSON. The goal (issue 22): fine-tuned EM >= AR EM within 30 minutes of training on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CALIBRATION_STEPS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--recipe", default="params/smollm2_idlm.yaml", help="a SmolLM2 A2D recipe (params/smollm2_*.yaml)"
    )
    p.add_argument("--minutes", type=float, default=30.0, help="training wall-time cap (calibrated s/step)")
    p.add_argument("--max-steps", type=int, help="train exactly this many steps (no calibration)")
    p.add_argument("--eval-limit", type=int, help="held-out problems (default: the recipe's eval.limit)")
    p.add_argument(
        "--run-dir", help="its dir (prepared rows, runs, baselines); default: a new temp dir, kept"
    )
    p.add_argument("--skip-train", action="store_true", help="evaluate the run dir's existing export")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="evaluate the AR base and the converted model in a second process while training runs (less "
        "wall time; the training's s/step then shares the CPU with it: its CPU s/step is still comparable)",
    )
    p.add_argument("--baselines-only", action="store_true", help="evaluate only AR and converted; --output")
    p.add_argument(
        "--baselines",
        help="JSON of a --baselines-only run (or --output) of a recipe with the same model, data and eval",
    )
    p.add_argument("--output", help="write the table and training figures as JSON")
    return p.parse_args(argv)


def train_figures(run_dir: Path) -> dict:
    """s/step, tokens/s and peak RSS from the run's metrics.jsonl (first logged step dropped: warm-up)."""
    from dllmflow.runs import read_metrics

    rows = [r for r in read_metrics(str(run_dir)) if "tps" in r]
    timed = rows[1:] or rows
    if not timed:
        return {}
    s_step = [r["tokens_per_step"] / r["tps"] for r in timed]
    return {
        "steps": rows[-1]["step"],
        "s_per_step": statistics.median(s_step),
        "tokens_per_s": statistics.median(r["tps"] for r in timed),
        "tokens_per_step": timed[-1]["tokens_per_step"],
        "peak_rss_gib": max(r.get("mem", 0.0) for r in rows),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
    }


def calibrate(recipe: str, overrides: dict, run_dir: Path) -> float:
    """s/step of the recipe on this machine now: a short run in its own dir (median after step 1)."""
    from dllmflow.settings import load_settings
    from dllmflow.workflow import finetune

    cal = load_settings(recipe, **overrides, train={"max_steps": CALIBRATION_STEPS, "log_every": 1,
                        "warmup_steps": 1}, checkpoint={"every_steps": CALIBRATION_STEPS})  # fmt: skip
    finetune.train(cal, str(run_dir / "calibration"))
    return train_figures(run_dir / "calibration")["s_per_step"]


def write_output(out: dict, path: str | None) -> int:
    """`--output FILE`: everything measured, as JSON; the bench's exit status."""
    if path:
        Path(path).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {path}")
    return 0


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def baseline_key(s) -> str:
    """What the AR and converted-model evaluations depend on: equal for a recipe and its LoRA variant (the
    adapters start as the identity), so one --baselines-only run serves both; training-only settings
    (mdlm's attention annealing) do not enter it."""
    d = s.model_dump(mode="json")
    d["dllm"].pop("attention_annealing_steps", None)
    d["dataset"].pop("prepared_dir", None)  # where the rows are stored is not what they are
    return json.dumps({k: d[k] for k in ("model", "tokenizer", "dataset", "dllm", "eval")}, sort_keys=True)


def row(label: str, metrics: dict) -> dict:
    return {"model": label, **{k: metrics.get(k) for k in ("exact_match_flexible", "exact_match_strict",
                                                          "tokens_per_s", "nfe", "num_examples")}}  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<44}{'EM (flex)':>10}{'EM (strict)':>12}{'tok/s':>9}{'NFE':>7}{'n':>5}")
    for r in rows:
        print(f"{r['model']:<44}{r['exact_match_flexible']:>10.3f}{r['exact_match_strict']:>12.3f}"
              f"{r['tokens_per_s']:>9.1f}{r['nfe']:>7.1f}{r['num_examples']:>5}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from dllmflow import runs
    from dllmflow.data.prepare import prepare
    from dllmflow.evaluation.accuracy import evaluate
    from dllmflow.evaluation.ar_baseline import evaluate_ar
    from dllmflow.settings import load_settings
    from dllmflow.training.planner import plan_memory
    from dllmflow.workflow import finetune

    args = parse_args(argv)
    # Everything it writes (the prepared rows too) goes under its own dir: a new temp dir unless --run-dir.
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="bench-real-model-"))
    overrides: dict = {"dataset": {"prepared_dir": str(run_dir / "prepared")}}
    if args.eval_limit:
        overrides["eval"] = {"limit": args.eval_limit}
    s = load_settings(args.recipe, **overrides)
    print(f"bench dir {run_dir} (kept: rerun with --skip-train --run-dir {run_dir})", flush=True)
    sampler = finetune.eval_samplers(s)[0]
    out: dict = {
        "recipe": args.recipe,
        "sampler": sampler,
        "eval_limit": s.eval.limit,
        "key": baseline_key(s),
    }

    # Imported before the planner runs: `offline_skeletons` patches `from_pretrained` while it plans, and an
    # auto class first imported inside it copies the patched method for good (planner.py, reported).
    from transformers import AutoModelForCausalLM  # noqa: F401

    plan = plan_memory(s)
    out["plan"] = {"peak_gib": plan.peak / 2**30, "params": plan.params, "trainable": plan.trainable}
    print(plan.table(), flush=True)

    t0 = time.perf_counter()
    manifest = prepare(s)  # reused when its input fingerprint is unchanged (no DVC: a bench needs none)
    out["prepare_s"] = time.perf_counter() - t0
    print(
        f"prepared {s.dataset.prepared_dir} ({manifest['content_hash']}) in {out['prepare_s']:.0f} s",
        flush=True,
    )
    base = s

    def baselines() -> tuple[dict, dict]:
        if args.baselines or pending is not None:
            if pending is not None and pending.wait() != 0:
                raise SystemExit(f"the baselines process failed (exit {pending.returncode})")
            got = json.loads(Path(args.baselines or baselines_file).read_text())
            if got.get("key") != baseline_key(base):
                raise SystemExit(
                    f"{args.baselines}: measured for {got['recipe']} (limit {got['eval_limit']}), whose model, "
                    "tokenizer, data, mode or eval settings differ from this recipe's"
                )
            return got["ar"], got["before"]
        ar = evaluate_ar(base, limit=base.eval.limit)
        with_before = load_settings(
            args.recipe, **{**overrides, "eval": {**overrides.get("eval", {}), "untrained_baseline": True}}
        )
        return ar, finetune.untrained_baseline(with_before, sampler)

    pending, baselines_file = None, run_dir / "baselines.json"
    if args.baselines_only:
        ar, before = baselines()
        Path(args.output or baselines_file).write_text(
            json.dumps({**out, "ar": ar, "before": before}, default=str)
        )
        print(f"AR {ar['metrics']}\nbefore {before['metrics']}")
        return 0
    if args.overlap:  # a second process: torch threads of two evaluations in one process would contend
        cmd = [
            sys.executable,
            __file__,
            "--recipe",
            args.recipe,
            "--baselines-only",
            "--run-dir",
            str(run_dir),
            "--output",
            str(baselines_file),
        ]
        cmd += ["--eval-limit", str(base.eval.limit)]
        run_dir.mkdir(parents=True, exist_ok=True)
        pending = subprocess.Popen(cmd, stdout=open(run_dir / "baselines.log", "w"), stderr=subprocess.STDOUT)
    train_dir = run_dir / "train"
    if not args.skip_train:
        steps = args.max_steps
        if steps is None:
            s_step = calibrate(args.recipe, overrides, run_dir)
            steps = max(1, min(s.train.max_steps, int(args.minutes * 60 / s_step)))
            out["calibration_s_per_step"] = s_step
            print(f"calibration: {s_step:.1f} s/step -> {steps} steps in {args.minutes:g} min", flush=True)
        s = load_settings(args.recipe, **overrides, train={"max_steps": steps, "warmup_steps": min(
            s.train.warmup_steps, max(1, steps // 10))}, checkpoint={"every_steps": steps})  # fmt: skip
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        finetune.train(s, str(train_dir))
        out["train_wall_s"] = time.perf_counter() - t0  # torchx launch + model load + steps + export
        # CPU seconds of the training processes (waited-for descendants): on a shared machine, CPU / 2
        # bounds what 2 quiet cores would take (wall >= CPU / cores)
        out["train_cpu_s"] = _children_cpu_s() - cpu0
    out["train"] = train_figures(train_dir)

    ar, before = baselines()
    out["overlapped"] = pending is not None
    rows = [row("AR base (greedy)", ar["metrics"])]
    rows.append(row(f"converted, before fine-tuning ({sampler})", before["metrics"]))
    after = evaluate(runs.find_consolidated(str(train_dir)), settings=s, sampler=sampler, limit=s.eval.limit)
    rows.append(row(f"fine-tuned, {out['train'].get('steps')} steps ({sampler})", after["metrics"]))
    out["rows"] = rows
    out["ar"], out["before"] = ar, before  # so this output can be a LoRA variant's --baselines
    out["samples"] = {name: [p["prediction"] for p in r["predictions"][:4]]
                      for name, r in (("ar", ar), ("fine-tuned", after))}  # fmt: skip

    print_table(rows)
    t = out["train"]
    if t:
        print(
            f"\ntraining: {t['steps']} steps, {t['s_per_step']:.2f} s/step, {t['tokens_per_s']:.0f} tokens/s "
            f"({t['tokens_per_step']} tokens/step), loss {t['first_loss']:.3f} -> {t['last_loss']:.3f}"
        )
        print(
            f"peak RSS {t['peak_rss_gib']:.2f} GiB  vs  plan {out['plan']['peak_gib']:.2f} GiB per rank "
            f"(ratio {t['peak_rss_gib'] / out['plan']['peak_gib']:.2f})"
        )
        if "train_wall_s" in out:
            print(f"training wall time {out['train_wall_s'] / 60:.1f} min (launch, load, steps, export); "
                  f"CPU {out['train_cpu_s'] / 60:.1f} min = {out['train_cpu_s'] / t['steps']:.1f} CPU s/step: "
                  f"on 2 quiet cores >= {out['train_cpu_s'] / 2 / t['steps']:.1f} s/step")  # fmt: skip
    gap = rows[2]["exact_match_flexible"] - rows[0]["exact_match_flexible"]
    print(f"goal fine-tuned EM >= AR EM: {'met' if gap >= 0 else 'NOT met'} ({gap:+.3f})")
    return write_output(out, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
