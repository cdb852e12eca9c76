"""`dllmflow.tracking.registry.gate_decision`, the champion gate as a plain function: the absolute floor
(`registry.gate.min_accuracy`, `min_tau` for DFlash's tau) keeps a useless first version from becoming
champion; above it the first version is promoted and a worse second one is not."""

from __future__ import annotations

import math

from dllmflow.settings import load_settings
from dllmflow.tracking.registry import gate_decision, gate_floor


def _gate(**over):
    return load_settings(registry={"gate": over}).registry.gate


def test_defaults_have_a_positive_floor_per_metric():
    assert gate_floor(_gate()) == _gate().min_accuracy > 0
    assert gate_floor(_gate(metric="tau")) == _gate().min_tau > 1.0  # tau 1.0 = the draft never helps


def test_first_run_below_the_floor_is_not_promoted():
    promote, reason = gate_decision(_gate(), 0.0, 50.0, sampler="llada", version=1)
    assert not promote and "below the floor 0.05" in reason and "exact_match_flexible 0.0000" in reason


def test_first_run_above_the_floor_is_promoted():
    promote, reason = gate_decision(_gate(), 0.9, 50.0, sampler="llada", version=1)
    assert promote and reason.startswith("no champion yet")


def test_second_worse_run_is_not_promoted_but_within_tolerance_is():
    gate = _gate(tolerance=0.05)
    promote, reason = gate_decision(
        gate, 0.5, 50.0, sampler="llada", version=2, champion_version=1, champion_value=0.9
    )
    assert not promote and reason == "exact_match_flexible 0.5000 < champion v1 0.9000 - 0.05"
    promote, _ = gate_decision(
        gate, 0.86, 50.0, sampler="llada", version=3, champion_version=1, champion_value=0.9
    )
    assert promote


def test_floor_applies_even_against_a_worse_champion_and_is_metric_aware():
    promote, reason = gate_decision(
        _gate(min_accuracy=0.5), 0.4, 50.0, sampler="llada", version=2, champion_version=1, champion_value=0.1
    )
    assert not promote and "below the floor 0.5" in reason
    tau = _gate(metric="tau")
    assert not gate_decision(tau, 1.0, 5.0, sampler="acceptance", version=1)[0]
    assert gate_decision(tau, 2.5, 5.0, sampler="acceptance", version=1)[0]


def test_missing_metric_and_speed_floor_still_refuse():
    assert not gate_decision(_gate(), math.nan, 50.0, sampler="llada", version=1)[0]
    promote, reason = gate_decision(_gate(min_tokens_per_s=100), 0.9, 50.0, sampler="llada", version=1)
    assert not promote and reason.startswith("tokens_per_s 50.00 below the floor 100")


def test_speed_floor_is_off_by_default_and_names_the_setting_it_was_measured_at():
    assert _gate().min_tokens_per_s == 0  # default off: a slow model is not refused for its speed
    assert gate_decision(_gate(), 0.9, 0.01, sampler="llada", version=1)[0]
    gate = _gate(min_tokens_per_s=100)
    promote, reason = gate_decision(gate, 0.9, 99.9, sampler="llada", version=1, setting="threshold=0.9")
    assert not promote
    assert (
        reason == "tokens_per_s 99.90 at threshold=0.9 below the floor 100.0 (registry.gate.min_tokens_per_s)"
    )
    assert gate_decision(gate, 0.9, 100.0, sampler="llada", version=1, setting="threshold=0.9")[0]
    assert not gate_decision(gate, 0.9, math.nan, sampler="llada", version=1)[0]  # no speed measured


def test_a_champion_without_a_comparable_figure_lets_nothing_through():
    gate = _gate(tolerance=0.05)
    for value in (math.nan, math.inf * 0):
        promote, reason = gate_decision(
            gate, 0.99, 50.0, sampler="llada", version=2, champion_version=1, champion_value=value,
            champion_note="champion v1 has no exact_match_flexible figure (missing or NaN)",
        )  # fmt: skip
        assert not promote
        assert reason.startswith("no exact_match_flexible of champion v1 to compare with (champion v1 has no")
    promote, reason = gate_decision(
        gate, 0.5, 50.0, sampler="llada", version=2, champion_version=1, champion_value=0.4,
        champion_note="re-measured",
    )  # fmt: skip
    assert promote and reason.endswith("(re-measured)")


def test_protocol_differences_name_each_part_that_differs():
    from dllmflow.evaluation.protocol import GATE_PROTOCOL, protocol_differences, protocol_fingerprint

    base = {"split_sha256": "a" * 64, "limit": 64, "n_shot": 0, "sampler": "llada", "max_new_tokens": 8,
            "sampler_settings": {"steps": 8, "threshold": None}, "answer_parser": "p/1", "checkpoint": "x"}  # fmt: skip
    assert set(protocol_fingerprint(base)) == set(GATE_PROTOCOL) and "checkpoint" not in protocol_fingerprint(
        base
    )
    assert protocol_differences(base, {**base, "checkpoint": "elsewhere", "batch_size": 3}) == []
    other = {
        **base,
        "limit": 32,
        "split_sha256": "b" * 64,
        "sampler_settings": {"steps": 8, "threshold": 0.9},
    }
    assert protocol_differences(other, base) == [
        f"split_sha256: {'a' * 64!r} -> {'b' * 64!r}",
        "limit: 64 -> 32",
        "sampler_settings.threshold: None -> 0.9",
    ]
    assert protocol_differences(base, {}) == [f"{k}: None -> {base[k]!r}" for k in GATE_PROTOCOL]
