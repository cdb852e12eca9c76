"""DiffusionGemma for block-diffusion SFT: build (tiny or `from_pretrained`), freeze, train forward, export, load.

Runs on transformers' own `DiffusionGemmaForBlockDiffusion` (a causal encoder over the clean sequence
writes a KV cache; a bidirectional decoder denoises a canvas against it; encoder and decoder share
their text weights). Its `forward` already takes everything training needs: custom per-layer-type
decoder masks (`decoder_attention_mask={"full_attention": .., "sliding_attention": ..}`), absolute
`decoder_position_ids`, `self_conditioning_logits` and a per-example `self_conditioning_mask`.
What it lacks is one call that does the training pass, so `DiffusionGemmaForBlockDiffusionTraining`
(a thin subclass: same modules, same weights, same checkpoints) adds, behind
`forward(..., block_diffusion_training=True)`:

    1) one causal encoder pass over the clean ids into a plain `DynamicCache` (full-length KV for
       every layer: the training masks index all S encoder columns, sliding layers included);
    2) pass 1 under `no_grad` with a zero self-conditioning signal (only if some example's coin is on);
    3) pass 2 with gradient, fed the softmax of pass 1 (zeroed for examples whose coin is off);
    4) the softcapped encoder logits at the requested positions (for the encoder AR loss).

Doing this inside `forward` keeps the whole step one call of the (DDP/FSDP-wrapped) root module.
Without the flag, `forward` is the parent's, so the model's own `generate` works unchanged.
FSDP2: encoder layer i and decoder layer i share their weights, so shard each pair as one group,
`for unit in model.fsdp_units(): fully_shard(unit)`, then the root (per-layer sharding is refused by torch).

    from dllmflow.models.diffusion_gemma import build_diffusion_gemma, export_diffusion_gemma
    model = build_diffusion_gemma(settings, tokenizer)           # tiny (model.tiny) or the hub id
    export_diffusion_gemma(model, state_dict, tokenizer, out_dir, base_name_or_path="google/...")
    model = load_diffusion_gemma("out_dir")                      # base + decoder overlay, or full dir

Export: a run from a hub/local base writes only the decoder's tensors (`model.decoder.*`, which hold
the shared trained text weights and the self-conditioning block) plus the config with the base's
`_name_or_path`; `load_diffusion_gemma` loads the base and overlays them (docs/strategies.md §1.6, §3.5). A tiny
random model has no base, so it is exported in full and loads back directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaBlockDiffusionOutputWithPast,
)

from dllmflow.errors import UserError
from dllmflow.models.meta import pretrained_kwargs
from dllmflow.models.shipped_configs import resolve_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dllmflow.settings import Settings

HF_ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
EXPORT_INFO = "dllmflow_export.json"  # {"format": "decoder_overlay" | "full", "base": <name_or_path>}
DECODER_PREFIX = "model.decoder."
ENCODER_TEXT_PREFIX = "model.encoder.language_model."
DEFAULT_SLIDING_WINDOW = 1024  # docs/strategies.md §2.4 fallback when the text config has none
# Tiny-model knobs that `model.tiny` does not carry (DiffusionGemma is always MoE and multimodal).
TINY_NUM_EXPERTS, TINY_TOP_K_EXPERTS, TINY_SLIDING_WINDOW = 4, 2, 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BlockDiffusionTrainingOutput(DiffusionGemmaBlockDiffusionOutputWithPast):
    """`logits` [B, R, V] of pass 2; `encoder_logits` [N, V] at the requested encoder positions."""

    encoder_logits: Tensor | None = None


class DiffusionGemmaForBlockDiffusionTraining(DiffusionGemmaForBlockDiffusion):
    """`DiffusionGemmaForBlockDiffusion` plus the two-pass training forward (module docstring)."""

    def forward(self, *args: Any, block_diffusion_training: bool = False, **kwargs: Any):
        if not block_diffusion_training:
            return super().forward(*args, **kwargs)
        return self._training_forward(**kwargs)

    def _training_forward(
        self,
        input_ids: Tensor,  # [B, S] clean ids
        attention_mask: dict[str, Tensor],  # encoder masks per layer type, [B, 1, S, S]
        position_ids: Tensor,  # [B, S]
        decoder_input_ids: Tensor,  # [B, R] noisy canvas
        decoder_attention_mask: dict[str, Tensor],  # [B, 1, R, S+R] per layer type
        decoder_position_ids: Tensor,  # [B, R] absolute positions
        self_conditioning_mask: Tensor | None = None,  # [B] bool coins; None = no self-conditioning
        encoder_logits_mask: Tensor | None = None,  # [B, S] bool; None = no encoder logits
    ) -> BlockDiffusionTrainingOutput:
        encode = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        decode = {
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_attention_mask,
            "decoder_position_ids": decoder_position_ids,
        }
        # Pass 1 only if some coin is on (a coin-off example's signal is zeroed anyway).
        need_sc = self_conditioning_mask is not None and bool(self_conditioning_mask.any())
        sc_logits = None
        if need_sc and _is_fsdp2(self):
            # FSDP2 segfaults in backward when a shard group runs under no_grad between two grad uses
            # in one forward (torch 2.13, CPU/gloo): run pass 1 first, with its own no-grad encoder.
            with torch.no_grad():
                sc_logits = super().forward(cache=self._encode(**encode).cache, **decode).logits.detach()
        # 1) encoder: causal pass over the clean sequence, writing the KV cache the decoder reads
        enc = self._encode(**encode)
        # 2) pass 1 (no grad, zero self-conditioning signal)
        if need_sc and sc_logits is None:
            with torch.no_grad():
                sc_logits = super().forward(cache=enc.cache, **decode).logits.detach()  # [B, R, V]
        # 3) pass 2 with gradient, the soft predictions gated per example by the coin
        out = super().forward(
            cache=enc.cache,
            **decode,
            self_conditioning_logits=sc_logits,
            self_conditioning_mask=self_conditioning_mask if sc_logits is not None else None,
        )
        # 4) encoder logits only where the AR loss needs them ([N, V] instead of [B, S, V])
        enc_logits = None
        if encoder_logits_mask is not None:
            hidden = enc.last_hidden_state[encoder_logits_mask]  # [N, H]
            enc_logits = softcap(self.lm_head(hidden).float(), self.final_logit_softcapping)
        return BlockDiffusionTrainingOutput(logits=out.logits, encoder_logits=enc_logits)

    def _encode(self, input_ids: Tensor, attention_mask: dict[str, Tensor], position_ids: Tensor):
        # A config-less DynamicCache keeps every layer full-length (sliding layers included): the
        # training masks index all S encoder columns and apply the sliding window themselves.
        return self.model.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=DynamicCache(),
        )

    def fsdp_units(self) -> list[list[torch.nn.Module]]:
        """FSDP2 shard groups: encoder layer i and decoder layer i share every weight, so they must be
        sharded together (`fully_shard([enc_i, dec_i])`); torch refuses tied weights split across groups."""
        pairs = zip(self.model.encoder.language_model.layers, self.model.decoder.layers)
        return [[enc, dec] for enc, dec in pairs]

    def checkpoint_blocks(self) -> list[torch.nn.Module]:
        """Blocks activation checkpointing may recompute: the decoder layers. An encoder layer writes the
        KV cache as it runs, so recomputing it in backward would append its keys/values a second time."""
        return list(self.model.decoder.layers)

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any):
        """Save as the plain HF class, so `AutoModel`/`DiffusionGemmaForBlockDiffusion` load it."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        _set_config_fields(Path(save_directory), architectures=[HF_ARCHITECTURE])
        return out


def _is_fsdp2(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma's final-logit softcap `c * tanh(x / c)` (identity when `cap` is None)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- build ----------------------------------------------------------------------------------------


def build_diffusion_gemma(
    settings: Settings, tokenizer: PreTrainedTokenizerBase
) -> DiffusionGemmaForBlockDiffusion:
    """The trainable model: tiny random (`model.tiny`) or `from_pretrained`, then the freezes."""
    cfg = settings.model
    if cfg.tiny is not None:
        model = build_tiny_diffusion_gemma(settings, tokenizer)
    else:
        model = _from_pretrained(settings)
    apply_freeze_vision(model)
    if cfg.freeze_router:
        apply_freeze_router(model)
    return model.to(_DTYPES[cfg.torch_dtype])


def build_tiny_diffusion_gemma(
    settings: Settings, tokenizer: PreTrainedTokenizerBase
) -> DiffusionGemmaForBlockDiffusionTraining:
    """A random DiffusionGemma sized by `model.tiny` (its `architecture` is ignored), vocab = len(tokenizer),
    canvas_length = `model.canvas_length` or `dllm.block_size`; layers alternate sliding/full attention
    and the vision tower is minimal (the default one alone has 167M parameters)."""
    from transformers import DiffusionGemmaConfig, Gemma4VisionConfig
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    tiny = settings.model.tiny
    if tiny is None:
        raise UserError("model.tiny is not set; build_tiny_diffusion_gemma needs the tiny sizes")
    head_dim = tiny.hidden_size // tiny.num_attention_heads
    n = tiny.num_hidden_layers
    text = DiffusionGemmaTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_global_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(n - 1)]
        + ["full_attention"],
        num_experts=TINY_NUM_EXPERTS,
        top_k_experts=TINY_TOP_K_EXPERTS,
        moe_intermediate_size=max(tiny.intermediate_size // 4, 1),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
    )
    vision = Gemma4VisionConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        position_embedding_size=16,
        patch_size=2,
    )
    config = DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=settings.model.canvas_length or settings.dllm.block_size,
        tie_word_embeddings=True,
    )
    config._attn_implementation = _cpu_safe_attention(settings.model.attn_implementation)
    return DiffusionGemmaForBlockDiffusionTraining(config)


def _from_pretrained(settings: Settings) -> DiffusionGemmaForBlockDiffusionTraining:
    cfg = settings.model
    name = cfg.pretrained_model_name_or_path
    kwargs: dict[str, Any] = {
        "dtype": _DTYPES[cfg.torch_dtype],
        "attn_implementation": cfg.attn_implementation,
        **pretrained_kwargs(),  # under models.meta.build_on_meta: the skeleton only
    }
    try:
        if cfg.canvas_length is not None:
            # on the config: from_pretrained hands a top-level knob to the generation config, which refuses it
            kwargs["config"] = resolve_config(name, canvas_length=cfg.canvas_length)
        model = DiffusionGemmaForBlockDiffusionTraining.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(
            f"model.pretrained_model_name_or_path={name!r}: cannot load a DiffusionGemma checkpoint "
            f"(block_diffusion needs one, e.g. google/diffusiongemma-26B-A4B-it): {str(e).splitlines()[0]}"
        ) from e
    model.config._name_or_path = name  # the base that a decoder-only export points back to
    return model


def _cpu_safe_attention(name: str) -> str:
    # flex_attention has no CPU backward (stack notes); the dense additive masks work with sdpa/eager.
    return (
        "sdpa" if name in ("flex_attention", "flash_attention_2") and not torch.cuda.is_available() else name
    )


def apply_freeze_router(model: torch.nn.Module) -> list[str]:
    """Freeze every MoE router parameter (proj, scale, per-expert scale): `model.freeze_router`."""
    frozen = []
    for name, p in model.named_parameters():
        if ".router." in name:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def apply_freeze_vision(model: torch.nn.Module) -> None:
    """Freeze the vision tower and its projection: text-only SFT never reaches them, and frozen
    parameters are neither 'unused' for DDP nor held in the optimizer state."""
    encoder = model.model.encoder
    for module in (encoder.vision_tower, encoder.embed_vision):
        module.requires_grad_(False)


def sliding_window_of(model: torch.nn.Module) -> int:
    text = model.config.get_text_config()
    return int(getattr(text, "sliding_window", None) or DEFAULT_SLIDING_WINDOW)


# ---- export and load ------------------------------------------------------------------------------


def decoder_state_dict(model: torch.nn.Module, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The `model.decoder.*` tensors of a full state dict. Encoder and decoder text weights are tied,
    so a state dict that kept only the encoder alias of a tensor is read through that alias."""
    out = {}
    for key in model.state_dict():
        if not key.startswith(DECODER_PREFIX):
            continue
        alias = ENCODER_TEXT_PREFIX + key[len(DECODER_PREFIX) :]
        value = state_dict.get(key, state_dict.get(alias))
        if value is None:
            raise ValueError(f"export: {key} (or its tied alias {alias}) is missing from the state dict")
        out[key] = value.detach().to("cpu").clone().contiguous()
    return out


def export_diffusion_gemma(
    model: torch.nn.Module,
    state_dict: dict[str, Tensor],
    tokenizer: Any,
    out_dir: str | Path,
    base_name_or_path: str | None,
) -> Path:
    """Write a loadable HF directory. With a base: decoder tensors + config (`_name_or_path` = base);
    without (tiny random model): the full model."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if base_name_or_path is None:
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        info = {"format": "full", "base": None}
    else:
        save_file(
            decoder_state_dict(model, state_dict), str(out / "model.safetensors"), metadata={"format": "pt"}
        )
        model.config.save_pretrained(out)
        info = {"format": "decoder_overlay", "base": base_name_or_path}
    # transformers 5 does not serialise _name_or_path; write it so generation can find the base.
    _set_config_fields(out, architectures=[HF_ARCHITECTURE], _name_or_path=base_name_or_path or str(out))
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_diffusion_gemma(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs: Any
) -> DiffusionGemmaForBlockDiffusion:
    """Load an export for generation: a full directory as is; a decoder overlay onto its base
    (`_name_or_path`), where every overlaid key must exist in the base (docs/strategies.md §3.5)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json; pass a consolidated DiffusionGemma checkpoint directory")
    info = (
        json.loads((path / EXPORT_INFO).read_text()) if (path / EXPORT_INFO).is_file() else {"format": "full"}
    )
    if info.get("format") != "decoder_overlay":
        return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    base = info.get("base") or json.loads((path / "config.json").read_text()).get("_name_or_path")
    if not base:
        raise UserError(f"{path}: a decoder-only export needs its base in config.json `_name_or_path`")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(base, dtype=dtype, **kwargs).to(device)
    overlay = {}
    for file in sorted(path.glob("*.safetensors")):
        overlay.update(load_file(str(file), device=str(device)))
    unexpected = sorted(set(overlay) - set(model.state_dict()))
    if unexpected:
        raise UserError(f"{path}: tensors not in the base model {base!r}: {unexpected[:5]} (wrong base?)")
    model.load_state_dict(overlay, strict=False)
    return model


def _set_config_fields(directory: Path, **fields: Any) -> None:
    config_file = directory / "config.json"
    data = json.loads(config_file.read_text())
    data.update(fields)
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
