"""The dLLM beside its AR control (`eval.ar_control`): what both arms are measured with, and the side by
side every results table, card, MLflow run and registered version shows.

    side = compare_arms("llada", evals["llada"], evals["ar_control"])   # refuses unlike protocols
    print(identity_line(side))    # uno: how many answers are the control's, token for token

Each arm's speed is timed by evaluation/speed.py (`speeds_of`), its training summed by
`runs.training_summary`; both land in the results this compares.

Both arms are evaluated from one eval section (the dLLM run's settings: the same prepared data, split,
limit, n-shot, generation length and batch size; workflow/ar_control.py passes them to the control's
evaluation), so they ask the same prompts by construction. `compare_arms` checks it again from what
each evaluation recorded (`EvalProtocol.ARMS`, evaluation/protocol.py: the one protocol type the
champion gate reads too): the prompt ids' digest, the answer parser, the chat template,
the limit, ... and refuses a comparison where one differs, naming it.
"""

from __future__ import annotations

from typing import Any

from dllmflow.errors import UserError

from .protocol import EvalProtocol

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


def check_same_arms(dllm: dict[str, Any], control: dict[str, Any], names: tuple[str, str]) -> None:
    """ProtocolMismatchError naming every part of the arms' view (`EvalProtocol.ARMS`) where the two
    recorded protocols differ."""
    mine, theirs = (EvalProtocol.of(r.get("protocol", {})) for r in (dllm, control))
    differ = mine.differing(theirs, EvalProtocol.ARMS)
    if differ:
        what = "; ".join(f"{k}: {getattr(mine, k)!r} vs {getattr(theirs, k)!r}" for k in differ)
        raise ProtocolMismatchError(
            f"{names[0]} and {names[1]} were not evaluated alike ({what}); their exact match does not "
            "compare: evaluate both from one eval section (eval.ar_control does)"
        )


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
    check_same_arms(dllm, control, (name, "ar_control"))
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
