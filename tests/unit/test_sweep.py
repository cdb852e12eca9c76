"""`dllmflow.evaluation.sweep`: the Pareto front against a direct reference (a sort-and-scan skyline),
`choose_setting` (the fastest point within the tolerance of the best exact match), grid parsing, and a
real sweep on a tiny export: the model loads once and every point equals a standalone `evaluate` run
with that setting."""

from __future__ import annotations

import json
import random

import pytest
from _tiny_eval import tiny_eval_export

from dllmflow.cli import main
from dllmflow.errors import UserError
from dllmflow.evaluation.accuracy import run_sweep
from dllmflow.evaluation.sweep import build_grid, choose_setting, pareto_front, sampler_points


def _pt(em: float, speed: float) -> dict:
    return {"metrics": {"exact_match_flexible": em, "tokens_per_s": speed}}


def _skyline(points: list[tuple[float, float]]) -> list[int]:
    """Reference: sort by exact match then speed, both descending; a point is on the front iff it is
    faster than every point before it, or equal to the last point kept (equal points are all kept)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    front, best_speed, last = [], float("-inf"), None
    for i in order:
        if points[i][1] > best_speed or points[i] == last:
            front.append(i)
            best_speed, last = max(best_speed, points[i][1]), points[i]
    return sorted(front)


@pytest.mark.parametrize("seed", range(30))
def test_pareto_front_matches_the_skyline_reference(seed):
    rng = random.Random(seed)
    # few distinct values, so ties in one or both objectives are common
    raw = [(rng.choice([0.0, 0.25, 0.5, 0.75]), float(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
    assert pareto_front([_pt(*p) for p in raw]) == _skyline(raw)


def test_pareto_front_small_cases():
    assert pareto_front([_pt(0.5, 100), _pt(0.4, 300), _pt(0.4, 200), _pt(0.5, 100)]) == [0, 1, 3]
    assert pareto_front([_pt(0.9, 10), _pt(0.8, 5)]) == [0]  # dominated in both


def test_choose_setting_is_the_fastest_within_the_tolerance_of_the_best():
    points = [_pt(0.80, 100), _pt(0.795, 300), _pt(0.70, 900), _pt(0.80, 150)]
    assert choose_setting(points, 0.01) == 1  # 0.5 points below the best, 2x faster than index 3
    assert choose_setting(points, 0.0) == 3  # only the best exact match: the faster of the two
    assert choose_setting(points, 0.2) == 2
    assert choose_setting([_pt(0.5, 100), _pt(0.5, 100)], 0.01) == 0  # ties: the earlier
    assert choose_setting([_pt(0.5, 100), _pt(0.509, 100)], 0.01) == 1  # equal speed: the more accurate
    with pytest.raises(UserError):
        choose_setting([])


def test_the_choice_compares_the_speeds_timed_in_turn_over_each_points_own_pass():
    # each point's own evaluation pass says point 0 is faster; timed taking turns, point 1 is
    slow_alone, fast_alone = _pt(0.9, 100), _pt(0.9, 500)
    slow_alone["timed"], fast_alone["timed"] = {"tokens_per_s_b16": 800.0}, {"tokens_per_s_b16": 200.0}
    assert choose_setting([fast_alone, slow_alone]) == 1
    assert pareto_front([fast_alone, slow_alone]) == [1]


@pytest.mark.parametrize("seed", range(20))
def test_the_chosen_setting_is_on_the_front_and_within_tolerance(seed):
    rng = random.Random(seed)
    points = [_pt(rng.choice([0.5, 0.51, 0.6, 0.605]), rng.uniform(1, 100)) for _ in range(rng.randint(1, 9))]
    i = choose_setting(points, 0.01)
    best = max(p["metrics"]["exact_match_flexible"] for p in points)
    assert i in pareto_front(points) and points[i]["metrics"]["exact_match_flexible"] >= best - 0.01


def test_build_grid_from_flags_and_a_file(tmp_path):
    assert build_grid(["threshold=none,0.9", "steps=64,128"]) == {
        "threshold": [None, 0.9],
        "steps": [64, 128],
    }
    grid = tmp_path / "grid.yaml"
    grid.write_text("threshold: [null, 0.5]\ncache: [none, dual]\n")
    assert build_grid(["threshold=0.9"], grid) == {"threshold": [0.9], "cache": ["none", "dual"]}
    for items, message in [
        (["threshold"], "write KEY=V1,V2"),
        (["temperature=0,1"], "temperature: Extra inputs"),
        (["threshold=2"], "threshold.0: Input should be less than or equal to 1"),
        (["cache=full"], "cache.0: Input should be 'none', 'exact', 'prefix' or 'dual'"),
        (["steps=4,4"], "steps: must be a non-empty list without repeats"),
    ]:
        with pytest.raises(UserError, match=message):
            build_grid(items)
    with pytest.raises(UserError, match="--sweep-file .*missing.yaml"):
        build_grid(None, tmp_path / "missing.yaml")


def test_sampler_points_drop_or_refuse_what_a_sampler_cannot_use():
    axes = {"threshold": [None, 0.9], "cache": ["none"]}
    # cache none: no cache, which every sampler honours
    assert sampler_points("llada", axes, strict=True) == [
        {"threshold": None, "cache": "none"}, {"threshold": 0.9, "cache": "none"},
    ]  # fmt: skip
    assert sampler_points("gemma", axes, strict=False) == [{"cache": "none"}]  # no threshold option
    with pytest.raises(UserError, match="--sweep threshold: sampler gemma does not take threshold"):
        sampler_points("gemma", axes, strict=True)
    with pytest.raises(UserError, match="--sweep threshold: sampler llada cannot use 0.0"):
        sampler_points("llada", {"threshold": [0.5, 0.0]}, strict=True)  # gt 0
    with pytest.raises(UserError, match="--sweep cache: sampler nemotron cannot use 'dual'"):
        sampler_points("nemotron", {"cache": ["none", "dual"]}, strict=True)
    assert sampler_points("nemotron", {"cache": ["dual"]}, strict=False) == [{}]  # the eval settings alone


# ---- a real sweep ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_eval_export(tmp_path_factory.mktemp("sweep"))


def test_sweep_loads_once_and_each_point_is_the_standalone_evaluation(export, monkeypatch):
    from dllmflow.diffusion.samplers import eval_knobs
    from dllmflow.evaluation import speed
    from dllmflow.evaluation.accuracy import evaluate
    from dllmflow.inference import generate

    ckpt, _ = export
    loads, timed = [], []
    real = generate.load_export  # what every evaluation load goes through, the checkpoint resolved once
    monkeypatch.setattr(generate, "load_export", lambda *a, **k: loads.append(a) or real(*a, **k))
    real_speeds = speed.measure_speeds
    monkeypatch.setattr(speed, "measure_speeds", lambda r, p: timed.append(r) or real_speeds(r, p))
    # block_size None is llada's preset 128: the same effective setting as 128, run once
    result = run_sweep(ckpt, None, "llada", {"threshold": [None, 0.5], "block_size": [None, 128]})
    assert len(loads) == 1
    sweep = result["sweep"]
    # the points' speeds are timed once, all points in turn, and those are the figures the choice read
    assert len(timed) == 1 and len(timed[0]) == len(sweep["points"]) == 2
    assert all(p["timed"]["tokens_per_s_b16"] > 0 and p["timed"]["latency_s_b1"] > 0 for p in sweep["points"])
    settings = [p["setting"] for p in sweep["points"]]
    assert settings == [{"threshold": None, "block_size": 128}, {"threshold": 0.5, "block_size": 128}]
    for point in sweep["points"]:
        alone = evaluate(ckpt, overrides=dict(point["setting"]))
        keys = ("exact_match_strict", "exact_match_flexible", "nfe", "tokens_per_forward", "num_examples")
        assert {k: point["metrics"][k] for k in keys} == {k: alone["metrics"][k] for k in keys}
        assert point["sampler_settings"] == alone["protocol"]["sampler_settings"]
    assert sweep["pareto"] == pareto_front(sweep["points"]) and sweep["chosen"] == choose_setting(
        sweep["points"]
    )
    chosen = sweep["points"][sweep["chosen"]]
    assert result["metrics"] == chosen["metrics"]  # the result is the chosen point's evaluation
    assert result["protocol"]["sampler_settings"] == chosen["sampler_settings"]
    assert eval_knobs.EVAL_SETTINGS[4] == "cache"  # the eval section's cache reaches every evaluation


def test_evaluate_cli_sweep_writes_json_and_table(export, tmp_path, capsys):
    ckpt, _ = export
    out = tmp_path / "sweep.json"
    code = main(["evaluate", "--checkpoint", str(ckpt), "--limit", "2", "--sweep", "steps=2,4",
                 "--sweep", "cache=none", "--output", str(out)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    res = json.loads(out.read_text())
    assert [p["setting"] for p in res["sweep"]["points"]] == [
        {"cache": "none", "steps": 2}, {"cache": "none", "steps": 4},
    ]  # fmt: skip
    assert res["metrics"]["num_examples"] == 2 and res["sweep"]["tolerance"] == 0.01
    assert "pareto" in captured.out and "<-" in captured.out and "steps=4" in captured.out
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically, nothing left behind
    bad = main(
        ["evaluate", "--checkpoint", str(ckpt), "--sampler", "llada", "--sweep", "editing_threshold=0.1"]
    )
    assert bad == 2 and "editing_threshold" in capsys.readouterr().err
