"""The drafting adapter of `dllm.mode: uno` (docs/strategies.md §2.9): LoRA on a frozen causal LM that
acts only at [MASK] positions, so every other position computes exactly what the causal LM computes.

    model = apply_lora(base, settings); apply_drafting_gate(model, mask_id)      # training (UnoStrategy)
    model = load_drafting_adapter(base, base_dir, export / "adapter")             # generation (load_export)
    weights_digest(export)                                                        # the causal LM's identity

The gate: a forward pre-hook on the model reads `input_ids` and marks the [MASK] positions; a forward hook
on each adapter's `lora_B` multiplies its output by that mark, so at a non-[MASK] position the LoRA layer
adds an exact 0 to its base output. A forward with no [MASK] at all switches the adapters off (no LoRA
compute). Keys and values of a [MASK] position are the adapter's; the clean positions' are the base's, so a
KV cache filled by clean tokens is the causal LM's own. `selfspec` (samplers/selfspec.py) then checks every
draft against the LM's greedy choice: its answers are the causal LM's greedy answers, token for token.

The export (`<consolidated>/`) is the causal LM itself (HF layout, unchanged weights: `from_pretrained`
gives the AR model) + `adapter/` (peft layout, never merged) + `drafter.json` (the LM's weight digest,
block size, mask id). Loading the adapter onto weights with another digest is refused, naming both.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.common.files import atomic_write_json
from dllmflow.errors import UserError

from .causal_prompt import CAUSAL_BLOCKS_ATTR
from .wrappers import unwrap

DRAFTER_INFO = "drafter.json"  # inside the consolidated export, beside adapter/
DRAFTER_ATTR = "dllm_drafting_adapter"  # on the model's config: the gate is installed
GATE_ATTR = "_dllm_draft_gate"  # on the model: the live gate (see DraftGate)


class DraftGate:
    """What the hooks share: the mask id and, during a forward, the [MASK] mark [B, Q, 1] (None: no mask
    in this forward, adapters off)."""

    def __init__(self, mask_id: int, layers: list[nn.Module]):
        self.mask_id, self.layers = int(mask_id), layers
        self.mark: Tensor | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mark = None if ids is None else (ids == self.mask_id)  # [B, Q]
        self.mark = mark[..., None] if mark is not None and bool(mark.any()) else None
        for layer in self.layers:  # peft's own switch, without its requires_grad side effects
            layer._disable_adapters = self.mark is None

    def gate(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        if self.mark is None:  # adapters are off then; a direct call keeps the base exact anyway
            return output * 0
        return output * self.mark.to(output.dtype)  # [B, Q, out]: exact zeros off the [MASK]s


def apply_drafting_gate(model: nn.Module, mask_id: int) -> nn.Module:
    """Gate every LoRA adapter of `model` (already injected) to the [MASK] positions, in place, and flag
    its config (`dllm_causal_blocks`: llada2 decodes it causally; `dllm_drafting_adapter`). Idempotent."""
    from peft.tuners.lora import LoraLayer

    from .lora import ADAPTER

    root = unwrap(model)
    if getattr(root, GATE_ATTR, None) is not None:
        return model
    layers = [m for m in root.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise UserError("the drafting adapter needs LoRA layers on the causal LM (a peft: section)")
    gate = DraftGate(mask_id, layers)
    root.register_forward_pre_hook(gate.before, with_kwargs=True)
    for layer in layers:
        layer.lora_B[ADAPTER].register_forward_hook(gate.gate)
    setattr(root, GATE_ATTR, gate)
    setattr(root.config, CAUSAL_BLOCKS_ATTR, True)
    setattr(root.config, DRAFTER_ATTR, True)
    return model


def has_drafting_adapter(model: nn.Module) -> bool:
    return getattr(unwrap(model), GATE_ATTR, None) is not None


# ---- the causal LM's identity ----------------------------------------------------------------------


def weights_digest(model_dir: str | Path) -> str:
    """sha256 over the tensors of the safetensors files in `model_dir` (names sorted; each name, dtype,
    shape and raw bytes): the same weights give the same digest whatever the file layout or metadata."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights to identify the causal LM by")
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        for name, st in sorted(((k, f) for f in opened for k in f.keys()), key=lambda e: e[0]):
            t = st.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_drafter_info(out_dir: Path, base_model: str | None, block_size: int, mask_id: int) -> dict:
    """`drafter.json` of an export whose weights (the causal LM) are already written in `out_dir`."""
    info = {
        "base_model": base_model,
        "base_digest": weights_digest(out_dir),
        "block_size": int(block_size),
        "mask_token_id": int(mask_id),
        "adapter": "adapter",
    }
    atomic_write_json(out_dir / DRAFTER_INFO, info)
    return info


def read_drafter_info(export_dir: str | Path) -> dict[str, Any] | None:
    path = Path(export_dir) / DRAFTER_INFO
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e}); re-export the run") from None


# ---- loading for generation --------------------------------------------------------------------


def apply_drafting_adapter(model: nn.Module, base_dir: str | Path, adapter: str | Path | None = None):
    """`model` (loaded from `base_dir`) with its drafting adapter gated on (`load_drafting_adapter`): the
    export's own when `base_dir` is an uno export, else `adapter` when that is one; None when there is
    none (a plain LoRA `adapter` is the caller's to load)."""
    if adapter is not None:
        adapter_dir = Path(adapter) if read_drafter_info(Path(adapter).parent) is not None else None
    else:
        info = read_drafter_info(base_dir)
        adapter_dir = Path(base_dir) / info["adapter"] if info is not None else None
    return load_drafting_adapter(model, base_dir, adapter_dir) if adapter_dir is not None else None


def load_drafting_adapter(model: nn.Module, base_dir: str | Path, adapter_dir: str | Path) -> nn.Module:
    """The causal LM `model` (loaded from `base_dir`) with the gated adapter of `adapter_dir` (an uno
    export's `adapter/`, its `drafter.json` beside it), never merged. Refused, naming both, when the
    weights of `base_dir` are not the ones the adapter was trained on."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    from .lora import ADAPTER

    adapter_dir = Path(adapter_dir)
    info = read_drafter_info(adapter_dir.parent)
    if info is None:
        raise UserError(f"{adapter_dir}: no {DRAFTER_INFO} beside it; not a drafting adapter export")
    digest = weights_digest(base_dir)
    if digest != info["base_digest"]:
        raise UserError(
            f"drafting adapter {adapter_dir} was trained on the causal LM {info.get('base_model')!r} "
            f"(weights sha256 {info['base_digest'][:16]}...), but {base_dir} holds other weights "
            f"(sha256 {digest[:16]}...); load it onto the model it was trained on"
        )
    try:
        config = LoraConfig.from_pretrained(str(adapter_dir))
        config.inference_mode = True
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise UserError(f"drafting adapter {adapter_dir}: cannot load it ({e})") from None
    result = set_peft_model_state_dict(model, _inner_keys(state), adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise UserError(
            f"drafting adapter {adapter_dir}: its tensors do not fit {type(model).__name__} "
            f"(missing {missing[:2]}, unexpected {list(result.unexpected_keys)[:2]})"
        )
    return apply_drafting_gate(model, int(info["mask_token_id"]))


def _inner_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """peft's file keys (`base_model.model.<module>.lora_A.weight`) -> the injected model's."""
    return {k.removeprefix("base_model.model."): v for k, v in state.items()}
