"""Decoding speed, timed the same way for every caller: seconds per answer at batch 1 and tokens (and
answers) per second at batch 16, with the runners taking turns on the same prompts so a change of load
on the machine falls on all of them alike.

    speeds = measure_speeds({"a": runner_a, "b": runner_b}, {"a": prompts_a, "b": prompts_b})
    speeds = speeds_of({"llada": (ckpt, "llada", None), "ar_control": (ar_ckpt, "ar", None)}, settings)

Callers: the AR control's side by side (workflow/ar_control.py, evaluation/control.py) and the sweep's
points (`accuracy.run_sweep`). Single process; the runners are loaded in it.
"""

from __future__ import annotations

import statistics
from typing import Any

SINGLE_PROMPTS = 8  # answers timed one at a time (the median is the latency at batch 1)
BATCH = 16  # the throughput batch


def measure_speeds(
    runners: dict[str, Any], prompts: dict[str, list[list[int]]]
) -> dict[str, dict[str, float]]:
    """Each runner's seconds per answer at batch 1 (median over the first `SINGLE_PROMPTS` prompts, each
    alone) and tokens and answers per second for one batch of the first `BATCH` prompts, after a warm-up
    answer. Interleaved: every prompt goes through each runner in turn, then each runner's batch, so a
    change of load on the machine falls on all arms alike. `prompts[name]`: that runner's (each arm's
    own tokenizer asked the same problems)."""
    for name, runner in runners.items():
        runner.generate(prompts[name][:1])  # first-call costs (allocations, lazy imports) stay out
    single: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(min(SINGLE_PROMPTS, *(len(p) for p in prompts.values()))):
        for name, runner in runners.items():
            single[name].append(runner.generate([prompts[name][i]]).elapsed_s)
    out = {}
    for name, runner in runners.items():
        batch = runner.generate(prompts[name][:BATCH])
        seconds = max(batch.elapsed_s, 1e-9)
        out[name] = {
            "latency_s_b1": statistics.median(single[name]),
            "tokens_per_s_b16": batch.num_generated_tokens / seconds,
            "answers_per_s_b16": len(batch.sequences) / seconds,
        }
    return out


def speeds_of(arms: dict[str, tuple[Any, str, dict[str, Any] | None]], settings: Any) -> dict[str, dict]:
    """`measure_speeds` of each arm (name -> (checkpoint, sampler, overrides such as the chosen sweep
    point)), all loaded in this process, with the held-out prompts of `settings.eval`."""
    from dllmflow.evaluation.protocol import build_eval_runner, eval_prompts

    ev, runners, prompts = settings.eval, {}, {}
    for name, (checkpoint, sampler, overrides) in arms.items():
        loaded = build_eval_runner(checkpoint, settings, sampler, overrides)
        asked = eval_prompts(loaded.tokenizer, settings.dataset.prepared_dir, ev.split, ev.limit, ev.n_shot)
        runners[name], prompts[name] = loaded.runner, asked.prompts
    return measure_speeds(runners, prompts)
