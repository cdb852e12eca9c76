"""`dllmflow generate`: text from a checkpoint with a diffusion sampler (guide "Run Inference").

    dllmflow generate --checkpoint runs/tiny_mdlm --prompt "What is 2+3?" --sampler llada
    dllmflow generate --checkpoint CKPT --prompt "a" --prompt "b" --threshold 0.9 --max-new-tokens 64
    dllmflow generate --checkpoint CKPT --prompt "a" --cache dual      # llada, scdd: Fast-dLLM dual cache
    dllmflow generate --checkpoint CKPT --infill --prompt "2 + 3 = [MASK]."

Flags are kebab-case; the guide's snake_case spellings (`--max_new_tokens`, `--mask_id`) also parse.
Without `--sampler` the export's default is used (`dllm.default_sampler` in its config.json, written
at export), else the first sampler of its recorded mode (`diffusion/modes.py`).

`--checkpoint` takes a consolidated HF dir, a step dir, the checkpoint root (through `LATEST`), a
run dir (`checkpoints/LATEST/...`), a curriculum run (its last stage) or a recipe dir such as
`runs/tiny_mdlm` (its newest flow run); `dllmflow.runs.resolve_checkpoint` owns the order, and
`inference/resolved.py` resolves it once into what every step below reads. Each
sampler's preset is its config class (`LLaDAConfig` in `samplers/llada.py`, ...); flags override it,
and a flag the sampler does not take is an error. In Python: `model, tok, settings =
load_for_generation(path)` then `SAMPLERS[name](model, tok, build_sampler_config(name, overrides),
mask_id=model.config.mask_token_id, training_settings=settings)`.

A checkpoint never switches on its own code: `trust_remote_code` comes only from the caller
(`--trust-remote-code`, or the settings a flow passes), never from the settings.json inside the
checkpoint (docs/security.md). The tokenizer is checked where it enters: its files present, its
vocabulary and special ids within the model's embedding.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from dllmflow.common.cli_args import add_flag
from dllmflow.errors import UserError
from dllmflow.inference.resolved import ResolvedCheckpoint, of_export, resolve
from dllmflow.runs import HF_CONFIG, recorded_settings, resolve_checkpoint  # noqa: F401 - its home is runs
from dllmflow.settings.pipeline import CACHE_MODES

INFILL_SPAN = 20  # [MASK] in an --infill prompt becomes this many mask tokens (docs/strategies.md §3.0)
RESPONSE_SPLITS = ("<|eot_id|>", "<|end_of_text|>", "<|start_header_id|>")


# ---- checkpoint resolution and loading ----------------------------------------------------------


def resolve_generation_mask_id(explicit: int | None, settings: Any, tokenizer: Any, model: Any) -> int:
    """--mask_id > the training settings' dllm.mask_token_id (what training used) > tokenizer > model.config."""
    from dllmflow.models.mask_id import resolve_mask_id

    trained = getattr(getattr(settings, "dllm", None), "mask_token_id", None)
    return resolve_mask_id(explicit if explicit is not None else trained, tokenizer, model)


def load_for_generation(
    path: str | Path | ResolvedCheckpoint,
    mask_id: int | None = None,
    device: str | None = None,
    dtype=None,
    adapter=None,
    trust_remote_code: bool = False,
):
    """-> (model in eval mode, tokenizer, training Settings or None). The resolved mask id is stored in
    `model.config.mask_token_id`; UserError if none resolves. `adapter`: a peft LoRA dir loaded onto
    the checkpoint (`dllmflow.models.lora.load_adapter`). `trust_remote_code`: the caller's decision
    (a checkpoint that needs its own code without it is refused with an error naming the flag)."""
    return load_export(resolve(path), mask_id, device, dtype, adapter, trust_remote_code)


def load_export(
    resolved: ResolvedCheckpoint,
    mask_id: int | None = None,
    device: str | None = None,
    dtype=None,
    adapter=None,
    trust_remote_code: bool = False,
):
    """`load_for_generation` of a checkpoint resolved already (`inference.resolved`: `resolve`, or
    `of_export` of a dir found to be the export): its recorded settings are the ones read there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dllmflow.data.tokenizer import check_generation_tokenizer, check_tokenizer_files
    from dllmflow.models.drafting_adapter import apply_drafting_adapter
    from dllmflow.models.integrity import load_checked
    from dllmflow.models.limits import vocab_rows

    ckpt = resolved.path
    # With an adapter, its run's settings (next to it in the export) say how it was trained.
    settings = recorded_settings(Path(adapter).parent) if adapter else None
    settings = settings or resolved.settings
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    loader = _MODEL_LOADERS.get(_model_type(ckpt))
    if loader is None:
        check_remote_code(ckpt, trust_remote_code)
    check_tokenizer_files(ckpt)
    loaded = {}

    def load():
        try:
            loaded["tokenizer"] = AutoTokenizer.from_pretrained(
                resolved.tokenizer_dir, trust_remote_code=trust_remote_code
            )
            if loader is not None:  # families AutoModelForCausalLM does not know (encoder + canvas decoders)
                return loader(ckpt, dtype=dtype, device=device), None
            # the load report names missing/unexpected/reshaped tensors (models/integrity.py)
            return AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
                ignore_mismatched_sizes=True,
            )  # fmt: skip
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):  # transformers' wording; ours names the flag
                raise UserError(remote_code_refusal(ckpt)) from None
            raise UserError(
                f"checkpoint {ckpt}: cannot load the tokenizer/model ({str(e).strip().splitlines()[0]})"
            ) from None

    model = load_checked(ckpt, load)
    tokenizer = loaded["tokenizer"]
    drafted = apply_drafting_adapter(model, ckpt, adapter)
    if drafted is not None:  # gated, never merged: the causal LM stays exact (dllm.mode uno)
        model = drafted
    elif adapter is not None:
        from dllmflow.models.lora import load_adapter

        model = load_adapter(model, adapter)
    model.config.mask_token_id = resolve_generation_mask_id(mask_id, settings, tokenizer, model)
    check_generation_tokenizer(tokenizer, vocab_rows(model), ckpt, model.config.mask_token_id)
    return model.to(device).eval(), tokenizer, settings


def remote_code_refusal(ckpt: Path) -> str:
    return (
        f"checkpoint {ckpt} needs its own Python code to load (`auto_map` in config.json) and dllmflow "
        "runs a checkpoint's code only when the caller trusts it: pass --trust-remote-code (generate, "
        "evaluate) or set model.trust_remote_code in the settings you pass, and only for a checkpoint "
        "you trust. Checkpoints from elsewhere enter through the consolidated safetensors export "
        "(docs/security.md)"
    )


def check_remote_code(ckpt: Path, trust_remote_code: bool) -> None:
    """Refuse, before transformers is asked, a checkpoint whose model type exists only in its own code
    (`auto_map`) when the caller did not trust it. A known model type with an `auto_map` loads
    transformers' own class without running anything, as transformers does."""
    import json

    from transformers import CONFIG_MAPPING

    if trust_remote_code:
        return
    try:
        config = json.loads((ckpt / HF_CONFIG).read_text())
    except (OSError, ValueError):
        return  # the load reports it
    if config.get("auto_map") and config.get("model_type") not in CONFIG_MAPPING:
        raise UserError(remote_code_refusal(ckpt))


def _load_diffusion_gemma(path, dtype, device):
    from dllmflow.models.diffusion_gemma import load_diffusion_gemma

    return load_diffusion_gemma(path, dtype=dtype, device=device)


# config.json `model_type` -> loader, for checkpoints that are not plain causal LMs.
_MODEL_LOADERS = {"diffusion_gemma": _load_diffusion_gemma}


def _model_type(ckpt: Path) -> str | None:
    import json

    try:
        return json.loads((ckpt / HF_CONFIG).read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def check_sampler_fits(sampler: str, settings: Any) -> str | None:
    """A warning (also emitted) when the checkpoint's training mode is not one `sampler` decodes
    (`diffusion.modes.check_sampler`, the one rule); an unknown sampler is an error."""
    from dllmflow.diffusion.modes import SamplerMisfitError, check_sampler

    try:
        check_sampler(getattr(getattr(settings, "dllm", None), "mode", None), sampler)
    except SamplerMisfitError as e:
        warnings.warn(str(e), UserWarning, stacklevel=2)
        return str(e)
    return None


def resolve_default_sampler(ckpt: str | Path | ResolvedCheckpoint) -> str:
    """The sampler an export decodes with when none is asked for (`ResolvedCheckpoint.default_sampler`):
    its `dllm.default_sampler`, else the first sampler of its recorded mode, else llada. `ckpt`: a
    resolved checkpoint, or the export dir itself."""
    return of_export(ckpt).default_sampler


# ---- prompts and responses ----------------------------------------------------------------------


def encode_prompt(tokenizer, prompt: str, raw: bool = False, infill: bool = False) -> list[int]:
    """Chat template with the generation prompt (default), or plain `encode` with `raw`. For infill each
    `[MASK]` becomes INFILL_SPAN mask tokens and no generation prompt is added."""
    if infill:
        if tokenizer.mask_token is None:
            raise UserError("--infill needs a tokenizer with a mask token")
        prompt = prompt.replace("[MASK]", tokenizer.mask_token * INFILL_SPAN)
    if raw:
        return tokenizer.encode(prompt, add_special_tokens=True)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the checkpoint's tokenizer has no chat template; pass --raw to encode prompts as plain text"
        )
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=not infill, return_dict=False))


def decode_response(tokenizer, ids: list[int]) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for marker in RESPONSE_SPLITS:
        text = text.split(marker)[0]
    return text.strip()


# ---- CLI ----------------------------------------------------------------------------------------


def add_sampler_args(parser: argparse.ArgumentParser, seed_default: int | None = 42) -> None:
    """Sampler overrides shared by `generate` and `evaluate` (None = keep the preset; a flag set for a
    sampler that does not take it is an error)."""
    g = parser.add_argument_group("sampler settings (override the preset)")
    add_flag(g, "--steps", type=int)
    add_flag(g, "--max-new-tokens", type=int)
    add_flag(g, "--block-size", type=int)
    add_flag(g, "--temperature", type=float)
    add_flag(g, "--remasking", choices=["low_confidence", "random"])
    add_flag(g, "--threshold", type=float)
    add_flag(g, "--uniform-ratio", type=float, help="scdd: must match training")
    add_flag(g, "--schedule-shape", type=float, help="scdd: must match training")
    add_flag(g, "--schedule-peak", type=float, help="scdd: must match training")
    add_flag(g, "--editing-threshold", type=float, help="llada2: LLaDA2.1 token editing, 0 = off")
    add_flag(g, "--max-post-steps", type=int, help="llada2: editing-only steps after a block is full")
    add_flag(
        g, "--batch-positions", type=int, help="selfspec: most positions a forward feeds across the batch"
    )
    add_flag(g, "--draft-schedule", choices=["fixed", "adaptive"], help="selfspec: drafts per forward")
    add_flag(g, "--lookup-ngram", type=int, help="selfspec: drafts copied from the text (0: off)")
    add_flag(g, "--slot-groups", type=int, help="selfspec: groups of [MASK] slots per forward")
    add_flag(
        g,
        "--cache",
        choices=CACHE_MODES,
        help="the KV cache: exact (llada2, nemotron, idlm, ar: the default), prefix or dual (llada, scdd: "
        "Fast-dLLM's approximate, refreshed per block), none; each sampler takes some",
    )
    add_flag(
        g,
        "--no-kv-cache",
        dest="cache",
        action="store_const",
        const="none",
        help="alias of --cache none (the guide's spelling); sets nothing else",
    )
    add_flag(
        g,
        "--causal-context",
        type=_on_off,
        metavar="{on,off}",
        help="nemotron: the prompt attends causally and each block gets an AR seed (its preset: on)",
    )
    add_flag(
        g,
        "--eos-token-id",
        type=_eos_id,
        help="stop each row at this EOS with no mask before it (exact); 'tokenizer': its EOS; 'none': no stop",
    )
    add_flag(
        g,
        "--eos-truncate",
        action="store_const",
        const=True,
        help="llada, scdd (cache none): drop the positions after a committed EOS from the forwards (approximate)",
    )
    add_flag(g, "--mask-id", type=int)
    add_flag(g, "--seed", type=int, default=seed_default)


def _on_off(value: str) -> bool:
    if value in ("on", "off"):
        return value == "on"
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def _eos_id(value: str) -> int | str:
    if value in ("tokenizer", "none"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a token id, 'tokenizer' or 'none', got {value!r}"
        ) from None


SAMPLER_FLAGS = ("steps", "max_new_tokens", "block_size", "temperature", "remasking", "threshold",
                 "uniform_ratio", "schedule_shape", "schedule_peak", "editing_threshold", "max_post_steps",
                 "batch_positions", "draft_schedule", "lookup_ngram", "slot_groups", "cache", "causal_context",
                 "eos_token_id", "eos_truncate", "seed")  # fmt: skip


def sampler_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SAMPLER_FLAGS if getattr(args, k, None) is not None}


def flag_config(sampler: str, overrides: dict[str, Any], tokenizer: Any = None, **kw: Any) -> Any:
    """The sampler config of CLI flags (`generate`, `evaluate`): `build_asked_config`'s strict parse and
    caps (no `--steps` beyond the generation length, a seed outside int64), refused naming the flag."""
    from dllmflow.diffusion.samplers.asked import build_asked_config
    from dllmflow.diffusion.samplers.configs import SamplerSettingError

    try:
        return build_asked_config(sampler, overrides, tokenizer, **kw)
    except SamplerSettingError as e:
        key, sep, detail = str(e).partition(": ")
        if not sep or key != e.field:  # the sampler config's own message names its flags already
            raise
        raise SamplerSettingError(f"--{key.replace('_', '-')} {detail}", e.field) from None


def validate_sampler_request(sampler: str, infill: bool = False) -> None:
    """Checks that need no model: a known sampler, and infill only where the sampler can."""
    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import sampler_supports

    check_sampler(None, sampler)
    if infill and not sampler_supports(sampler, "infill"):
        able = [n for n in SAMPLERS if sampler_supports(n, "infill")]
        raise UserError(f"sampler {sampler!r} cannot infill; --infill works with: {', '.join(able)}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="consolidated dir, step dir, checkpoint root or run dir"
    )
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument(
        "--sampler",
        help="llada, scdd, llada2, nemotron, gemma, idlm, ar, selfspec; default: the export's (config.json dllm block), "
        "else the first that fits its mode",
    )
    parser.add_argument("--infill", action="store_true", help="fill each [MASK] span of the prompt")
    parser.add_argument("--raw", action="store_true", help="encode prompts as plain text (no chat template)")
    parser.add_argument("--adapter", help="LoRA adapter dir (peft layout) to load onto --checkpoint")
    add_trust_arg(parser)
    add_sampler_args(parser)


def add_trust_arg(parser: argparse.ArgumentParser) -> None:
    """`--trust-remote-code`, shared by `generate` and `evaluate`: the only way a checkpoint's own code
    (`auto_map`) runs from the CLI; a settings.json inside the checkpoint does not count."""
    parser.add_argument(
        "--trust-remote-code",
        dest="trust_remote_code",
        action="store_true",
        help="run the checkpoint's own Python code (auto_map); only for checkpoints you trust",
    )


def cli_main(args: argparse.Namespace) -> int:
    import torch

    from dllmflow.diffusion.samplers import SAMPLERS

    # every check that needs no model first (the load is the slow part)
    ckpt = None
    if args.sampler is None:
        try:
            ckpt = resolve(args.checkpoint)
        except UserError:  # reported below, after the flag checks (as with --sampler given)
            ckpt = None
        args.sampler = ckpt.default_sampler if ckpt is not None else "llada"
    validate_sampler_request(args.sampler, args.infill)
    config = flag_config(args.sampler, sampler_overrides(args))  # EOS "tokenizer": the sampler's
    ckpt = resolve(ckpt or args.checkpoint)
    torch.manual_seed(args.seed)
    model, tokenizer, settings = load_for_generation(
        ckpt,
        mask_id=args.mask_id,
        adapter=args.adapter,
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    check_sampler_fits(args.sampler, settings)
    sampler = SAMPLERS[args.sampler](
        model, tokenizer, config, mask_id=model.config.mask_token_id, training_settings=settings
    )
    ids = [encode_prompt(tokenizer, p, raw=args.raw, infill=args.infill) for p in args.prompt]
    from dllmflow.models.limits import check_generation_fits

    check_generation_fits(
        model, max(map(len, ids)), 0 if args.infill else config.max_new_tokens, sampler.mask_id
    )
    if args.infill:
        result = sampler.infill(ids)
        texts = [tokenizer.decode(s, skip_special_tokens=True).strip() for s in result.sequences]
    else:
        result = sampler.generate(ids)
        texts = [decode_response(tokenizer, s) for s in result.sequences]
    for prompt, text in zip(args.prompt, texts):
        print(f">>> {prompt}\n{text}\n")
    speed = result.num_generated_tokens / max(result.elapsed_s, 1e-9)
    print(
        f"[{args.sampler}] {result.num_generated_tokens} tokens, {result.nfe} forwards, {speed:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0
