"""The champion's figure a candidate is gated against: one measured under the candidate's protocol.

    figure = champion_figure(settings, champion, protocol, "exact_match_flexible")
    figure.value    # the champion's metric under `protocol`; NaN = none comparable (figure.note says why)

Each gated version records the protocol its figure was measured with (`eval.protocol`, the
`GATE_PROTOCOL` fingerprint of evaluation/protocol.py: held-out split hash, limit, n-shot, sampler and
its whole setting, max new tokens, answer parser). The champion's recorded figure is used only when its
fingerprint equals the candidate's and the figure is a number. Otherwise (another protocol, none
recorded, the metric missing or NaN) the champion is evaluated again here under the candidate's
protocol (its registered checkpoint downloaded, the candidate's prepared held-out rows), unless
`registry.gate.remeasure_champion` is off or that cannot be done (the rows are not on this machine, a
DFlash acceptance figure): then the figure is NaN and the note names the version and what differs,
and the gate refuses to promote. The re-measure loads the champion with the registering run's own
settings (`model.trust_remote_code` included: the caller's recipe, never the champion's record).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

PROTOCOL_TAG = "eval.protocol"


@dataclass(frozen=True)
class ChampionFigure:
    value: float  # the champion's gated metric under the candidate's protocol; NaN = none comparable
    note: str  # "" when its recorded figure compares as it is; else how it was obtained or why not


def recorded_protocol(protocol: dict[str, Any]) -> str:
    """The `eval.protocol` tag of a version gated on `protocol`: its fingerprint as sorted JSON."""
    from dllmflow.evaluation.protocol import protocol_fingerprint

    return json.dumps(protocol_fingerprint(protocol), sort_keys=True)


def champion_figure(settings: Any, champion: Any, protocol: dict[str, Any], metric: str) -> ChampionFigure:
    """`champion` (a ModelVersion)'s `metric` comparable with a candidate measured under `protocol`."""
    from dllmflow.evaluation.protocol import protocol_differences

    value = _number(champion.tags.get(f"eval.{metric}"))
    recorded = champion.tags.get(PROTOCOL_TAG)
    differs = protocol_differences(protocol, json.loads(recorded)) if recorded else ["no protocol recorded"]
    if not differs and math.isfinite(value):
        return ChampionFigure(value, "")
    who = f"champion v{champion.version}"
    why = (
        f"{who} was measured under another protocol ({'; '.join(differs)})"
        if differs
        else f"{who} has no {metric} figure (missing or NaN)"
    )
    if not settings.registry.gate.remeasure_champion:
        return ChampionFigure(math.nan, f"{why}; registry.gate.remeasure_champion is off")
    try:
        value = remeasure(settings, champion, protocol, metric)
    except UserError as e:
        return ChampionFigure(math.nan, f"{why}; re-measuring it under this version's protocol failed: {e}")
    return ChampionFigure(value, f"{why}; re-measured under this version's protocol: {metric} {value:.4f}")


def _number(text: str | None) -> float:
    try:
        return float(text) if text is not None else math.nan
    except ValueError:
        return math.nan


def remeasure(settings: Any, champion: Any, protocol: dict[str, Any], metric: str) -> float:
    """Evaluate the registered `champion` under `protocol` (an `evaluate` protocol: its rows, sampler
    and setting); UserError when that cannot be done here or does not reproduce the protocol."""
    from dllmflow.evaluation.accuracy import evaluate
    from dllmflow.evaluation.protocol import protocol_differences
    from dllmflow.inference.resolved import resolve

    missing = [k for k in ("prepared_dir", "split", "sampler", "sampler_settings") if not protocol.get(k)]
    if missing:
        raise UserError(f"this version's protocol does not record {', '.join(missing)}")
    if protocol["sampler"] in ("acceptance", "ar"):
        raise UserError(f"a {protocol['sampler']} figure is not re-measured by the gate")
    with tempfile.TemporaryDirectory(prefix="dllmflow-champion-") as tmp:
        checkpoint = resolve(download_checkpoint(champion.name, champion.version, tmp))
        result = evaluate(
            checkpoint, settings, sampler=protocol["sampler"], split=protocol["split"],
            limit=protocol.get("limit"), overrides=dict(protocol["sampler_settings"]),
            prepared_dir=protocol["prepared_dir"],
        )  # fmt: skip
    differs = protocol_differences(protocol, result["protocol"])
    if differs:
        raise UserError(f"its evaluation here still differs ({'; '.join(differs)})")
    return float(result["metrics"].get(metric, math.nan))


def download_checkpoint(name: str, version: str | int, dst: str | Path | None = None) -> Path:
    """The consolidated checkpoint of registered version `name`/`version` (its pyfunc's `checkpoint`
    artifact, tracking/registry.py), downloaded under `dst` (None = MLflow's temp dir)."""
    import mlflow
    import yaml

    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}/{version}", dst_path=str(dst) if dst is not None else None
        )
    )
    mlmodel = yaml.safe_load((local / "MLmodel").read_text()) or {}
    artifacts = mlmodel.get("flavors", {}).get("python_function", {}).get("artifacts", {})
    if "checkpoint" not in artifacts:
        raise UserError(f"models:/{name}/{version} is not a dllmflow model (no `checkpoint` artifact)")
    return local / artifacts["checkpoint"]["path"]
