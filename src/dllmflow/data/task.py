"""The task layer: how a question is asked and how an answer is read, shared by the evaluation
(`dllmflow evaluate`, the lm-eval adapter) and RL (its rewards, prompts and held-out accuracy).

    chats = task_chats(prepared_dir, rows, n_shot)        # n-shot exemplars + the question, per row
    gsm8k_extract_strict("... #### 1,234")  -> "1234";  gsm8k_extract_flexible(text): the last number
    gold_answer("#### 085") -> "85"

Prompts: the chat without its last assistant turn, after n-shot exemplars from the train split.
Answers: strict (the number after `####`) and flexible (the last number in the text), commas and `$`
ignored, numbers compared as numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)

# ---- answer extraction --------------------------------------------------------------------------


def normalize_number(text: str | None) -> str | None:
    """'$1,234.50' -> '1234.5', '18.' -> '18', '-3' -> '-3'; None when no number is left."""
    if text is None:
        return None
    s = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_extract_strict(text: str) -> str | None:
    """The number after the first `####` (GSM8K's answer line), normalised; None if absent."""
    m = _STRICT.search(text)
    return normalize_number(m.group(1)) if m else None


def gsm8k_extract_flexible(text: str) -> str | None:
    """The last number anywhere in the text, normalised; None if there is none."""
    found = _ANY_NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def gold_answer(reference: str) -> str | None:
    return gsm8k_extract_strict(reference) or gsm8k_extract_flexible(reference)


# The name of the extraction above: a change to `_NUMBER`, `normalize_number` or the two extractors
# that can move a score gets a new name, so figures scored before and after it no longer compare.
ANSWER_PARSER = "gsm8k-strict-flexible/1"


# ---- prompts ------------------------------------------------------------------------------------


def prompt_messages(messages: list[dict], shots: list[list[dict]] = ()) -> list[dict]:
    """The chat to answer: n-shot exemplar turns, then every turn but the final assistant one."""
    head = [m for shot in shots for m in shot]
    body = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    return head + list(body)


def _exemplars(prepared_dir: Path, n_shot: int) -> list[list[dict]]:
    if n_shot == 0:
        return []
    from dllmflow.data.dataset import PreparedDataset

    rows = PreparedDataset(prepared_dir, "train").rows(n_shot)
    return [[m for m in r["messages"] if m["role"] != "system"][-2:] for r in rows]


def task_chats(prepared_dir: Path, rows: list[dict], n_shot: int) -> list[list[dict]]:
    """The chat each row is asked as: n-shot exemplars from the train split, then its question."""
    shots = _exemplars(prepared_dir, n_shot)
    return [prompt_messages(r["messages"], shots) for r in rows]
