"""Shared check of a DFlash acceptance report (`evaluate_dflash`): its numbers follow from the
per-example accepted counts."""

from __future__ import annotations

import pytest


def assert_acceptance_consistent(report: dict, block_size: int) -> None:
    """tau and the per-position rates recomputed from the per-example accepted counts; every round
    accounts for its committed tokens (prefill 1, then accepted + bonus, the last round cut by EOS or
    the budget)."""
    m, preds = report["metrics"], report["predictions"]
    rounds = [n for p in preds for n in p["accepted"]]
    assert rounds and all(0 <= n <= block_size - 1 for n in rounds)
    assert m["tau"] == pytest.approx(sum(n + 1 for n in rounds) / len(rounds))
    rates = [m[f"acceptance_k{k}"] for k in range(1, block_size)]
    assert rates == pytest.approx([sum(n >= k for n in rounds) / len(rounds) for k in range(1, block_size)])
    assert all(0.0 <= r <= 1.0 for r in rates) and rates == sorted(rates, reverse=True)
    for p in preds:
        acc = p["accepted"]
        if not acc:  # the prefill's token already ended the answer
            assert p["tokens"] == 1
            continue
        assert 1 + sum(n + 1 for n in acc[:-1]) < p["tokens"] <= 1 + sum(n + 1 for n in acc)
        assert p["identical"] is True
    forwards = sum(1 + len(p["accepted"]) for p in preds)
    assert m["target_forwards"] == pytest.approx(forwards / len(preds))
    assert m["tokens_per_target_forward"] == pytest.approx(sum(p["tokens"] for p in preds) / forwards)
