"""Decoding speed (evaluation/speed.py): the runners take turns on the same prompts, each figure is that
runner's own median latency at batch 1 and rate at batch 16."""

from __future__ import annotations

import pytest

from dllmflow.evaluation.speed import measure_speeds


class _Timed:
    """A decoder whose answers take the seconds given per call, logging each call: what the speed
    figures and their order are computed from (the decoding itself is tested with the samplers)."""

    def __init__(self, name, seconds, log):
        self.name, self.seconds, self.log = name, iter(seconds), log

    def generate(self, prompts):
        from types import SimpleNamespace

        self.log.append((self.name, len(prompts)))
        return SimpleNamespace(elapsed_s=next(self.seconds), num_generated_tokens=6 * len(prompts),
                               sequences=[[0]] * len(prompts))  # fmt: skip


def test_both_arms_are_timed_interleaved_on_the_same_prompts():
    """A load change must fall on both arms alike: prompt i goes through each arm in turn (not all of one
    arm's answers, then the other's), and each figure is that arm's own median / batch rate."""
    log: list = []
    prompts = [[1, 2]] * 20
    dllm = _Timed("dllm", [9.0] + [0.01, 0.03, 0.02] + [0.02] * 5 + [0.5], log)
    ar = _Timed("ar", [9.0] + [0.1] * 8 + [2.0], log)
    speeds = measure_speeds({"dllm": dllm, "ar": ar}, {"dllm": prompts, "ar": prompts})
    assert log[:2] == [("dllm", 1), ("ar", 1)]  # one warm-up answer each, not timed
    assert log[2:18] == [("dllm", 1), ("ar", 1)] * 8
    assert log[18:] == [("dllm", 16), ("ar", 16)]
    assert speeds["dllm"]["latency_s_b1"] == pytest.approx(0.02) and speeds["ar"]["latency_s_b1"] == 0.1
    assert speeds["dllm"]["tokens_per_s_b16"] == pytest.approx(96 / 0.5)
    assert speeds["ar"]["answers_per_s_b16"] == pytest.approx(16 / 2.0)
