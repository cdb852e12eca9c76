"""Settings sections other than `dllm:`: model, tokenizer, dataset, train, checkpoint, launch, eval,
registry, flow, regenerate, peft (LoRA). Each is a frozen pydantic `BaseModel` with `extra="forbid"` and
`allow_inf_nan=False` (an `inf` learning rate would pass `gt=0` and train to NaN); defaults live here,
YAML under `params/` only overrides them. Imports no torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

__all__ = [
    "CheckpointConfig",
    "DatasetConfig",
    "DistributedConfig",
    "CACHE_MODES",
    "CacheMode",
    "EvalConfig",
    "FlowConfig",
    "LaunchConfig",
    "ModelConfig",
    "PeftSection",
    "RegenerateConfig",
    "RegistryConfig",
    "SWEEP_KEYS",
    "SweepGrid",
    "TinyModelConfig",
    "TokenizerConfig",
    "TrainConfig",
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_safe_name(value: str) -> str:
    """A name that becomes a directory (`runs/<name>`) and an MLflow name: no path separator and no
    leading '.' (so never '.' or '..'), none of what MLflow rejects in registered model names ('/',
    ':', '%', whitespace-only) and no '@' (it splits `models:/<name>@<alias>` URIs)."""
    if not _SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a safe name: use letters, digits, '_', '.' and '-', not starting "
            "with '.' (it becomes a directory and an MLflow name), e.g. 'tiny-mdlm_v2'"
        )
    return value


# Run names and registered model names.
SafeName = Annotated[str, AfterValidator(check_safe_name)]


class TinyModelConfig(Section):
    """A randomly initialised decoder built from a transformers config (tests and the CPU demo)."""

    architecture: Literal["qwen3", "llama"] = "qwen3"
    hidden_size: PositiveInt = 64
    num_hidden_layers: PositiveInt = 2
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 128
    max_position_embeddings: PositiveInt = 2048
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class ModelConfig(Section):
    """What to train: a hub id / local dir (`from_pretrained`) or a tiny random config."""

    pretrained_model_name_or_path: str | None = Field(
        None, description="Hub id or local directory; unset = build `tiny` from its config."
    )
    tiny: TinyModelConfig | None = None
    gguf_file: str | None = Field(
        None, description="GGUF file inside the model dir (e.g. SmolLM2 from PyPI)."
    )
    trust_remote_code: bool = False
    torch_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Master-weight dtype."
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = "sdpa"
    # Family-specific knobs forwarded to the model config (Nemotron-Labs-Diffusion, DiffusionGemma).
    dlm_paradigm: str | None = None
    block_size: PositiveInt | None = None
    canvas_length: PositiveInt | None = None
    self_conditioning: bool = True
    freeze_router: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.pretrained_model_name_or_path is None and self.tiny is None:
            raise ValueError("set model.pretrained_model_name_or_path or model.tiny")
        if self.pretrained_model_name_or_path is not None and self.tiny is not None:
            raise ValueError("model.pretrained_model_name_or_path and model.tiny are exclusive")
        return self


class TokenizerConfig(Section):
    """Any HF tokenizer by id/path, or a byte-level BPE trained on the training text."""

    name_or_path: str | None = Field(None, description="HF id or dir; unset = the model's, else train a BPE.")
    train_vocab_size: PositiveInt = Field(
        512, ge=64, description="Vocabulary of the trained BPE (incl. specials)."
    )
    mask_token: str = "<mask>"
    pad_token: str = "<pad>"
    eos_token: str = "<eos>"
    chat_template: str | None = Field(
        None, description="Jinja chat template override (with {% generation %})."
    )


DataFormat = Literal["auto", "messages", "prompt_completion", "alpaca", "text"]


class MixtureSource(Section):
    """One source of `dataset.mixture` (docs/data_formats.md)."""

    path: str = Field(description="Like dataset.path_or_dataset_id: embedded:NAME, file/dir, or HF id.")
    weight: NonNegativeFloat = 1.0
    format: DataFormat = "auto"
    fields: dict[str, str] = Field(default_factory=dict)
    split: str = "train"
    dataset_name: str | None = None


class DatasetConfig(Section):
    """Rows in (chat, prompt/completion, Alpaca or raw text), tokenised parquet shards out (`dllmflow prepare`)."""

    path_or_dataset_id: str = Field(
        "embedded:gsm8k",
        description="'embedded:gsm8k' / 'embedded:addition', a JSONL/parquet file or dir, or a HF dataset id.",
    )
    split: str = "train"
    dataset_name: str | None = None
    messages_column: str = "messages"
    format: DataFormat = Field("auto", description="Row format; auto = detected per row from its fields.")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Format field -> column, e.g. {prompt: question, completion: answer}.",
    )
    mixture: list[MixtureSource] | None = Field(
        None, description="Weighted sources, sampled by `seed`; replaces path_or_dataset_id when set."
    )
    mixture_rows: PositiveInt | None = Field(
        None, description="Rows drawn from the mixture; None = as many as fit without repeating a row."
    )
    seed: int = Field(0, description="Seed of the mixture sampling.")
    unshifted: bool = Field(True, description="Must be true for dLLM training (no next-token shift).")
    mask_history: bool = Field(True, description="Supervise only the final assistant turn.")
    seq_length: PositiveInt = 256
    eval_fraction: float = Field(0.25, ge=0.0, lt=1.0, description="Held-out share (hash of the question).")
    limit: PositiveInt | None = Field(None, description="Keep at most this many training rows.")
    shard_size: PositiveInt = 1000
    prepared_dir: str = "data/prepared/tiny"
    drop_truncated: bool = Field(True, description="Drop rows whose response does not fit seq_length.")
    max_row_bytes: PositiveInt = Field(
        8 << 20, description="A JSONL line longer than this is dropped as malformed before it is parsed."
    )
    packing: bool = Field(
        False,
        description="Pack several rows into each training sequence of seq_length; tokens attend only within "
        "their row (mdlm, scdd; docs/strategies.md §1.8).",
    )
    packing_overflow: Literal["truncate", "drop"] = Field(
        "truncate",
        description="A row longer than seq_length once block-filled, when packing: cut there, or left out.",
    )

    def check_packing(self, dllm: Any) -> None:
        """`dataset.packing` against the mode (its config's `packing_refusal`, None = packable) and the
        padding rule: a packed batch has no per-row padding tail to supervise."""
        if not self.packing:
            return
        refusal = getattr(dllm, "packing_refusal", "it declares no packing support")
        if refusal is not None:
            raise ValueError(
                f"dataset.packing: true is not supported by dllm.mode={dllm.mode} ({refusal}); "
                "set dataset.packing: false (packing trains modes mdlm and scdd)"
            )
        if dllm.supervise_padding:
            raise ValueError(
                "dataset.packing: true has no padding tail to supervise; set dllm.supervise_padding: false "
                "or dataset.packing: false"
            )

    @model_validator(mode="after")
    def _unshifted(self) -> DatasetConfig:
        if not self.unshifted:
            raise ValueError("dataset.unshifted must be true for dLLM training")
        if self.mixture is not None and not sum(m.weight for m in self.mixture) > 0:
            raise ValueError(
                "dataset.mixture: the weights must sum to a positive number (give a source weight > 0)"
            )
        return self


class TrainConfig(Section):
    seed: int = 42
    max_steps: PositiveInt = 50
    global_batch_size: PositiveInt = 8
    local_batch_size: PositiveInt = 4
    lr: float = Field(1e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32",
        description="Compute dtype: bfloat16 = FSDP2 mixed precision (fp32 reduce) or autocast; "
        "master weights stay in model.torch_dtype. float64 (CPU only): the whole model in float64, "
        "the golden-trajectory reference.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Recompute decoder blocks in backward: every block (full) or every other one."
    )
    compile: bool = Field(False, description="torch.compile each decoder block.")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="aot_eager where inductor cannot build (no C++ compiler)."
    )
    log_every: PositiveInt = Field(
        10, description="Console line every N steps (metrics.jsonl records every step)."
    )
    peak_tflops: float | None = Field(None, gt=0.0, description="Per-device peak; enables the mfu metric.")
    num_workers: NonNegativeInt = 0
    max_nonfinite_skips: NonNegativeInt = Field(
        0, description="Steps with a NaN/inf loss or grad norm to skip (no update) before the run fails."
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_autocast_dtype(cls, data: Any) -> Any:
        if isinstance(data, dict) and "autocast_dtype" in data:
            raise ValueError(
                "train.autocast_dtype was removed: set train.dtype: bfloat16 (FSDP2 mixed precision on "
                "GPUs, autocast on one process)"
            )
        return data


class PeftSection(Section):
    """LoRA adapters (peft) on the trainable model: the section's presence turns LoRA on (`enabled: false`
    turns a recipe's section off, e.g. `DLLMFLOW_PEFT__ENABLED=false`). Applied by
    `dllmflow.models.lora.apply_lora` after the build and before DDP/FSDP2; only the adapters and
    `modules_to_save` train. A model whose tokenizer gained tokens (a new <mask>) may need its embeddings
    trained too: list them in `modules_to_save` (e.g. [embed_tokens, lm_head])."""

    enabled: bool = True
    r: PositiveInt = 16
    alpha: float = Field(32.0, gt=0.0, description="lora_alpha; the update is scaled by alpha / r.")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="> 0 draws from the global RNG: resume-exact, not world-size independent.",
    )
    target_modules: list[str] | None = Field(
        None,
        description="Linear module names (or dotted suffixes); None = the family's attention + MLP projections.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full next to the adapters (e.g. embed_tokens)."
    )
    parts: list[Literal["decoder", "encoder"]] | None = Field(
        None,
        description="Encoder-decoder models (block_diffusion): where adapters go; None = both (one shared adapter).",
    )

    @field_validator("target_modules", "parts")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(value) or len(set(value)) != len(value)):
            raise ValueError("must be a non-empty list of names without repeats (or null for the default)")
        return value


class CheckpointConfig(Section):
    every_steps: PositiveInt = 25
    keep_last: PositiveInt = 2
    save_consolidated: Literal["final", "every", "false"] = "final"
    remote_dir: str | None = Field(
        None,
        description="Object-store mirror of the checkpoints (s3://bucket/runs/<name>): every published step "
        "dir and LATEST are uploaded, and a resume restores each node's step dir from it, so nodes need "
        "no shared volume (training/storage.py; endpoint from DLLMFLOW_S3_ENDPOINT_URL or AWS_ENDPOINT_URL).",
    )


class DistributedConfig(Section):
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class ResourcesConfig(Section):
    cpu: PositiveInt = 2
    gpu: NonNegativeInt = 0
    memory_mb: PositiveInt = 8192


class LaunchConfig(Section):
    """How `dllmflow train` starts torchrun through torchx."""

    scheduler: str = Field("local_cwd", description="torchx scheduler: local_cwd, kubernetes, slurm, ...")
    nnodes: PositiveInt = 1
    nproc_per_node: PositiveInt = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = Field(
        None, description="host:port; None = a free port on 127.0.0.1 (local), the rank-0 host (cluster)."
    )
    max_restarts: NonNegativeInt = 0
    image: str = "dllmflow:latest"
    env: dict[str, str] = Field(default_factory=dict)
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig, description="Per node (torchx replica): cpu, gpu, memory_mb."
    )
    mounts: list[str] = Field(
        default_factory=list,
        description="torchx mounts, one per entry, e.g. 'type=volume,src=dllmflow-runs,dst=/app/runs'.",
    )
    scheduler_args: dict[str, str] = Field(
        default_factory=dict, description="torchx scheduler cfg (queue, ...)."
    )


# Fast-dLLM approximate KV caches of the bidirectional samplers (llada, scdd): none, the committed
# prefix, or prefix and suffix ("dual"), refreshed per block. Samplers with an exact cache (llada2, idlm)
# turn it off with `no_kv_cache` instead.
CacheMode = Literal["none", "prefix", "dual"]
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

    threshold: Annotated[list[Annotated[float, Field(gt=0.0, le=1.0)] | None] | None, AfterValidator(_distinct)] = None
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


class EvalConfig(Section):
    samplers: list[str] | None = Field(None, description="None = every sampler that fits the mode.")
    split: str = "eval"
    limit: PositiveInt | None = 32
    max_new_tokens: PositiveInt = 128
    steps: PositiveInt | None = None
    block_size: PositiveInt | None = None
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    cache: CacheMode | None = Field(
        None,
        description="KV cache of the samplers that take one (llada, scdd: Fast-dLLM prefix/dual); the "
        "others run as they are. None = each sampler's preset. Refused if no evaluated sampler can use it.",
    )
    temperature: NonNegativeFloat | None = None
    n_shot: NonNegativeInt = 0
    batch_size: PositiveInt = 8
    seed: int = 0
    untrained_baseline: bool = Field(
        False,
        description="Tiny random models only: also evaluate the same-seed untrained model (each sampler, "
        "same examples), shown as 'EM untrained' in the results table and card. Doubles evaluate's time.",
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
    max_new_tokens: PositiveInt = 1024
    temperature: NonNegativeFloat = 0.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    timeout_s: float = Field(600.0, gt=0.0)
    max_retries: NonNegativeInt = 3
    reasoning: Literal["none", "save", "disable"] = "none"
