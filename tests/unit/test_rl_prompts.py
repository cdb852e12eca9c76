"""The GRPO prompt stream and rollout seeds: which prompt and which noise a position gets depends on the
position alone (not on the world size, nor on a restart), and each epoch visits every prompt once."""

from __future__ import annotations

from dllmflow.rl.prompts import Prompt, PromptSet
from dllmflow.rl.rollout import draw_seed, rollout_seed


def _prompts(n: int) -> PromptSet:
    ps = PromptSet.__new__(PromptSet)  # the stream logic only: no prepared dir needed
    ps.items = [Prompt(i, [i], f"q{i}", f"#### {i}") for i in range(n)]
    return ps


def test_ranks_split_a_step_and_the_split_does_not_change_the_prompts():
    for world in (1, 2, 4):
        got = sorted(p for r in range(world) for p in PromptSet.step_positions(3, 8, r, world))
        assert got == list(range(24, 32))
    assert PromptSet.step_positions(0, 4, 1, 2) == [1, 3]


def test_each_epoch_is_a_seeded_permutation():
    ps = _prompts(7)
    epoch0 = [ps.at(p, seed=5).index for p in range(7)]
    epoch1 = [ps.at(p, seed=5).index for p in range(7, 14)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(7))
    assert epoch0 != epoch1 or epoch0 != [ps.at(p, seed=6).index for p in range(7)]
    assert [ps.at(p, seed=5).index for p in range(7)] == epoch0  # a restart redraws the same order


def test_rollout_and_draw_seeds_are_distinct_streams():
    seeds = {rollout_seed(0, p) for p in range(100)} | {draw_seed(0, p) for p in range(100)}
    assert len(seeds) == 200
    assert rollout_seed(1, 5) != rollout_seed(0, 5)
