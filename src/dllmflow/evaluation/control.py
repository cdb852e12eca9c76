"""The dLLM beside its AR control (`eval.ar_control`): what both arms are measured with, and the side by
side every results table, card, MLflow run and registered version shows.

    speeds = speeds_of({"llada": (ckpt, "llada", None), "ar_control": (ar_ckpt, "ar", None)}, settings)
    trained = training_summary(run_dir)            # steps, tokens, supervised tokens, wall seconds
    side = compare_arms("llada", evals["llada"], evals["ar_control"])   # refuses unlike protocols

Both arms are evaluated from one eval section (the dLLM run's settings: the same prepared data, split,
limit, n-shot, generation length and batch size; workflow/ar_control.py passes them to the control's
evaluation), so they ask the same prompts by construction. `compare_arms` checks it again from what
each evaluation recorded (`ArmProtocol`): the prompt ids' digest, the answer parser, the chat template,
the limit, ... and refuses a comparison where one differs, naming it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any

from dllmflow.errors import UserError

SINGLE_PROMPTS = 8  # answers timed one at a time (the median is the latency at batch 1)
BATCH = 16  # the throughput batch

# The figures shown side by side (key -> label), in order.
SIDE_BY_SIDE = {
    "exact_match_flexible": "EM",
    "latency_s_b1": "s/answer @1",
    "tokens_per_s_b16": "tok/s @16",
    "train_steps": "train steps",
    "train_tokens": "train tokens",
    "train_seconds": "train s",
}


class ProtocolMismatchError(UserError):
    """Two arms evaluated on different prompts, limits, parsers, ...: their scores do not compare."""


@dataclass(frozen=True)
class ArmProtocol:
    """What an arm's exact match was measured on; equal for both arms of a comparison."""

    prepared_dir: str
    split: str
    limit: int | None
    n_shot: int
    max_new_tokens: int
    chat_template_sha256: str
    prompts_sha256: str
    answer_parser: str
    split_sha256: str

    @classmethod
    def of(cls, result: dict[str, Any]) -> ArmProtocol:
        protocol = result.get("protocol", {})
        return cls(**{f.name: protocol.get(f.name) for f in fields(cls)})

    def check_same(self, other: ArmProtocol, names: tuple[str, str]) -> None:
        """ProtocolMismatchError naming every field where `other` differs."""
        mine, theirs = asdict(self), asdict(other)
        differ = [k for k in mine if mine[k] != theirs[k]]
        if differ:
            what = "; ".join(f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in differ)
            raise ProtocolMismatchError(
                f"{names[0]} and {names[1]} were not evaluated alike ({what}); their exact match does not "
                "compare: evaluate both from one eval section (eval.ar_control does)"
            )


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


def training_summary(run_dir: Any) -> dict[str, float]:
    """A run's optimizer steps, tokens read (padding included) and supervised tokens, and the wall
    seconds of its steps (metrics.jsonl: tokens_per_step / tps per step; checkpoint saves excluded)."""
    from dllmflow.runs import read_metrics

    records = read_metrics(run_dir)
    return {
        "train_steps": max((int(r["step"]) for r in records), default=0),
        "train_tokens": sum(int(r.get("tokens_per_step", 0)) for r in records),
        "train_supervised_tokens": sum(int(r.get("supervised_tokens", 0)) for r in records),
        "train_seconds": sum(r["tokens_per_step"] / r["tps"] for r in records if r.get("tps")),
    }


def arm_figures(result: dict[str, Any]) -> dict[str, float | None]:
    """The side-by-side figures of one evaluation result (its metrics and its training summary)."""
    values = {**result.get("metrics", {}), **result.get("training", {})}
    return {k: values.get(k) for k in SIDE_BY_SIDE}


def compare_arms(
    name: str, dllm: dict[str, Any], control: dict[str, Any], identity: bool = False
) -> dict[str, Any]:
    """The dLLM (evaluation `name`) and the AR control side by side, after checking both were asked the
    same prompts and scored by the same parser (ProtocolMismatchError otherwise). -> {"dllm": figures,
    "ar_control": figures, "sampler": name, "em_gap": dLLM EM - control EM}; with `identity` (a model
    whose answers must be the control's: uno's drafting adapter) also "identical": how many answers
    are the control's token for token, of "answers"."""
    ArmProtocol.of(dllm).check_same(ArmProtocol.of(control), (name, "ar_control"))
    a, b = arm_figures(dllm), arm_figures(control)
    em_a, em_b = a["exact_match_flexible"], b["exact_match_flexible"]
    gap = em_a - em_b if em_a is not None and em_b is not None else None
    side = {"sampler": name, "dllm": a, "ar_control": b, "em_gap": gap}
    if identity:
        side.update(identical_answers(dllm.get("predictions", []), control.get("predictions", [])))
    return side


def identical_answers(dllm: list[dict], control: list[dict]) -> dict[str, int]:
    """{"identical": answers whose generated ids equal the control's for the same example id,
    "answers": examples both answered}. An answer recorded without its ids never counts as identical."""
    theirs = {p["id"]: p.get("ids") for p in control}
    both = [p for p in dllm if p["id"] in theirs]
    same = sum(p.get("ids") is not None and p.get("ids") == theirs[p["id"]] for p in both)
    return {"identical": same, "answers": len(both)}


def identity_line(side: dict[str, Any]) -> str | None:
    """The identity line, e.g. "answers identical to the AR control: 319/319 (selfspec)", or how many
    differ; None without the identity check. The card, the tags and the results table print this one wording."""
    if "identical" not in side:
        return None
    same, n, sampler = side["identical"], side["answers"], side["sampler"]
    if same == n:
        return f"answers identical to the AR control: {same}/{n} ({sampler})"
    return f"answers NOT identical to the AR control: {n - same} of {n} differ ({sampler})"
