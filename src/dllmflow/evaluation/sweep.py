"""Accuracy and speed together: one checkpoint evaluated over a grid of sampler settings (threshold,
cache, steps, block_size), each point scored for exact match, tokens/s, NFE and tokens per forward (the
speed compared: one batch timed with the points taking turns on the same prompts,
`evaluation.speed.measure_speeds`), with the Pareto frontier (max exact match, max tokens/s) and the
setting a model is registered at: the fastest point within `tolerance` of the best exact match
(`choose_setting`).

    dllmflow evaluate --checkpoint runs/tiny_addition --sweep threshold=none,0.9 --sweep steps=4,8 \
        --output runs/sweep_llada.json
    dllmflow evaluate --checkpoint CKPT --sweep-file grid.yaml      # {threshold: [null, 0.9], cache: [none, dual]}

`none` / `null` in a grid = the sampler's preset (llada: no threshold; llada2: its 0.5). The model loads
once; each point rebuilds only the sampler (`EvalRunner.with_overrides`) and runs the `evaluate` path
(`accuracy.run_sweep`). The flow's evaluate step runs `eval.sweep` of the recipe the same way
(`run_sweep(..., strict=False)`: a key or value a sampler cannot use is dropped for it). In Python:
`result = accuracy.run_sweep(ckpt, settings, "llada", {"threshold": [None, 0.9]})` (next to `evaluate`,
whose path it runs); the result is an evaluation of the chosen point (metrics, protocol, predictions)
with the whole sweep under "sweep". This module holds the rest: grids, the frontier, the choice, the table.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

DEFAULT_METRIC = "exact_match_flexible"
_PRESET_WORDS = ("none", "null", "preset", "~")


# ---- the frontier and the choice ----------------------------------------------------------------


def speed_of(point: dict[str, Any]) -> float:
    """The speed a sweep compares points by: tokens/s of one batch timed with the points taking turns
    (`point["timed"]`, `run_sweep`), else the point's own evaluation tokens/s."""
    timed, m = point.get("timed", {}), point["metrics"]
    return float(timed.get("tokens_per_s_b16", m.get("tokens_per_s", float("nan"))))


def _score(point: dict[str, Any], metric: str) -> tuple[float, float]:
    m = point["metrics"]
    acc, speed = float(m.get(metric, float("nan"))), speed_of(point)
    return (acc if math.isfinite(acc) else -math.inf, speed if math.isfinite(speed) else -math.inf)


def pareto_front(points: list[dict[str, Any]], metric: str = DEFAULT_METRIC) -> list[int]:
    """Indices of the points no other point dominates (at least as good in exact match and tokens/s,
    better in one), in input order. Equal points are all on the front."""
    scores = [_score(p, metric) for p in points]
    front = []
    for i, (a, s) in enumerate(scores):
        dominated = any(
            a2 >= a and s2 >= s and (a2 > a or s2 > s) for j, (a2, s2) in enumerate(scores) if j != i
        )
        if not dominated:
            front.append(i)
    return front


def choose_setting(
    points: list[dict[str, Any]], tolerance: float = 0.01, metric: str = DEFAULT_METRIC
) -> int:
    """Index of the fastest point whose exact match is within `tolerance` of the best one (ties: the
    more accurate, then the earlier). Always a point of the Pareto front."""
    if not points:
        raise UserError("no sweep points to choose from")
    scores = [_score(p, metric) for p in points]
    best = max(a for a, _ in scores)
    eligible = [i for i, (a, _) in enumerate(scores) if a >= best - tolerance - 1e-12]
    return max(eligible, key=lambda i: (scores[i][1], scores[i][0], -i))


# ---- grids ----------------------------------------------------------------------------------------


def build_grid(items: list[str] | None = None, file: str | Path | None = None) -> dict[str, list]:
    """The CLI's grid: `--sweep-file` (a YAML/JSON mapping key -> list), then each `--sweep KEY=V1,V2`
    (wins over the file's key), validated like `eval.sweep` (a bad key or value names the flag)."""
    import yaml
    from pydantic import ValidationError

    from dllmflow.settings.pipeline import SweepGrid

    grid: dict[str, Any] = {}
    if file is not None:
        try:
            grid = yaml.safe_load(Path(file).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"--sweep-file {file}: cannot read it ({str(e).splitlines()[0]})") from None
        if not isinstance(grid, dict):
            raise UserError(
                f"--sweep-file {file}: give a mapping key -> list, e.g. {{threshold: [null, 0.9]}}"
            )
    for item in items or []:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise UserError(f"--sweep {item!r}: write KEY=V1,V2 (e.g. threshold=none,0.9)")
        key = key.strip().replace("-", "_")
        # cache's "none" is a mode (no cache), not the preset word
        grid[key] = [v.strip() if key == "cache" else _scalar(v) for v in values.split(",")]
    try:
        return SweepGrid(**grid).axes()
    except ValidationError as e:
        where = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'grid'}: {err['msg']}".replace("Value error, ", "")
            for err in e.errors()
        )
        raise UserError(f"--sweep: {where}") from None


def _scalar(text: str) -> Any:
    import yaml

    text = text.strip()
    return None if text.lower() in _PRESET_WORDS else yaml.safe_load(text)


def sampler_points(sampler: str, axes: dict[str, list], *, strict: bool) -> list[dict[str, Any]]:
    """Every combination of `axes` that `sampler` can run. strict (one sampler asked for by name): a key
    or value it cannot use is a UserError naming it; else (a recipe's grid shared by the mode's
    samplers) it is dropped for this sampler, and no key left = one point, the eval section as it is."""
    from dllmflow.diffusion.samplers.eval_knobs import sampler_takes

    usable: dict[str, list] = {}
    for key, values in axes.items():
        kept = [v for v in values if sampler_takes(sampler, key, v)]
        bad = [v for v in values if v not in kept]
        if bad and strict:
            if not kept and not sampler_takes(sampler, key, None):
                raise UserError(f"--sweep {key}: sampler {sampler} does not take {key}")
            raise UserError(f"--sweep {key}: sampler {sampler} cannot use {', '.join(map(repr, bad))}")
        if kept:
            usable[key] = kept
    return [dict(zip(usable, combo)) for combo in itertools.product(*usable.values())]


def effective_setting(config: Any, keys: list[str]) -> dict[str, Any]:
    """The swept keys' values as the sampler ran them (None in the grid resolved to the preset)."""
    values = config.model_dump(mode="json")
    return {k: values[k] if k in values else "none" for k in keys if k in values or k == "cache"}


def setting_label(setting: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "(eval settings)"


# ---- reading it -----------------------------------------------------------------------------------


def chosen_setting(result: dict[str, Any]) -> dict[str, Any] | None:
    """The setting an evaluation result was chosen at by a sweep (None: no sweep)."""
    sweep = result.get("sweep")
    return sweep["points"][sweep["chosen"]]["setting"] if sweep else None


def sweep_table(result: dict[str, Any]) -> str:
    """Plain-text table of a sweep: per point its setting, exact match, tok/s (`speed_of`), NFE, tokens
    per forward, `*` on the Pareto front and `<-` at the chosen point."""
    import io

    from rich.console import Console
    from rich.table import Table

    sweep = result["sweep"]
    proto = result.get("protocol", {})
    table = Table(
        title=f"Sweep · sampler {proto.get('sampler')} · fastest within {sweep['tolerance']} of the best "
        f"{sweep['metric']}",
        title_justify="left",
    )
    for header in ("setting", "EM", "tok/s", "NFE", "tok/fwd", "pareto", "chosen"):
        table.add_column(header, justify="left" if header == "setting" else "right")
    front = set(sweep["pareto"])
    for i, p in enumerate(sweep["points"]):
        m = p["metrics"]
        table.add_row(
            setting_label(p["setting"]), f"{m.get(sweep['metric'], float('nan')):.3f}",
            f"{speed_of(p):,.1f}", f"{m.get('nfe', 0.0):.1f}",
            f"{m.get('tokens_per_forward', 0.0):.2f}", "*" if i in front else "", "<-" if i == sweep["chosen"] else "",
        )  # fmt: skip
    console = Console(file=io.StringIO(), width=110, force_terminal=False, color_system=None)
    console.print(table)
    return console.file.getvalue().rstrip()
