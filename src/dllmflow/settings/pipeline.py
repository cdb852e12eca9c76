"""Settings sections of the stages around training: `eval` (samplers, caches, the accuracy-speed sweep),
`registry` (the champion gate), `flow` (project, schedule) and `regenerate` (DFlash data). Same rules as
`sections.py`: frozen pydantic models, `extra="forbid"`, no inf/NaN, defaults here. Imports no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from .sections import BatchRows, ResourcesConfig, SafeName, Section, Tokens

__all__ = [
    "AR_CONTROL",
    "ARControlConfig",
    "CACHE_MODES",
    "CacheMode",
    "EvalConfig",
    "FlowConfig",
    "RegenerateConfig",
    "RegistryConfig",
    "SWEEP_KEYS",
    "SweepGrid",
]


# A sampler's KV cache, the one `cache` setting (docs/strategies.md §3.0 "Caches"): none; exact (llada2,
# nemotron, idlm, ar: causal or block-causal attention keeps every cached key final, so the tokens are
# the uncached ones); Fast-dLLM's approximate caches of the bidirectional samplers (llada, scdd), the
# committed prefix or prefix and suffix ("dual"), refreshed per block. Each sampler takes some of them.
CacheMode = Literal["none", "exact", "prefix", "dual"]
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)

# The sampler settings a sweep may vary, in the order a point is written.
SWEEP_KEYS = ("threshold", "cache", "steps", "block_size")
MAX_SWEEP_POINTS = 64


def _distinct(values: list | None) -> list | None:
    if values is not None and (not values or len(set(values)) != len(values)):
        raise ValueError("must be a non-empty list without repeats (or leave the key out)")
    return values


class SweepGrid(Section):
    """`eval.sweep`: the grid of sampler settings evaluated per sampler (every combination), each point
    scored for exact match and speed; the flow registers the fastest point within `eval.sweep_tolerance`
    of the best exact match. `null` in a list = the sampler's preset (llada: no threshold). A key a
    sampler does not take is dropped for that sampler (as an eval knob is); one no evaluated sampler
    takes is an error naming `eval.sweep.<key>`."""

    threshold: Annotated[
        list[Annotated[float, Field(gt=0.0, le=1.0)] | None] | None, AfterValidator(_distinct)
    ] = None
    cache: Annotated[list[CacheMode] | None, AfterValidator(_distinct)] = None
    steps: Annotated[list[PositiveInt] | None, AfterValidator(_distinct)] = None
    block_size: Annotated[list[PositiveInt] | None, AfterValidator(_distinct)] = None

    def axes(self) -> dict[str, list]:
        """The swept keys and their values, in `SWEEP_KEYS` order."""
        return {k: list(getattr(self, k)) for k in SWEEP_KEYS if getattr(self, k) is not None}

    @model_validator(mode="after")
    def _small_grid(self) -> SweepGrid:
        axes = self.axes()
        if not axes:
            raise ValueError(f"give at least one of {', '.join(SWEEP_KEYS)} (each a list of values)")
        n = 1
        for values in axes.values():
            n *= len(values)
        if n > MAX_SWEEP_POINTS:
            raise ValueError(f"{n} points; at most {MAX_SWEEP_POINTS} (each point is a full evaluation)")
        return self


AR_EVALUATION = "ar"  # the flow's evaluation of the AR base model (`eval.ar_baseline`), beside the samplers
AR_CONTROL = (
    "ar_control"  # the flow's evaluation of the AR control (`eval.ar_control`): the base fine-tuned AR
)

# Base models that are not causal LMs (the name of a hub id or a local config.json's model_type): an AR
# control cannot fine-tune them next-token (a natively bidirectional LLaDA, DiffusionGemma's
# encoder-decoder, a dLLM checkpoint such as Nemotron-Labs-Diffusion or Dream).
NON_CAUSAL_BASES = ("llada", "diffusiongemma", "diffusion_gemma", "labs-diffusion", "dream")


class ARControlConfig(Section):
    """`eval.ar_control`: beside the dLLM run, the flow fine-tunes the base causal LM next-token (mode
    `ar`) on the same prepared rows with the same optimizer settings and step budget, evaluates it on
    the same prompts with the same answer parser, and reports both side by side (results table, card,
    MLflow run and registered version: exact match, seconds per answer at batch 1, tokens/s at batch 16,
    training tokens and seconds). The budget is optimizer steps; both arms' wall seconds and tokens are
    recorded so a reader sees the compute each spent."""

    enabled: bool = True
    steps: int | None = Field(
        None,
        description="The control's optimizer steps; null = train.max_steps (the dLLM's budget). Set it for "
        "equal compute when a dLLM step costs more than an AR step (I-DLM: about 2x).",
    )
    max_em_gap: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Gate: the dLLM's exact match must be >= the control's minus this (0.01 = 1 point) "
        "for the version to become champion; null = reported, not gated.",
    )

    @field_validator("steps")
    @classmethod
    def _trains(cls, steps: int | None) -> int | None:
        if steps is not None and steps < 1:
            raise ValueError(
                f"{steps} steps leave the AR control untrained; give at least 1, or null for train.max_steps"
            )
        return steps

    def check(self, dllm: Any, model: Any) -> None:
        """The mode and the base model can be fine-tuned causally (ValueError naming the field and why)."""
        if not self.enabled:
            return
        refusal = getattr(dllm, "ar_control_refusal", None)
        if refusal is not None:
            raise ValueError(
                f"eval.ar_control cannot run with dllm.mode={dllm.mode}: {refusal}; remove eval.ar_control"
            )
        base = non_causal_base(model)
        if base is not None:
            raise ValueError(
                f"eval.ar_control: model.pretrained_model_name_or_path {model.pretrained_model_name_or_path!r} "
                f"is {base}, not a causal LM the control can fine-tune next-token; remove eval.ar_control "
                "(the control needs the AR model a dLLM was converted from)"
            )


def non_causal_base(model: Any) -> str | None:
    """Why `model` (the `model:` section) is no causal LM, or None: a tiny model is a causal decoder; a
    pretrained one is judged by its local config.json's model_type, else its hub id (`NON_CAUSAL_BASES`)."""
    name = model.pretrained_model_name_or_path
    if name is None:
        return None
    config = Path(name) / "config.json"
    what = name.lower()
    if config.is_file():
        try:
            what = str(json.loads(config.read_text()).get("model_type", what)).lower()
        except (OSError, ValueError):
            pass
    hit = next((n for n in NON_CAUSAL_BASES if n in what), None)
    return f"a non-causal {hit} model" if hit is not None else None


class EvalConfig(Section):
    samplers: list[str] | None = Field(None, description="None = every sampler that fits the mode.")
    split: str = "eval"
    limit: PositiveInt | None = 32
    max_new_tokens: Tokens = 128
    steps: Tokens | None = None
    block_size: Tokens | None = None
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    cache: CacheMode | None = Field(
        None,
        description="KV cache of the samplers that take that mode (none; exact: llada2, nemotron, idlm; "
        "Fast-dLLM prefix/dual: llada, scdd prefix); the others run with their preset. None = each sampler's "
        "preset. Refused if no evaluated sampler can use it.",
    )
    temperature: NonNegativeFloat | None = None
    batch_positions: PositiveInt | None = Field(
        None,
        description="selfspec: most positions a forward after the prompt's feeds across the live rows "
        "(fewer drafts while the batch is large; None = no cap). Refused if no evaluated sampler takes it.",
    )
    draft_schedule: Literal["fixed", "adaptive"] | None = Field(
        None,
        description="selfspec: drafts per forward, fixed (block_size - 1) or adaptive (following the last "
        "check's acceptance); None = the preset. Refused if no evaluated sampler takes it.",
    )
    lookup_ngram: NonNegativeInt | None = Field(
        None,
        description="selfspec: drafts copied from the prompt and answer so far where the last n tokens "
        "recurred (prompt lookup; 0 = off); None = the preset. Refused if no evaluated sampler takes it.",
    )
    slot_groups: PositiveInt | None = Field(
        None,
        description="selfspec: groups of [MASK] slots per forward (1: after the last draft; 2: also right "
        "after the pending token; block_size: after each draft); None = the preset. Refused if no evaluated "
        "sampler takes it.",
    )
    n_shot: NonNegativeInt = 0
    batch_size: BatchRows = 8
    seed: int = 0
    untrained_baseline: bool = Field(
        False,
        description="Also evaluate the model as built before training (each sampler, same examples): a tiny "
        "model's same-seed untrained twin, a pretrained one converted but not fine-tuned. Shown as 'EM "
        "before' in the results table and card. Doubles evaluate's time.",
    )
    ar_baseline: bool = Field(
        False,
        description="Also evaluate the AR base model (`model`, before conversion) decoding greedily on the "
        "same examples with the same answer parser: the flow's `ar` evaluation (evaluation/ar_baseline.py).",
    )
    ar_control: ARControlConfig | None = Field(
        None,
        description="Train and evaluate the AR control beside the dLLM (same rows, optimizer, step budget, "
        "prompts, parser) and report both side by side; `{}` turns it on with the defaults.",
    )
    sweep: SweepGrid | None = Field(
        None,
        description="Grid of sampler settings (threshold, cache, steps, block_size) evaluated per sampler; "
        "the model is registered at the fastest point within sweep_tolerance of the best exact match. "
        "Each point is a full evaluation: keep it small.",
    )
    sweep_tolerance: float = Field(
        0.01, ge=0.0, le=1.0, description="Exact match a faster sweep point may give up (0.01 = 1 point)."
    )


class GateConfig(Section):
    """When `champion` may move to a new version. Below the absolute floor of its metric a version is
    registered (alias `candidate`) but never becomes champion, the first one included: `min_accuracy`
    for an accuracy metric (exact_match_*), `min_tau` when the metric is `tau` (DFlash's mean acceptance
    length, 1.0 = the draft never helps; `dllmflow.tracking.registry.gate_floor`)."""

    metric: str = "exact_match_flexible"
    tolerance: NonNegativeFloat = Field(
        0.0, description="New accuracy may be this much below the champion's."
    )
    min_tokens_per_s: NonNegativeFloat = Field(
        0.0,
        description="Speed floor (tokens/s) of the gated sampler at the setting it is registered with "
        "(the chosen `eval.sweep` point when there is a sweep); 0 = off.",
    )
    min_accuracy: float = Field(
        0.05, ge=0.0, le=1.0, description="Accuracy floor: below it a version is never champion."
    )
    min_tau: float = Field(
        1.1, ge=1.0, description="Floor when metric is tau: >= 1 accepted draft token per 10 target forwards."
    )
    remeasure_champion: bool = Field(
        True,
        description="A champion measured under another protocol (held-out rows, limit, sampler setting, "
        "length, parser) or without the metric is evaluated again under the candidate's; off = refuse.",
    )


class RegistryConfig(Section):
    tracking_uri: str | None = Field(
        None, description="None = MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db"
    )
    experiment_name: str = Field("dllmflow", min_length=1, max_length=500, description="MLflow's limits.")
    model_name: SafeName = "dllmflow-tiny"
    gate: GateConfig = Field(default_factory=GateConfig)
    live_tracking: bool = Field(
        True, description="Rank 0 logs training metrics into the MLflow run while training (batched)."
    )
    system_metrics: bool = Field(
        False, description="Also log MLflow system metrics (CPU, memory, GPU) from the trainer."
    )
    flush_every_s: PositiveFloat = Field(5.0, description="Live tracking: send buffered metrics this often.")
    flush_timeout_s: NonNegativeFloat = Field(
        30.0, description="How long the end of training waits for an unreachable tracking server."
    )


_CRON_FIELDS = (  # (name, low, high, names) of the 5 standard fields, then AWS's optional year
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    ("day of week", 0, 7, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
    ("year", 1970, 2199, ()),
)
_CRON_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_CRON_ITEM = re.compile(r"(\*|\?|(\w+)(?:-(\w+))?)(?:/(\d+))?")


def check_cron(value: str | None) -> str | None:
    """A cron Argo's CronWorkflow accepts: 5 fields (minute hour day-of-month month day-of-week), or
    the 6-field AWS form Metaflow documents (its trailing year is dropped for Argo), or a @daily-style
    macro. Checked here so a typo fails when the recipe is parsed, not when the CronWorkflow is applied."""
    if value is None or value.strip() in _CRON_MACROS:
        return value
    fields = value.split()
    if len(fields) not in (5, 6):
        raise ValueError(
            f"{value!r} has {len(fields)} fields; a cron has 5: minute hour day-of-month month "
            "day-of-week, e.g. '0 3 * * *' (daily 03:00 UTC)"
        )
    for text, (name, low, high, names) in zip(fields, _CRON_FIELDS):
        for item in text.split(","):
            m = _CRON_ITEM.fullmatch(item.upper())
            if m is None or (m.group(1) == "?" and name not in ("day of month", "day of week")):
                raise ValueError(f"{value!r}: bad {name} field {text!r}")
            for part in filter(None, m.group(2, 3)):
                number = names.index(part) + low if part in names else part  # JAN=1, SUN=0
                if not str(number).isdigit() or not low <= int(number) <= high:
                    raise ValueError(f"{value!r}: {name} {part!r} is not in {low}-{high}")
    return value


def check_project_name(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9_]{1,128}", value):
        raise ValueError(f"{value!r}: a Metaflow @project name is 1-128 of a-z, 0-9 and '_', e.g. 'dllmflow'")
    return value


class FlowConfig(Section):
    """Production knobs for the flows (schedule, project, train step resources, retries)."""

    schedule_cron: Annotated[str | None, AfterValidator(check_cron)] = Field(
        None, description="Cron of the Argo CronWorkflow, e.g. '0 3 * * *'; None = no schedule."
    )
    schedule_timezone: str | None = Field(None, description="IANA timezone of the cron (Argo); None = UTC.")
    project: Annotated[str, AfterValidator(check_project_name)] = Field(
        "dllmflow", description="Metaflow @project: deployments are named <project>.<branch>.<Flow>."
    )
    train_retries: NonNegativeInt = 1
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig,
        description="The train step's own resources when it only submits to a cluster scheduler; with a "
        "local scheduler the step runs the trainers and requests launch.resources x launch.nnodes.",
    )


class RegenerateConfig(Section):
    """DFlash data regeneration (`dllmflow regenerate`): defaults of its flags."""

    input_data: str | None = None
    output_dir: str = "data/regenerated"
    target_server: str | None = Field(None, description="None = start a local `dllmflow serve`.")
    model: str | None = None
    messages_column: str = "messages"
    split: str = "train"
    dataset_name: str | None = None
    shuffle_seed: int | None = None
    shard_size: PositiveInt = 1000
    concurrency: PositiveInt = 32
    max_new_tokens: Tokens = 1024
    temperature: NonNegativeFloat = 0.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(
        None, description="Seeds each request (OpenAI `seed`, from this and the row index); None = unseeded."
    )
    timeout_s: float = Field(600.0, gt=0.0)
    max_retries: NonNegativeInt = 3
    reasoning: Literal["none", "save", "disable"] = "none"
