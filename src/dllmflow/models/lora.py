"""LoRA adapters (peft) for every mode: choose the targets, inject, export adapter + merged model, load.

    from dllmflow.models.lora import adapters_disabled, apply_lora, export_with_lora, load_adapter
    model = apply_lora(model, settings)        # trainer: after the build, before DDP/FSDP2; no-op without `peft:`
    export_with_lora(strategy.export, model, full_state, tokenizer, out, settings)   # rank 0, in `_exporter`
    model = load_adapter(base, "<consolidated>/adapter")  # `dllmflow generate --checkpoint BASE --adapter DIR`
    with adapters_disabled(model): ...         # the base's outputs (GRPO's KL reference with LoRA)

Injection is in place (`peft.inject_adapter_in_model`), so the model keeps its class, attributes and
forward signature (HybridAdapter's `masked_indices`, DiffusionGemma's `block_diffusion_training`, the
DFlash draft's `target_hidden`) and every strategy drives it unchanged. peft freezes everything but the
adapters and `peft.modules_to_save`, so the optimizer (which takes `requires_grad` parameters) holds only
those; the DCP checkpoint holds the whole wrapped model, adapters included, so a resume is exact.

Where adapters go: `peft.target_modules` (None = the family's attention + MLP projections, `DEFAULT_TARGETS`),
within the text layers of the chosen `peft.parts` for an encoder-decoder model (DiffusionGemma). For
dflash the trainable model is the draft, so the frozen target never gets adapters. The defaults stay
inside the numbered decoder blocks (LLaDA's LM head is also called `ff_out`, like its MLP output) and
leave routed MoE experts (`...experts.<i>...`, LLaDA2) frozen, as the guide's LoRA recipes do: the
attention, dense MLPs and shared experts are adapted. An explicit `peft.target_modules` is taken as is.

Tied weights: DiffusionGemma's encoder layer i and decoder layer i share every weight. Adapters on modules
that share a base weight are tied too (one adapter on that weight), so the merge `W + (alpha/r) B A` is one
weight again and the merged export equals the trained model. With only one of `peft.parts` the other part
kept the base weight during training, which the tied export cannot hold: the merged checkpoint then applies
the update to both parts (`lora.json` says `"merged_exact": false`); base + adapter is the exact model.

The export (`<consolidated>/`, what every consumer reads) is the MERGED model written by the strategy's
own `export`; next to it `<consolidated>/adapter/` holds the adapter in peft layout (`adapter_config.json`
+ `adapter_model.safetensors`, keys relative to the exported HF model, loadable with
`PeftModel.from_pretrained(base, dir)`) and `<consolidated>/lora.json` records base id, adapter path, r, alpha.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dllmflow.errors import UserError

if TYPE_CHECKING:
    from dllmflow.settings import PeftSection, Settings

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # inside the consolidated export
LORA_INFO = "lora.json"  # inside the consolidated export
ADAPTER = "default"  # peft's adapter name in parameter names (`q_proj.lora_A.default.weight`)
# Attention + MLP projections of Qwen3 / Llama / DiffusionGemma text layers / our DFlash draft.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.model_type -> default targets, for families that name their projections otherwise (docs/strategies.md §2.1).
FAMILY_TARGETS = {
    "llada": ("q_proj", "k_proj", "v_proj", "att_proj", "attn_out", "ff_proj", "up_proj", "ff_out"),
    "llada2_moe": ("query_key_value", "dense", "gate_proj", "up_proj", "down_proj"),
}
# Encoder-decoder models (DiffusionGemma): `peft.parts` -> the text layers that part owns.
PART_SCOPES = {"decoder": "model.decoder.layers.", "encoder": "model.encoder.language_model.layers."}
GROUPS_ATTR = "dllm_lora_groups"  # on the model: names of each LoRA'd base weight and its tied aliases


# ---- targets and injection -------------------------------------------------------------------------


def lora_target_modules(model: nn.Module, cfg: PeftSection) -> list[str]:
    """Full names of the linear modules that get adapters; UserError naming `peft.*` on a bad choice."""
    modules = dict(model.named_modules())
    encoder_decoder = all(scope.rstrip(".") in modules for scope in PART_SCOPES.values())
    if cfg.parts is not None and not encoder_decoder:
        raise UserError(
            f"peft.parts={cfg.parts}: {type(model).__name__} has no encoder and decoder "
            f"({', '.join(s.rstrip('.') for s in PART_SCOPES.values())}); remove peft.parts"
        )
    scopes = [PART_SCOPES[p] for p in (cfg.parts or PART_SCOPES)] if encoder_decoder else [""]
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear) and n.startswith(tuple(scopes))]
    available = ", ".join(sorted({n.rpartition(".")[2] for n in linears})) or "none"
    where = f" in {' / '.join(s.rstrip('.') for s in scopes)}" if encoder_decoder else ""
    if cfg.target_modules is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        wanted = FAMILY_TARGETS.get(model_type, DEFAULT_TARGETS)
        chosen = [n for n in linears if _matches(n, wanted) and _default_scope(n)]
        if not chosen:
            raise UserError(
                f"peft.target_modules is unset and none of the default names ({', '.join(wanted)}) is a linear "
                f"module of {type(model).__name__}{where}; set peft.target_modules to some of: {available}"
            )
        return chosen
    missing = [t for t in cfg.target_modules if not any(_matches(n, [t]) for n in linears)]
    if missing:
        raise UserError(
            f"peft.target_modules: {', '.join(map(repr, missing))} is not a linear module of "
            f"{type(model).__name__}{where}; available linear module names: {available}"
        )
    return [n for n in linears if _matches(n, cfg.target_modules)]


def apply_lora(model: nn.Module, settings: Settings) -> nn.Module:
    """Inject adapters in place (the same module back); unchanged when `peft` is absent or disabled."""
    cfg = settings.peft
    if cfg is None or not cfg.enabled:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    targets = lora_target_modules(model, cfg)
    names = {n.rpartition(".")[2] for n, _ in model.named_modules()} | {n for n, _ in model.named_modules()}
    unknown = [m for m in cfg.modules_to_save if m not in names]
    if unknown:
        raise UserError(
            f"peft.modules_to_save: {', '.join(map(repr, unknown))} is not a module of {type(model).__name__}; "
            f"e.g. {', '.join(sorted({n.rpartition('.')[2] for n, _ in model.named_children()}))}"
        )
    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(cfg.modules_to_save) or None,
        bias="none",
        # A saved embedding tied to the head (tie_word_embeddings) stays tied: one trained copy for both.
        ensure_weight_tying=bool(cfg.modules_to_save),
    )
    with warnings.catch_warnings():  # peft's notes on tied embeddings / unknown model classes
        warnings.simplefilter("ignore")
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    setattr(model, GROUPS_ATTR, tie_shared_adapters(model))
    return model


def is_adapter_module(name: str) -> bool:
    """Child names peft adds to a model (adapters and trainable copies), not part of the base build."""
    return name.startswith("lora_") or name == "modules_to_save"


def init_lora_weights(model: nn.Module, like_peft: bool = False) -> None:
    """Fill adapters of a model materialised by a seeded replay that skipped them (`is_adapter_module`):
    A ~ kaiming-uniform (peft's init) drawn from the global RNG in module order on full CPU tensors,
    B = 0 (so training starts from the base model), and each trainable copy = its original module.
    `like_peft`: draw exactly as peft's eager injection does (each adapter's two `nn.Linear`
    constructions draw first, then A's kaiming): the adapters `apply_lora` gives a loaded pretrained model."""
    from dllmflow.models.meta import copy_full

    def kaiming(shape) -> torch.Tensor:
        full = torch.empty(shape, dtype=torch.float32)
        return nn.init.kaiming_uniform_(full, a=math.sqrt(5))

    with torch.no_grad():
        for module in model.modules():
            for key, a in getattr(module, "lora_A", {}).items():
                if like_peft:
                    kaiming(a.weight.shape), kaiming(module.lora_B[key].weight.shape)
                copy_full(a.weight, kaiming(a.weight.shape))
            for b in getattr(module, "lora_B", {}).values():
                b.weight.zero_()
            copies = getattr(module, "modules_to_save", None)
            if isinstance(copies, nn.ModuleDict) and hasattr(module, "original_module"):
                for copy in copies.values():
                    for dst, src in zip(copy.parameters(), module.original_module.parameters()):
                        dst.copy_(src)


def tie_shared_adapters(model: nn.Module) -> list[list[str]]:
    """Adapters on modules that share one base weight become one adapter (their A/B parameters are made
    the same objects). Returns, per LoRA'd base weight, every name of that weight after a merge
    (`<module>.weight`, the modules without an adapter included) and whether all of them had the adapter."""
    from peft.tuners.lora import LoraLayer

    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(peel_key(name) or name)
    first: dict[int, nn.Module] = {}
    adapted = set()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapted.add(f"{name}.weight")
        key = id(module.get_base_layer().weight)
        owner = first.setdefault(key, module)
        if owner is not module:
            for attr in ("lora_A", "lora_B"):
                getattr(module, attr)[ADAPTER].weight = getattr(owner, attr)[ADAPTER].weight
    groups = [sorted(set(by_param[key])) for key in first]
    return [{"names": names, "exact": all(n in adapted for n in names)} for names in groups]


def has_lora(model: nn.Module) -> bool:
    return hasattr(model, GROUPS_ATTR)


# ---- merge and export ------------------------------------------------------------------------------


def peel_key(key: str) -> str | None:
    """A wrapped model's state-dict key -> the plain model's (None: an adapter-only tensor)."""
    if ".lora_" in key or ".original_module." in key:
        return None
    return key.replace(f".modules_to_save.{ADAPTER}.", ".").replace(".base_layer.", ".")


def merged_state_dict(model: nn.Module, state: dict[str, Tensor]) -> tuple[dict[str, Tensor], bool]:
    """-> (the plain model's full state dict with `W + (alpha/r)·B@A` merged in fp32, exact). `exact` is
    False when a merged weight is shared with a module that trained without the adapter."""
    from peft.tuners.lora import LoraLayer

    scale = _scaling(model)
    deltas = {}
    for name, module in model.named_modules():
        a, b = state.get(f"{name}.lora_A.{ADAPTER}.weight"), state.get(f"{name}.lora_B.{ADAPTER}.weight")
        if isinstance(module, LoraLayer) and a is not None and b is not None:
            deltas[f"{name}.weight"] = scale * (b.float() @ a.float())  # [out, in]
    out = {peel_key(k): v for k, v in state.items() if peel_key(k) is not None}
    exact = True
    for group in getattr(model, GROUPS_ATTR):
        names = group["names"]
        delta = next((deltas[n] for n in names if n in deltas), None)
        if delta is None:
            continue
        exact &= group["exact"]
        for n in names:
            if n in out:
                out[n] = (out[n].float() + delta).to(out[n].dtype)
    return out, exact


def adapter_state_dict(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter in peft's file layout (`base_model.model.<module>.lora_A.weight`), keys relative to
    the exported HF model (a HybridAdapter exports its inner model)."""
    from peft import get_peft_model_state_dict

    prefix = _export_prefix(model)
    sd = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER, save_embedding_layers=False)
    # Tied adapters appear under each alias: clone, since safetensors refuses shared storage.
    return {
        f"base_model.model.{k.removeprefix(prefix)}": v.detach().clone().contiguous() for k, v in sd.items()
    }


def export_with_lora(
    export: Callable[..., None],
    model: nn.Module,
    state: dict[str, Tensor],
    tokenizer: Any,
    out_dir: Path,
    settings: Settings,
    merge: bool = True,
) -> None:
    """`export(model, state, tokenizer, out_dir)` (a strategy's), given the merged model when `model`
    carries adapters (with `merge=False` the base model, untouched: a gated adapter, `dllm.mode: uno`,
    is no weight update), plus `<out_dir>/adapter/` (peft layout) and `<out_dir>/lora.json`."""
    if not has_lora(model):
        export(model, state, tokenizer, out_dir)
        return
    from safetensors.torch import save_file

    if merge:
        merged, exact = merged_state_dict(model, state)
    else:
        merged, exact = {peel_key(k): v for k, v in state.items() if peel_key(k) is not None}, True
    with peeled(model) as plain:
        export(plain, merged, tokenizer, out_dir)
    adapter = out_dir / ADAPTER_DIR
    adapter.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(model, state), str(adapter / "adapter_model.safetensors"), {"format": "pt"})
    config = _relative_config(model, settings)
    config.save_pretrained(str(adapter))
    if not exact:
        log.warning(
            "peft.parts=%s: the merged export applies the adapter to the tied weights of both parts; "
            "generate with --adapter for the exact trained model",
            settings.peft.parts,
        )
    info = lora_info(settings, config, exact) | {"merged": merge}
    (out_dir / LORA_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def lora_info(settings: Settings, config: Any, exact: bool) -> dict[str, Any]:
    """What the registered model records about the adapter (tracking logs it as `lora.*` params)."""
    cfg = settings.peft
    return {
        "base_model": config.base_model_name_or_path
        or f"random init (model.tiny, train.seed={settings.train.seed})",
        "adapter": ADAPTER_DIR,
        "r": cfg.r,
        "alpha": cfg.alpha,
        "dropout": cfg.dropout,
        "target_modules": sorted({t.rpartition(".")[2] for t in config.target_modules}),
        "modules_to_save": list(cfg.modules_to_save),
        "parts": cfg.parts,
        "merged_exact": exact,
    }


@contextlib.contextmanager
def peeled(model: nn.Module) -> Iterator[nn.Module]:
    """The model with each LoRA layer swapped for its base layer and each `modules_to_save` wrapper for
    its trained copy (plain module names, so a strategy's `export` sees the plain model); restored after."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    swaps = []
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            plain = module.get_base_layer()
        elif isinstance(module, ModulesToSaveWrapper):
            plain = module.modules_to_save[ADAPTER]
        else:
            continue
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        swaps.append((owner, child, module))
        owner._modules[child] = plain
    try:
        yield model
    finally:
        for owner, child, module in reversed(swaps):
            owner._modules[child] = module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The model computing as its base: every LoRA layer (and `modules_to_save` wrapper) switched off,
    as peft's `PeftModel.disable_adapter` does for a PeftModel (our adapters are injected, so there is
    no PeftModel to ask); switched back on after. GRPO's KL reference with LoRA is the policy so."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]
    trainable = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in trainable:  # peft's switch sets requires_grad: keep what apply_lora chose
            param.requires_grad_(flag)


# ---- loading for generation ------------------------------------------------------------------------


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Base + a peft adapter dir. Merged into the weights (`merge_and_unload`) unless adapters share a
    base weight (DiffusionGemma's tied encoder/decoder), where merging would add the update once per alias:
    then the PeftModel is returned and applies the adapter on the fly."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    path = Path(adapter_dir)
    if not (path / "adapter_config.json").is_file():
        raise UserError(f"--adapter {path}: no adapter_config.json (pass the export's adapter/ dir)")
    try:
        peft_model = PeftModel.from_pretrained(model, str(path))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--adapter {path}: cannot load it onto the base model ({e})") from None
    bases = [id(m.get_base_layer().weight) for m in peft_model.modules() if isinstance(m, LoraLayer)]
    if len(bases) != len(set(bases)):
        return peft_model.eval()
    return peft_model.merge_and_unload()


# ---- helpers ---------------------------------------------------------------------------------------


def _default_scope(name: str) -> bool:
    """Default targets: inside a numbered block (`layers.3.`, `blocks.0.`), never in a routed expert."""
    parts = name.split(".")
    return any(p.isdigit() for p in parts) and "experts" not in parts


def _matches(name: str, targets) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _scaling(model: nn.Module) -> float:
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def _export_prefix(model: nn.Module) -> str:
    """Where the saved HF model sits in `model`: '' for an HF model, 'model.' for a HybridAdapter."""
    from transformers import PreTrainedModel

    name = next((n for n, m in model.named_modules() if isinstance(m, PreTrainedModel)), "")
    return f"{name}." if name else ""


def _relative_config(model: nn.Module, settings: Settings):
    import copy

    prefix = _export_prefix(model)
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.target_modules = sorted(t.removeprefix(prefix) for t in config.target_modules)
    config.base_model_name_or_path = settings.model.pretrained_model_name_or_path
    config.inference_mode = True
    return config


__all__ = [
    "ADAPTER_DIR",
    "DEFAULT_TARGETS",
    "LORA_INFO",
    "adapter_state_dict",
    "apply_lora",
    "export_with_lora",
    "has_lora",
    "load_adapter",
    "lora_target_modules",
    "merged_state_dict",
]
