"""Does GRPO add held-out exact match beyond what the same compute of supervised steps adds? The issue's goal
(#25): on the bundled addition task, a tiny model supervised briefly (held-out EM 0.2-0.6), then RL raises
held-out EM by >= 0.15 absolute within 15 minutes on 2 CPU cores, with an SFT-only run of the same wall
time beside it.

    OMP_NUM_THREADS=1 python bench/grpo_addition.py                       # SFT 720 steps, then 15 min each arm
    python bench/grpo_addition.py --sft-steps 600 --minutes 5 --set rl.kl_beta=0.0

In one temp dir: prepare tiny_addition, SFT `--sft-steps` (params/tiny_addition.yaml, the cosine
schedule cut to those steps), held-out EM (llada, greedy, `--limit` eval prompts). Then two arms of
`--minutes` wall each, timed, in-process on one rank: GRPO (params/tiny_addition_grpo.yaml from the SFT
export, `--set` overrides) and SFT continued from the same export at a constant LR equal to the SFT's
final one (its own 'more steps' baseline, as many steps as fit in the time). Printed, not asserted:

    EM sft | EM +grpo (steps) | EM +sft (steps) | gain grpo - gain sft

Measured 2026-12-02 (2 CPU cores shared with other jobs, load average 8-12; --minutes 5, 256 prompts):
    EM sft 0.480 (720 steps) | +grpo 0.496 (554 steps) | +sft 0.980 (4,200 steps) | gain grpo - gain sft -0.484
The goal is NOT met on this task: continued SFT (the reference answers are the verifiable answers) is
far stronger per second than GRPO's 64 sampled rollouts a step. Other points tried (SFT 800 steps, EM
0.80): lr 1e-3 -> EM 0.15 in 60 steps (the policy collapses); lr 1e-4 -> 0.83 in 80 steps (sampled
reward 0.33 -> 0.68); from EM 0.47 (128 prompts): lr 3e-4 + kl_beta 0 + temperature 0.7, 150 steps -> 0.31;
lr 1e-4 + kl_beta 0 + mu 2 + exact_match only, 200 steps -> 0.38. A one-step gradient check on one group
moves the sequence estimates with the advantages (correlation 0.5): no sign error, but completions that
share tokens ("#### 055" vs "#### 065") are pushed both ways by one_step's per-token estimate.
The `coupled` estimator's 1/t token weights overflowed the k3 KL (loss 7.8e5, grad norm 1.8e8 at step 20).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dllmflow.settings import load_settings, parse_overrides
from dllmflow.training.trainer import TrainerHook

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "params" / "tiny_addition.yaml"
GRPO = ROOT / "params" / "tiny_addition_grpo.yaml"


class StopAfter(TrainerHook):
    """Ends a run after `seconds` of wall time (the step that crosses it finishes first)."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.steps = 0

    def after_step(self, trainer, step: int) -> None:
        self.steps = step
        if time.perf_counter() > self.deadline:
            raise TimeUp


class TimeUp(Exception):
    pass


def held_out_em(run_dir: Path, settings, limit: int) -> float:
    from dllmflow.evaluation.accuracy import evaluate
    from dllmflow.runs import resolve_checkpoint

    return evaluate(resolve_checkpoint(run_dir), settings=settings, sampler="llada", limit=limit)["metrics"][
        "exact_match_flexible"
    ]


def timed_arm(run, hook: StopAfter) -> int:
    try:
        run()
    except TimeUp:
        pass
    return hook.steps


def main() -> None:
    from dllmflow.data.prepare import prepare
    from dllmflow.rl.grpo_trainer import GRPOTrainer
    from dllmflow.training.trainer import Trainer
    from dllmflow.workflow.grpo import starting_settings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sft-steps", type=int, default=720)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--limit", type=int, default=256, help="held-out prompts scored")
    p.add_argument("--set", action="append", default=[], help="GRPO recipe override, e.g. rl.kl_beta=0.0")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    data = {"dataset": {"prepared_dir": str(tmp / "prep")}}
    prepare(load_settings(SFT, **data))

    # 1) the brief SFT
    sft = load_settings(SFT, **data, train={"max_steps": args.sft_steps, "log_every": 100},
                        checkpoint={"every_steps": args.sft_steps})  # fmt: skip
    Trainer(sft, tmp / "sft").run()
    em_sft = held_out_em(tmp / "sft", sft, args.limit)
    print(f"SFT {args.sft_steps} steps: held-out EM {em_sft:.3f}", flush=True)

    # 2) GRPO for --minutes (a checkpoint with the export every 20 steps: the last one is scored)
    big = 10**6
    grpo = load_settings(GRPO, **data, **parse_overrides(args.set),
                         train={"max_steps": big, "log_every": 10}, checkpoint={"every_steps": 20})  # fmt: skip
    grpo, _ = starting_settings(grpo, str(tmp / "sft"))
    grpo = grpo.model_copy(
        update={"checkpoint": grpo.checkpoint.model_copy(update={"save_consolidated": "every"})}
    )
    hook = StopAfter(args.minutes * 60)
    steps_rl = timed_arm(lambda: GRPOTrainer(grpo, tmp / "grpo", hooks=[hook]).run(), hook)
    em_rl = held_out_em(tmp / "grpo", grpo, args.limit)

    # 3) SFT continued for the same wall time, from the same export, at the SFT's final LR
    more, _ = starting_settings(
        load_settings(GRPO, **data, train={"max_steps": big}, rl={}), str(tmp / "sft")
    )
    t = sft.train
    final_lr = t.lr * t.min_lr_ratio
    more = more.model_copy(
        update={
            "rl": None,
            "train": sft.train.model_copy(
                update={
                    "max_steps": big,
                    "lr": final_lr,
                    "lr_schedule": "constant",
                    "warmup_steps": 0,
                    "log_every": 100,
                }
            ),  # fmt: skip
            "checkpoint": sft.checkpoint.model_copy(
                update={"every_steps": 100, "save_consolidated": "every"}
            ),
        }
    )
    hook = StopAfter(args.minutes * 60)
    steps_sft = timed_arm(lambda: Trainer(more, tmp / "more", hooks=[hook]).run(), hook)
    em_more = held_out_em(tmp / "more", more, args.limit)
    print(
        f"EM sft {em_sft:.3f} | +grpo {em_rl:.3f} ({steps_rl} steps, scored at the last multiple of 20) | "
        f"+sft {em_more:.3f} ({steps_sft} steps, scored at the last multiple of 100) | "
        f"gain grpo - gain sft {(em_rl - em_sft) - (em_more - em_sft):+.3f}   ({tmp})"
    )


if __name__ == "__main__":
    main()
