"""Does GRPO add held-out exact match beyond what the same wall time of supervised steps adds, when labels
are scarce and verifiable prompts are plentiful (the RLVR setting)? Issue #25's proof, repeated by issue
39 from three SFT starts beside a labelled control: on the bundled addition task, a tiny model
supervised to its plateau on a SMALL labeled subset (held-out EM 0.2-0.6), then GRPO for 15 minutes on
2 CPU cores (target: median gain >= 0.15 absolute), beside SFT for the same wall time on the SAME
prompts GRPO draws from with their verifiable answers as labels (`--control labelled`, the default; the
earlier control, `--control subset`, continued on the start's own rows only and overfits them).

    OMP_NUM_THREADS=1 python bench/grpo_addition.py                     # defaults: --rows 140, 15 min per arm
    python bench/grpo_addition.py --rows 160 --minutes 5 --keep --set rl.kl_beta=0.0
    python bench/grpo_addition.py --reuse /tmp/bench-grpo-XXXX --skip-sft-only --minutes 5   # same SFT start
    # issue 39's three starts: make each start, then per start both arms side by side (one core each)
    python bench/grpo_addition.py --rows 140 --seed 1 --workdir /tmp/g/s140_1 --start-only
    python bench/grpo_addition.py --reuse /tmp/g/s140_1 --rows 140 --seed 1 --skip-sft-only &
    python bench/grpo_addition.py --reuse /tmp/g/s140_1 --rows 140 --seed 1 --skip-grpo; wait

Everything under one temp dir it creates (removed unless --keep), in-process on one rank, the real runtime:
  1) prepare params/tiny_addition.yaml twice: the FULL pool (embedded:addition, its train/eval splits) and
     a labeled SUBSET (`dataset.limit: --rows`, the full pool's tokenizer). Checked: every subset row is a
     train row of the full pool, none is held out.
  2) SFT on the subset for --sft-steps (the recipe's cosine schedule cut to those steps): its plateau.
  3) arm a: GRPOTrainer (params/tiny_addition_grpo.yaml + --set) from the SFT export, prompts from the
     FULL train pool; the rewards verify the answer, no demonstration is used. --minutes of wall time.
  4) arm b: the Trainer continues SFT from the same export at the SFT's final LR (constant) for
     --minutes, on the FULL train pool (labelled: GRPO's prompts, their answers as labels) or on the
     start's subset (--control subset).
  5) held-out EM (llada greedy, flexible, the first --limit problems of the full pool's eval split, as
     `dllmflow evaluate`) of the SFT export and of each arm's weights when its time ran out.
Printed, not asserted (times depend on the machine's load):

    rows seed | EM sft (steps) | +grpo (steps, min) | +sft <control> (steps, min) | gain grpo | gain sft

Issue 39's goal, measured 2026-12-04 with this file on a quiet machine (defaults: 1,500 SFT steps, 15
min per arm, 512 held-out problems; each start made with --start-only, then its two arms side by side as
two processes with OMP_NUM_THREADS=1, so each arm had ONE of the 2 cores; load average 1.2-2.0, nothing
else running; the driver is the three-line recipe at the top):
    rows seed | EM sft | +grpo (steps)   | +sft labelled (steps) | gain grpo | gain sft labelled
    138  42   | 0.396  | 0.609 (2,333)   | 0.998 (21,271)        | +0.213    | +0.602
    140  1    | 0.516  | 0.695 (2,337)   | 0.994 (20,472)        | +0.180    | +0.479
    140  42   | 0.561  | 0.760 (2,398)   | 1.000 (21,758)        | +0.199    | +0.439
Median gain: GRPO +0.199 (goal >= +0.15: met on every start), labelled SFT +0.479. RL does NOT beat the
labelled control: supervised steps on the same prompts with their verifiable answers as labels gain
2.2-2.8x more held-out EM in the same wall time, on every start (a step is ~9x cheaper: 21k vs 2.3k
steps, and each carries the answer instead of a reward over 8 sampled ones). On this task the
verifier's answer is itself a label; GRPO is the tool when prompts can be checked but not labelled.
The same three starts on cores shared with ~6 other sessions (load average 14-18, each arm ~1.7
CPU-minutes of its 15 wall minutes, ~210 GRPO / ~2,000 SFT steps) gained +0.037..+0.051 and
+0.43..+0.54: the gain is a function of steps, and only the step count depends on the machine.

Why a labeled subset (measured 2026-12-02, 2 shared CPU cores): with the full train split (~6,000 rows)
SFT is the stronger use of a second, because the task's own labels are its verifiable answers: from a
mid-run checkpoint of the 1,200-step recipe (EM 0.334) GRPO gained +0.16..+0.30 in 5 min, SFT-only on
the same rows reached 0.62 (and 1.00 in 10 min). Held-out EM of SFT to its plateau by labeled rows
(1,600-2,000 steps, 256 held-out problems): 128 rows 0.06, 192 rows 0.83, 256 rows 1.00, 512 rows 0.97;
the curve is flat between the last two checkpoints of each run (more steps on the same rows add nothing).

GRPO settings tried before (the earlier probe, plain loop, same start EM 0.334, 5 min): one_step lr 3e-4
kl_beta 0.01 T 1.0 G 8 x 8 prompts: +0.16 (112 steps) and +0.30 (885 steps, quiet machine); coupled
eps 1e-3: +0.17, but at 10 min its 1/t weights gave KL spikes 6-12 and a collapse to zero reward; coupled
eps 0.2: +0.16 with a step KL of 342; lr 1e-3: reward 0.19 -> 0.05 (collapse); T 0.7: +0.10. Hence
one_step, lr 3e-4, kl_beta 0.01, T 1.0 and `rl.kl_log_ratio_clip` (docs/strategies.md §8.2).

Measured 2026-12-02 with this file (--minutes 5 per arm, --sft-steps 1500, 512 held-out problems, recipe
as committed; 2 CPU cores shared with a CI run and 2-3 such benches at once, load average 3-9, so the
step counts are pessimistic). The SFT plateau is a knife edge in the labeled rows (the first N train
rows): 128 -> 0.06, 136 -> 0.18, 140 -> 0.53, 144 -> 0.74, 160 -> 0.67, 192 -> 0.83, 256 -> 1.00.
    rows | EM sft | +grpo (steps, min)   | +sft-only (steps, min) | gain grpo | gain sft-only
    160  | 0.668  | 0.859 (981, 5.0)     | 0.551 (4,767, 5.0)     | +0.191    | -0.117
    140  | 0.529  | 0.594 (571, 5.0)     | 0.361 (7,351, 5.0)     | +0.064    | -0.168
    136  | 0.184  | 0.277 (622, 5.0)     | 0.156 (6,261, 5.0)     | +0.094    | -0.027
    140  | 0.529  | 0.639 (3,216, 12.0)  | 0.217 (22,901, 12.0)   | +0.109    | -0.312   (two processes, load 1-2)
    140  | 0.529  | 0.682 (3,010, 15.0)  | 0.221 (23,735, 15.0)   | +0.152    | -0.309   (two processes, load 2)
The last row is the goal's measurement (--reuse of one SFT start, the arms as two processes side by side,
one core each, quiet machine otherwise): +0.152 in 15 minutes from 0.529, the goal (+0.15) met by 0.002.
The in-run held-out EM (64 problems, every 25 steps) swings by about +-0.07 between evaluations, so where
a run is stopped moves the end figure by about that much; the run is seeded (a 5-minute run from the same
start retraced it step for step) and only the step count depends on the machine's speed.
SFT-only on the same rows does not help (it overfits them); GRPO on the full pool's prompts does. The
goal (+0.15 from a start in 0.2-0.6) is met only from 160 rows (start 0.668, just above the range); from
140 and 136 rows GRPO gained +0.06/+0.09 in 5 minutes (the SFT-only arms of those two ran on a quieter
machine, load 2-3, so they got more steps than the GRPO arms). The
in-run held-out EM (64 problems) still rose at the 5-minute mark; step KL spikes reached 79 (grad norm
373) in 5 minutes and 314 in 12 (kl_log_ratio_clip 10 bounds each token's gradient at ~2.2e4 beta, too
loose to remove them; the 1.0 grad-norm clip kept the run from collapsing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from dllmflow.settings import load_settings, parse_overrides
from dllmflow.training.trainer import TrainerHook

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "params" / "tiny_addition.yaml"
GRPO = ROOT / "params" / "tiny_addition_grpo.yaml"
BIG = 10**6


class TimeUp(Exception):
    pass


class StopAfter(TrainerHook):
    """Ends a run after `seconds` of wall time (the step that crosses it finishes), saving the policy's
    weights to `out_dir` first, so the arm is scored exactly where its time ran out."""

    def __init__(self, seconds: float, out_dir: Path):
        self.seconds, self.out_dir = seconds, out_dir
        self.t0 = time.perf_counter()
        self.steps, self.elapsed = 0, 0.0

    def after_step(self, trainer, step: int) -> None:
        from dllmflow.models.wrappers import unwrap

        self.steps, self.elapsed = step, time.perf_counter() - self.t0
        if self.elapsed > self.seconds:
            unwrap(trainer.model).save_pretrained(self.out_dir)
            trainer.tokenizer.save_pretrained(self.out_dir)
            raise TimeUp


def timed_arm(make_trainer, seconds: float, out_dir: Path) -> StopAfter:
    hook = StopAfter(seconds, out_dir)
    try:
        make_trainer([hook]).run()
    except TimeUp:
        pass
    return hook


def held_out_em(weights: Path, full, limit: int) -> float:
    """Greedy llada exact match (flexible) on the full pool's eval split, as `dllmflow evaluate`."""
    from dllmflow.evaluation.accuracy import evaluate_loaded
    from dllmflow.evaluation.protocol import EvalRunner, build_runner
    from dllmflow.inference.generate import load_for_generation
    from dllmflow.inference.resolved import resolve

    model, tok, _ = load_for_generation(weights, device="cpu")
    model.eval()
    runner = build_runner(model, tok, full, "llada", None)
    loaded = EvalRunner(model, tok, runner, full, "llada", checkpoint=resolve(weights))
    return evaluate_loaded(loaded, limit=limit)["metrics"]["exact_match_flexible"]


def check_subset(full_dir: Path, sub_dir: Path) -> int:
    """Every labeled row is a train row of the full pool and none is a held-out one (by id and chat)."""
    from dllmflow.data.dataset import PreparedDataset

    def keys(d: Path, split: str) -> set[str]:
        return {r["id"] + json.dumps(r["messages"]) for r in PreparedDataset(d, split).rows(None)}

    sub, train, held = keys(sub_dir, "train"), keys(full_dir, "train"), keys(full_dir, "eval")
    if not sub <= train or sub & held or keys(sub_dir, "eval") != held:
        raise SystemExit("the labeled subset is not a subset of the full pool's train split")
    return len(sub)


def main() -> None:
    from dllmflow.data.prepare import prepare
    from dllmflow.rl.grpo_trainer import GRPOTrainer
    from dllmflow.runs import resolve_checkpoint
    from dllmflow.training.trainer import Trainer
    from dllmflow.workflow.grpo import starting_settings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=140, help="labeled rows for SFT (a subset of the train split)")
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--minutes", type=float, default=15.0, help="wall time of each arm")
    p.add_argument("--limit", type=int, default=512, help="held-out problems scored")
    p.add_argument("--set", action="append", default=[], help="GRPO recipe override, e.g. rl.kl_beta=0.0")
    p.add_argument("--skip-sft-only", action="store_true", help="run only the GRPO arm")
    p.add_argument(
        "--skip-grpo", action="store_true", help="run only the SFT-only arm (two processes: one each)"
    )
    p.add_argument("--seed", type=int, default=42, help="train.seed of the SFT start (its init and batches)")
    p.add_argument(
        "--control",
        choices=("labelled", "subset"),
        default="labelled",
        help="the SFT-only arm's data: labelled = the GRPO arm's prompts (the full train pool) with their "
        "verifiable answers as labels; subset = the SFT start's labeled rows only",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument(
        "--reuse", type=Path, help="a kept dir of an earlier run (--keep): its data and SFT run, not redone"
    )
    p.add_argument("--workdir", type=Path, help="make the SFT start in this (new) dir, kept; then --reuse it")
    p.add_argument("--start-only", action="store_true", help="prepare, SFT and score the start; no arms")
    args = p.parse_args()
    tmp = args.reuse or args.workdir or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    # this process's arms, in a dir of their own: other processes may run arms from the same start
    arms = Path(tempfile.mkdtemp(prefix="arms-", dir=tmp))
    try:
        # 1) the full pool and the labeled subset (same tokenizer, same held-out split)
        full = load_settings(SFT, dataset={"prepared_dir": str(tmp / "full")})
        if not args.reuse:
            prepare(full)
        sub_data = {"prepared_dir": str(tmp / "sub"), "limit": args.rows}
        sub = load_settings(SFT, dataset=sub_data, tokenizer={"name_or_path": str(tmp / "full" / "tokenizer")},
                            train={"max_steps": args.sft_steps, "log_every": 250, "seed": args.seed},
                            checkpoint={"every_steps": args.sft_steps}, eval={"untrained_baseline": False})  # fmt: skip
        if not args.reuse:
            prepare(sub)
        n = check_subset(tmp / "full", tmp / "sub")

        # 2) SFT on the subset to its plateau
        t0 = time.perf_counter()
        if not args.reuse:
            Trainer(sub, tmp / "sft").run()
        sft_s = time.perf_counter() - t0
        start = resolve_checkpoint(tmp / "sft")
        em_sft = held_out_em(start, full, args.limit)
        print(
            f"SFT on {n} rows, {args.sft_steps} steps ({sft_s / 60:.1f} min): held-out EM {em_sft:.3f}",
            flush=True,
        )
        if args.start_only:
            return

        # 3) GRPO on the full pool's prompts
        grpo = load_settings(GRPO, **parse_overrides(args.set),
                             dataset={"prepared_dir": str(tmp / "full")},
                             train={"max_steps": BIG, "log_every": 10},
                             checkpoint={"every_steps": BIG, "save_consolidated": "false"})  # fmt: skip
        grpo, _ = starting_settings(grpo, str(tmp / "sft"))
        seconds = args.minutes * 60
        em_rl, rl = float("nan"), StopAfter(0, tmp)
        if not args.skip_grpo:
            rl = timed_arm(
                lambda hooks: GRPOTrainer(grpo, arms / "grpo", hooks=hooks), seconds, arms / "grpo_w"
            )
            em_rl = held_out_em(arms / "grpo_w", full, args.limit)
            print(f"GRPO {rl.steps} steps ({rl.elapsed / 60:.1f} min): held-out EM {em_rl:.3f}", flush=True)

        # 4) SFT continued from the same start for the same wall time at the SFT's final LR, on the GRPO
        # arm's prompts with their verifiable answers as labels (labelled) or on the start's rows (subset)
        em_more, more = float("nan"), StopAfter(0, tmp)
        if not args.skip_sft_only:
            t = sub.train
            control_data = sub_data if args.control == "subset" else {"prepared_dir": str(tmp / "full")}
            cont = load_settings(
                SFT,
                model={"pretrained_model_name_or_path": str(start), "tiny": None},
                dataset=control_data,
                tokenizer={"name_or_path": str(tmp / "full" / "tokenizer")},
                train={"max_steps": BIG, "lr": t.lr * t.min_lr_ratio, "lr_schedule": "constant",
                       "warmup_steps": 0, "log_every": 500, "seed": t.seed + 1},
                checkpoint={"every_steps": BIG, "save_consolidated": "false"},
                eval={"untrained_baseline": False},
            )  # fmt: skip
            more = timed_arm(
                lambda hooks: Trainer(cont, arms / "more", hooks=hooks), seconds, arms / "more_w"
            )
            em_more = held_out_em(arms / "more_w", full, args.limit)

        load = os.getloadavg()[0]
        print(
            f"\nrows {n} seed {args.seed} | EM sft {em_sft:.3f} ({args.sft_steps} steps) | +grpo {em_rl:.3f} "
            f"({rl.steps} steps, {rl.elapsed / 60:.1f} min) | +sft {args.control} {em_more:.3f} ({more.steps} "
            f"steps, {more.elapsed / 60:.1f} min) | gain grpo {em_rl - em_sft:+.3f} | gain sft {args.control} "
            f"{em_more - em_sft:+.3f}   "
            f"(held-out {args.limit}, load avg {load:.1f}, --set {' '.join(args.set) or '-'})",
            flush=True,
        )
    finally:
        if args.keep or args.reuse or args.workdir:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
