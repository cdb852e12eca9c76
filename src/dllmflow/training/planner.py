"""Plan training memory per rank before launching: exact parameter counts, a documented activation formula.

    dllmflow plan --params params/qwen3_8b_idlm.yaml --world-size 8 --device-memory-gib 141
    from dllmflow.training.planner import plan_memory
    plan = plan_memory(settings, world_size=8); print(plan.table()); plan.fits(141 * 2**30)

1) Parameters are counted exactly on the skeleton the trainer builds: the mode's `build_model` (the
   mode's builder in `diffusion/modes.py`) under `models.meta.build_on_meta`, then `apply_lora`. No weight
   is read and nothing is downloaded: a pretrained model contributes only its `config.json` (local dir or
   the HF cache); a hub id without one fails naming the field. The tokenizer is the prepared one
   (`dataset.prepared_dir/tokenizer`), else the configured pretrained one, else a stand-in with
   `tokenizer.train_vocab_size` tokens (what the trained BPE reaches on real data).
2) Per rank, with P parameters (T trainable), W ranks, m = bytes of `model.torch_dtype`, c = bytes of
   `train.dtype`: weights P·m (ddp) or P·m/W (fsdp2); gradients T·m (/W under fsdp2); AdamW 2 fp32 states
   8·T (/W). FSDP2 also holds unsharded compute copies (c bytes) of the root's own parameters (embeddings,
   head) and of two blocks (current + prefetched), plus one block's fp32 gradient before reduce-scatter.
3) Activations (`activation_bytes`), per token of the micro-batch (`train.local_batch_size` x
   `dataset.seq_length`), for a dense decoder block with SDPA (no s x s matrix stored, no dropout):
   elements = 4h (two RMSNorms: input + normalised) + 5q + 5kv (q/k before and after their per-head norms,
   q/k/v into SDPA, SDPA's output and o_proj's contiguous copy of it) + 4i (gate, up, act(gate), act·up),
   times c bytes, plus the norms' fp32 upcast (2h·4 bytes when c = 2). This is Korthikanti et al.'s
   s·b·h·34 (fp16 bytes, GPT 4h MLP) re-derived for Qwen3's SwiGLU + GQA + qk-norm, without the 5·a·s/h
   attention-matrix term. AC `full` keeps only each block's input (h·c) plus, in backward, one block
   recomputed; `selective` checkpoints every other block. Outside the blocks: the embedding output (h·c)
   and the logits, s·b·V in c bytes, plus the fp32 copy the loss reads (s·b·V·4, when c = 2) and, in
   backward, their fp32 gradient (s·b·V·4). Modes scale this (`MODE_ACTIVATIONS`: idlm's [x_t | x_0]
   doubles the sequence, hybrid runs two forwards); dflash adds its frozen target (`FROZEN_TERMS`).
   Checked against bench/memory.py (docs/memory_planner.md).
4) Peak per rank = weights + optimizer + max(activations, gradients) + transients: activations are freed
   through backward while the gradients appear. The first step (no optimizer state yet) peaks at
   max(activations + transients, gradients + optimizer) above the weights (`first_step_above_weights`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError
from dllmflow.models.skeletons import local_config, offline_skeletons

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelShape:
    """What the activation formula needs of the trainable model (its text config + block count)."""

    hidden: int
    intermediate: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # kv heads x head_dim
    num_blocks: int
    vocab: int


@dataclass(frozen=True)
class ModelCount:
    params: int
    trainable: int
    block_params: int  # the largest decoder block (an FSDP2 unit)
    root_params: int  # parameters outside the blocks (embeddings, head, final norm)
    shape: ModelShape
    frozen_params: int = 0  # a frozen replicated model next to it (dflash target)
    frozen_bytes: int = 0
    frozen_shape: ModelShape | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActivationShape:
    """How a mode's micro-batch turns into forward tokens: seq x seq_factor, `passes` forwards kept."""

    seq_factor: int = 1
    passes: int = 1


# Modes absent from the table (plugins) are planned as one forward over the sequence.
MODE_ACTIVATIONS: dict[str, ActivationShape] = {
    "mdlm": ActivationShape(),
    "scdd": ActivationShape(),
    "idlm": ActivationShape(seq_factor=2),  # [x_t | x_0]
    "block_causal": ActivationShape(),  # one pass over L (one drawn block per row, not [x_t | x_0])
    "hybrid": ActivationShape(passes=2),  # diffusion + causal forwards
    "block_diffusion": ActivationShape(),  # encoder and decoder blocks are both counted as blocks
    "dflash": ActivationShape(),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of one training configuration."""

    params: int
    trainable: int
    world_size: int
    strategy: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int  # FSDP2 unsharded copies + unreduced block grads
    frozen: int = 0  # frozen replicated model + its features (dflash)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> int:
        return (
            self.weights
            + self.optimizer
            + max(self.activations, self.gradients)
            + self.transient
            + self.frozen
        )

    @property
    def first_step_above_weights(self) -> int:
        """The first step's peak above the materialised model (no optimizer state before it)."""
        return max(self.activations + self.transient, self.gradients + self.optimizer) + self.frozen

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes

    def table(self, device_bytes: int | None = None) -> str:
        rows = [
            ("parameters", f"{self.params:,} ({self.trainable:,} trainable)"),
            ("ranks", f"{self.world_size} ({self.strategy})"),
            ("weights", _gib(self.weights)),
            ("gradients", _gib(self.gradients)),
            ("optimizer (AdamW)", _gib(self.optimizer)),
            ("activations", _gib(self.activations)),
            ("FSDP2 unsharded/transient", _gib(self.transient)),
        ]
        if self.frozen:
            rows.append(("frozen target + features", _gib(self.frozen)))
        rows.append(("peak per rank", _gib(self.peak)))
        if device_bytes is not None:
            verdict = "fits" if self.fits(device_bytes) else "does NOT fit"
            rows.append(("device memory", f"{_gib(device_bytes)}: {verdict}"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _gib(n: int) -> str:
    return f"{n / GIB:8.3f} GiB" if n >= GIB else f"{n / 2**20:8.1f} MiB"


# ---- 1) exact counts on the meta skeleton -----------------------------------------------------------


def count_model(settings) -> ModelCount:
    """Build the trainable model (and a dflash target) on the meta device and count it."""
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy
    from dllmflow.models import meta
    from dllmflow.models.lora import apply_lora

    with tempfile.TemporaryDirectory() as tmp, offline_skeletons() as sources:
        settings = _tiny_target_in(settings, tmp)
        tokenizer, note = planning_tokenizer(settings)
        strategy = build_strategy(settings)
        with meta.build_on_meta():
            model = apply_lora(build_mode_model(settings, tokenizer), settings)
        frozen = _frozen_target(settings, strategy, tokenizer)
    notes = ((note,) if note else ()) + tuple(f"config of {n}: {where}" for n, where in sources.items())
    return count_built(model, notes=notes, **frozen)


def count_built(model, **frozen: Any) -> ModelCount:
    """Count a built (meta or real) model: totals, trainable, its largest block and what is outside them."""
    from dllmflow.training.distributed import decoder_blocks

    blocks = list({id(b): b for b in decoder_blocks(model)}.values())
    params = _numel(model.parameters())
    return ModelCount(
        params=params,
        trainable=_numel(p for p in model.parameters() if p.requires_grad),
        block_params=max((_numel(b.parameters()) for b in blocks), default=0),
        root_params=params - _numel(p for b in blocks for p in b.parameters()),
        shape=model_shape(model, len(blocks)),
        **frozen,
    )


def _numel(params) -> int:
    # tied parameters (embedding = head) count once, as in sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def model_shape(model, num_blocks: int) -> ModelShape:
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # the config's own (majority-layer) values: per-layer configs (DiffusionGemma's global layers) refuse getattr
    own = cfg.to_dict()
    h = cfg.hidden_size
    heads = own.get("num_attention_heads") or cfg.num_attention_heads
    head_dim = own.get("head_dim") or h // heads
    kv = own.get("num_key_value_heads") or heads
    vocab = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return ModelShape(
        hidden=h,
        intermediate=getattr(cfg, "intermediate_size", None) or 4 * h,
        q_dim=heads * head_dim,
        kv_dim=kv * head_dim,
        num_blocks=num_blocks,
        vocab=vocab.weight.shape[0] if vocab is not None else cfg.vocab_size,
    )


def _frozen_target(settings, strategy, tokenizer) -> dict[str, Any]:
    """dflash: the frozen target's count, bytes (its own dtype, replicated) and shape; else nothing."""
    if settings.dllm.mode != "dflash" or settings.dflash is None:
        return {}
    from transformers import AutoModelForCausalLM

    from dllmflow.models import meta

    config = local_config(strategy.target_path(tokenizer), settings.model.trust_remote_code)
    with meta.build_on_meta():
        target = AutoModelForCausalLM.from_config(config)
    n = _numel(target.parameters())
    layers = config.get_text_config().num_hidden_layers
    return {
        "frozen_params": n,
        "frozen_bytes": n * DTYPE_BYTES[settings.dflash.target_torch_dtype],
        "frozen_shape": model_shape(target, layers),
    }


def _tiny_target_in(settings, tmp: str):
    """A `tiny:<dir>` dflash target that does not exist yet is built in a temp dir, not the working tree."""
    from dllmflow.models.dflash_target import TINY_TARGET_PREFIX

    target = getattr(settings.dflash, "target_model_id", None) or ""
    if (
        not target.startswith(TINY_TARGET_PREFIX)
        or Path(target[len(TINY_TARGET_PREFIX) :], "config.json").is_file()
    ):
        return settings
    dflash = settings.dflash.model_copy(update={"target_model_id": f"{TINY_TARGET_PREFIX}{tmp}/target"})
    return settings.model_copy(update={"dflash": dflash})


def planning_tokenizer(settings) -> tuple[Any, str | None]:
    """The prepared tokenizer, else the configured pretrained one, else a stand-in (and a note saying so):
    `tokenizer.train_vocab_size` tokens for a BPE not trained yet, the config's vocabulary for a
    pretrained model whose tokenizer is not local."""
    from dllmflow.data.tokenizer import build_tokenizer, load_tokenizer

    if (Path(settings.dataset.prepared_dir) / "tokenizer").is_dir():
        return load_tokenizer(settings.dataset.prepared_dir), None
    name = settings.tokenizer.name_or_path or settings.model.pretrained_model_name_or_path
    if name is None:
        size = settings.tokenizer.train_vocab_size
        return stand_in_tokenizer(settings.tokenizer, size), f"no prepared tokenizer: {size} tokens assumed"
    try:
        if Path(name).is_dir() and not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(f"{name}: no tokenizer files")  # transformers would build an empty one
        return build_tokenizer(settings, []), None
    except UserError:
        from dllmflow.models.shipped_configs import shipped_dir

        if settings.model.pretrained_model_name_or_path is None and shipped_dir(name) is None:
            # a tokenizer saved by a later stage (a bootstrapped tiny target) and a random model:
            # the BPE it will be bootstrapped from has tokenizer.train_vocab_size tokens
            size = settings.tokenizer.train_vocab_size
            note = f"tokenizer {name!r} not built yet: {size} tokens assumed"
            return stand_in_tokenizer(settings.tokenizer, size), note
        config = local_config(
            settings.model.pretrained_model_name_or_path or name, settings.model.trust_remote_code
        )
        size = config.get_text_config().vocab_size
        note = (
            f"tokenizer {name!r} is not local: the config's {size} tokens assumed (+ a mask token if needed)"
        )
        return stand_in_tokenizer(settings.tokenizer, size), note


def stand_in_tokenizer(tcfg, size: int):
    """A word-level tokenizer with exactly `size` tokens and the configured specials, for counting
    before any data is prepared."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from dllmflow.data.tokenizer import ROLE_TOKENS

    specials = [tcfg.pad_token, tcfg.eos_token, tcfg.mask_token, *ROLE_TOKENS]
    words = specials + [f"w{i}" for i in range(size - len(specials))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=tcfg.pad_token))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=tcfg.pad_token,
        eos_token=tcfg.eos_token,
        mask_token=tcfg.mask_token,
        additional_special_tokens=list(ROLE_TOKENS),
    )


# ---- 2) + 3) bytes per rank -------------------------------------------------------------------------


def block_activation_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """Bytes one dense decoder block keeps for backward, per token (SDPA, no dropout)."""
    elements = 4 * shape.hidden + 5 * shape.q_dim + 5 * shape.kv_dim + 4 * shape.intermediate
    upcast = 2 * shape.hidden * 4 if compute_bytes < 4 else 0  # RMSNorm's fp32 copies under bf16
    return elements * compute_bytes + upcast


def activation_bytes(
    shape: ModelShape, tokens: int, compute_bytes: int, ac: str, backward: bool = True
) -> int:
    """Activation bytes of one forward over `tokens` (batch x sequence), kept for backward. `backward`:
    a training step's peak (the block recomputed under AC, the logits' gradient); off: what one forward
    keeps (bench/memory.py's activation rows)."""
    per_block = block_activation_bytes(shape, compute_bytes)
    inputs = shape.hidden * compute_bytes  # a checkpointed block keeps only its input
    kept = {"none": shape.num_blocks, "full": 0, "selective": shape.num_blocks // 2}[ac]
    blocks = kept * per_block + (shape.num_blocks - kept) * inputs
    if backward and kept < shape.num_blocks:
        blocks += per_block  # the block being recomputed in backward
    logits = shape.vocab * (compute_bytes + (4 if compute_bytes < 4 else 0) + (4 if backward else 0))
    return tokens * (blocks + shape.hidden * compute_bytes + logits)


def plan_memory(settings, world_size: int | None = None, count: ModelCount | None = None) -> MemoryPlan:
    """Per-rank memory of `settings` on `world_size` ranks (default: the launch's)."""
    world = settings.world_size if world_size is None else world_size
    check_world_size(settings, world)
    count = count_model(settings) if count is None else count
    t, mode = settings.train, settings.dllm.mode
    notes = list(count.notes)
    if mode not in MODE_ACTIVATIONS:
        notes.append(f"mode {mode!r} is not in MODE_ACTIVATIONS: planned as one forward over the sequence")
    if settings.peft is not None and settings.peft.enabled:
        notes.append("LoRA: the adapters' own r-wide activations are not counted (small next to the blocks)")
    if settings.distributed.strategy == "ddp":
        notes.append("ddp: DDP's gradient buckets add about one more copy of the gradients")
    master, compute = DTYPE_BYTES[settings.model.torch_dtype], DTYPE_BYTES[t.dtype]
    act = MODE_ACTIVATIONS.get(mode, ActivationShape())
    return memory_plan(
        count,
        world=world,
        fsdp=settings.distributed.strategy == "fsdp2",
        master_bytes=master,
        compute_bytes=min(master, compute),  # bf16 master weights compute in bf16
        ac=t.activation_checkpointing,
        tokens=t.local_batch_size * settings.dataset.seq_length * act.seq_factor,
        passes=act.passes,
        frozen=FROZEN_TERMS[mode](settings, count) if mode in FROZEN_TERMS else 0,
        notes=tuple(notes),
    )


def memory_plan(
    count: ModelCount,
    *,
    world: int,
    fsdp: bool,
    master_bytes: int,
    compute_bytes: int,
    ac: str,
    tokens: int,
    passes: int = 1,
    frozen: int = 0,
    notes: tuple[str, ...] = (),
) -> MemoryPlan:
    """The plan from counts and knobs (what `plan_memory` reads from settings; bench/memory.py calls it)."""
    m, c = master_bytes, compute_bytes
    shard = world if fsdp else 1
    # 2) weights, gradients, optimizer (LoRA: only adapters have grads and state)
    transient = 0
    if fsdp:  # unsharded compute copies: the root's own params all step, two blocks in flight
        transient = (count.root_params + 2 * count.block_params) * c + count.block_params * 4
    return MemoryPlan(
        params=count.params,
        trainable=count.trainable,
        world_size=world,
        strategy="fsdp2" if fsdp else "ddp",
        weights=math.ceil(count.params * m / shard),
        gradients=math.ceil(count.trainable * m / shard),
        optimizer=math.ceil(count.trainable * ADAMW_STATE_BYTES / shard),
        # 3) activations of one micro-batch, scaled by the mode
        activations=passes * activation_bytes(count.shape, tokens, c, ac),
        transient=transient,
        frozen=frozen,
        notes=notes,
    )


def dflash_frozen_bytes(settings, count: ModelCount) -> int:
    """The frozen target (replicated, its dtype) and its no-grad forward: every layer's hidden state
    (output_hidden_states), then the concatenated chosen layers the draft reads."""
    shape = count.frozen_shape
    if shape is None:
        return 0
    d = DTYPE_BYTES[settings.dflash.target_torch_dtype]
    tokens = settings.train.local_batch_size * settings.dataset.seq_length
    chosen = len(settings.dflash.target_layer_ids or []) or min(shape.num_blocks, 5)
    return count.frozen_bytes + tokens * shape.hidden * d * (shape.num_blocks + 1 + chosen)


FROZEN_TERMS: dict[str, Callable[[Any, ModelCount], int]] = {"dflash": dflash_frozen_bytes}


def check_world_size(settings, world: int) -> None:
    """The settings' batch rule on `world` ranks: global = local x world x accumulation."""
    if world < 1:
        raise UserError(f"--world-size {world}: must be >= 1")
    gbs, lbs = settings.train.global_batch_size, settings.train.local_batch_size
    if gbs % (lbs * world):
        raise UserError(
            f"--world-size {world}: train.global_batch_size ({gbs}) must be a multiple of "
            f"train.local_batch_size x world size ({lbs} x {world}); change one of them"
        )


# ---- the `dllmflow plan` command ------------------------------------------------------------------


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", nargs="+", required=True, help="recipe YAML file(s), later override earlier")
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks (default: launch.nnodes x nproc_per_node)"
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="say whether the peak fits (exit 1 when it does not)",
    )


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.settings import load_settings

    settings = load_settings(*args.params)
    plan = plan_memory(settings, args.world_size)
    device = None if args.device_memory_gib is None else int(args.device_memory_gib * GIB)
    t = settings.train
    print(
        f"{settings.name}: mode {settings.dllm.mode}, train.dtype {t.dtype}, master {settings.model.torch_dtype}, "
        f"AC {t.activation_checkpointing}, micro-batch {t.local_batch_size} x {settings.dataset.seq_length} tokens"
    )
    print(plan.table(device))
    return 0 if device is None or plan.fits(device) else 1
