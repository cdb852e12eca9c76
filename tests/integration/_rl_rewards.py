"""User rewards ("module:attr") for tests/integration/test_grpo.py: on PYTHONPATH there, named in its recipes."""

from __future__ import annotations


def digits(prompt: str, completion: str, answer: str) -> float:
    """Share of the answer's digits the completion contains: varies within a group, so advantages do."""
    wanted = [c for c in answer if c.isdigit()]
    return sum(c in completion for c in wanted) / max(len(wanted), 1)


def not_a_number(prompt: str, completion: str, answer: str) -> float:
    return float("nan")
