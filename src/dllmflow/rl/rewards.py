"""Verifiable rewards for GRPO (docs/strategies.md §8.3): built-ins, user rewards, and scoring that
reports a failing reward instead of training on it.

    rewards = build_rewards(["exact_match", "format"], [1.0, 0.1], import_user=True)
    rewards = build_rewards(["my_pkg.rewards:brevity"], None, import_user=True)   # a user's callable
    rewards = build_rewards([brevity, "exact_match"], [0.5, 1.0], import_user=False)  # ... or passed in code
    batch = score(rewards, prompts, completions, answers)   # values [B], valid [B], failures

Every reward is `fn(prompt: str, completion: str, answer: str) -> float`; `answer` is the reference
(the dataset's assistant turn, e.g. "#### 085", or a bare number). Answers are read with the parser the
evaluation scores with (data/task.py), so the reward and the held-out exact match agree.
A user reward is a "module:attr" string and is imported only when the caller's own recipe names it
(`import_user=True`), as settings plugins are (settings/loader.py): a recorded settings.json never
runs code.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dllmflow.data.task import gold_answer, gsm8k_extract_flexible, gsm8k_extract_strict
from dllmflow.errors import UserError

RewardFn = Callable[[str, str, str], float]

# The answer line of the bundled tasks: "#### 085" (addition) and GSM8K's "... \n#### 72".
_ANSWER_LINE = re.compile(r"^####\s*-?\$?\s?\d[\d,]*(?:\.\d+)?\s*$")


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's answer (the last number, evaluation's flexible extraction, its headline
    exact match) equals the reference's, numbers compared as numbers (085 == 85)."""
    pred, gold = gsm8k_extract_flexible(completion), gold_answer(answer)
    return float(pred is not None and pred == gold)


def exact_match_strict(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the number after the completion's `####` equals the reference's (evaluation's strict EM)."""
    pred, gold = gsm8k_extract_strict(completion), gold_answer(answer)
    return float(pred is not None and pred == gold)


def answer_format(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion ends with a `#### N` answer line (the bundled tasks' format), else 0.0."""
    lines = completion.strip().splitlines()
    return float(bool(lines) and _ANSWER_LINE.match(lines[-1].strip()) is not None)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "exact_match_strict": exact_match_strict,
    "format": answer_format,
}


@dataclass(frozen=True)
class Reward:
    name: str  # a REWARDS key or the "module:attr" path
    fn: RewardFn
    weight: float


@dataclass(frozen=True)
class RewardFailure:
    index: int  # the row in the scored batch
    prompt: str
    reward: str
    error: str


@dataclass
class RewardBatch:
    values: Tensor  # [B] float32, Σ weight · reward; 0 on a failed row
    valid: Tensor  # [B] bool: False where a reward failed (the trainer skips the step and counts it)
    failures: list[RewardFailure] = field(default_factory=list)


def build_rewards(
    names_or_paths: Sequence[str | RewardFn], weights: Sequence[float] | None, import_user: bool
) -> list[Reward]:
    """Resolve the recipe's `rl.rewards` (built-in names or "module:attr"; or callables passed in code,
    `GRPOTrainer(..., rewards=[fn])`) with `rl.reward_weights` (None = 1.0 each). A user reward is
    imported only when `import_user` (the caller's own recipe)."""
    from dllmflow.common.lazy import load_object

    if not names_or_paths:
        raise UserError(f"rl.rewards: name at least one reward ({', '.join(REWARDS)} or 'module:attr')")
    if weights is not None and len(weights) != len(names_or_paths):
        raise UserError(
            f"rl.reward_weights: {len(weights)} weights for {len(names_or_paths)} rewards; give one per reward"
        )
    out = []
    for i, name in enumerate(names_or_paths):
        weight = 1.0 if weights is None else float(weights[i])
        if callable(name):  # the caller's own code: nothing to import
            out.append(Reward(getattr(name, "__name__", repr(name)), name, weight))
            continue
        if name in REWARDS:
            out.append(Reward(name, REWARDS[name], weight))
            continue
        if ":" not in name:
            raise UserError(
                f"rl.rewards: unknown reward {name!r}; choose one of: {', '.join(REWARDS)} or 'module:attr'"
            )
        if not import_user:
            raise UserError(
                f"rl.rewards: {name!r} is a user reward and is imported only from the caller's own recipe, "
                "not from a recorded settings file; import it yourself or use a built-in reward"
            )
        try:
            fn = load_object(name)
        except (ImportError, AttributeError) as e:
            raise UserError(f"rl.rewards: cannot load {name!r} ({e}); put its module on PYTHONPATH") from None
        if not callable(fn):
            raise UserError(
                f"rl.rewards: {name!r} is not callable; name a function (prompt, completion, answer)"
            )
        out.append(Reward(name, fn, weight))
    return out


def score(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
) -> RewardBatch:
    """Weighted sum of the rewards per row. A reward that raises, or returns NaN/inf or a non-number,
    fails its row: the row's value is 0, `valid` is False and a RewardFailure names the prompt, the
    reward and the error; the other rows are still scored."""
    B = len(completions)
    values, valid, failures = [0.0] * B, [True] * B, []
    for i in range(B):
        total = 0.0
        for reward in rewards:
            error = None
            try:
                value = reward.fn(prompts[i], completions[i], answers[i])
            except Exception as e:  # a user's reward may raise anything: report it, do not crash the run
                error = f"raised {type(e).__name__}: {e}"
            else:
                if not isinstance(value, numbers.Real):
                    error = f"returned {type(value).__name__} {value!r}, not a number"
                elif not math.isfinite(float(value)):
                    error = f"returned {value}, not a finite number"
            if error is not None:
                failures.append(RewardFailure(i, prompts[i], reward.name, error))
                valid[i] = False
                continue
            total += reward.weight * float(value)
        values[i] = total if valid[i] else 0.0
    return RewardBatch(
        torch.tensor(values, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), failures
    )
