"""`dllmflow.training.data`: the stateless global sampler that makes "resume = step" true and the loss
independent of the topology: which rows each rank trains on at each step."""

from __future__ import annotations

import pytest

from dllmflow.errors import UserError
from dllmflow.training.data import GlobalBatches


def _positions_by_topology(world, gbs=8, lbs=2, steps=3):
    """{global position -> (micro-batch contents)} for every rank of a topology."""
    rows = [{"id": i} for i in range(13)]
    out = {}
    for rank in range(world):
        gb = GlobalBatches(rows, lambda r: {"rows": [x["id"] for x in r]}, gbs, lbs, rank, world, seed=7)
        for step in range(steps):
            for micro in range(gb.grad_accum_steps):
                pos = tuple(gb.positions(step, micro))
                out[pos] = [gb.row_index(p) for p in pos]
    return out


def test_global_batches_are_topology_independent_and_cover_each_step():
    one, two, four = (_positions_by_topology(w) for w in (1, 2, 4))
    assert one == two == four  # same micro-batches (same rows, same positions) whatever the world size
    for step in range(3):
        seen = sorted(p for pos in one for p in pos if step * 8 <= p < (step + 1) * 8)
        assert seen == list(range(step * 8, (step + 1) * 8))


def test_epoch_permutation_visits_every_row_once_per_epoch():
    rows = [{"id": i} for i in range(13)]
    gb = GlobalBatches(rows, list, 13, 13, 0, 1, seed=3)
    epoch0 = [gb.row_index(p) for p in range(13)]
    epoch1 = [gb.row_index(p) for p in range(13, 26)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(13))
    assert epoch0 != epoch1  # reshuffled each epoch
    assert [gb.row_index(p) for p in range(13)] == epoch0  # stateless: asking again gives the same


def test_micro_batch_slots_follow_the_documented_layout():
    # k = (j * world + r) * lbs + b at positions step * gbs + k
    rows = [{"id": i} for i in range(50)]
    gb = GlobalBatches(rows, list, 12, 2, 1, 3, seed=0)
    assert gb.grad_accum_steps == 2
    assert gb.positions(4, 0) == [48 + 2, 48 + 3]
    assert gb.positions(4, 1) == [48 + 8, 48 + 9]


def test_step_collates_rows_and_carries_their_global_positions():
    rows = [{"id": i} for i in range(10)]
    seen = []
    gb = GlobalBatches(rows, lambda r: seen.append([x["id"] for x in r]) or {}, 4, 2, 0, 1, seed=1)
    micro = gb.step(3)
    assert [mb["global_index"].tolist() for mb in micro] == [[12, 13], [14, 15]]
    assert seen == [[gb.row_index(12), gb.row_index(13)], [gb.row_index(14), gb.row_index(15)]]


def test_bad_batch_sizes_and_empty_data_are_user_errors():
    with pytest.raises(UserError, match="global_batch_size"):
        GlobalBatches([{"id": 0}], list, 6, 4, 0, 1, seed=0)
    with pytest.raises(UserError, match="empty"):
        GlobalBatches([], list, 4, 4, 0, 1, seed=0)


def test_data_position_resumes_exactly_across_world_sizes_and_refuses_other_data():
    rows = [{"id": i} for i in range(13)]
    saved = GlobalBatches(rows, list, 8, 2, 0, 2, seed=7).state(5)
    assert saved["consumed_samples"] == 40 and saved["world_size"] == 2
    # another world size: the same positions at the same step, so it resumes on the next sample
    for world in (1, 4):
        gb = GlobalBatches(rows, list, 8, 2, 0, world, seed=7)
        gb.check_resume(saved, 5)
        firsts = sorted(p for r in range(world) for j in range(gb.grad_accum_steps)
                        for p in GlobalBatches(rows, list, 8, 2, r, world, seed=7).positions(5, j))  # fmt: skip
        assert firsts == list(range(40, 48))
    with pytest.raises(UserError, match=r"num_rows 13 -> 14"):
        GlobalBatches(rows + [{"id": 13}], list, 8, 2, 0, 2, seed=7).check_resume(saved, 5)
    with pytest.raises(UserError, match=r"global_batch_size 8 -> 4.*seed 7 -> 8"):
        GlobalBatches(rows, list, 4, 2, 0, 2, seed=8).check_resume(saved, 10)
    with pytest.raises(UserError, match=r"consumed_samples 40 != step 4 x 8"):
        GlobalBatches(rows, list, 8, 2, 0, 2, seed=7).check_resume(saved, 4)
    GlobalBatches(rows, list, 8, 2, 0, 2, seed=7).check_resume(None, 4)  # an older checkpoint: resume = step
