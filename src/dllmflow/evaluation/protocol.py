"""What `dllmflow evaluate` (accuracy.py) and the lm-eval adapter (harness.py) share: a checkpoint
loaded with one sampler for evaluation, the prompts asked, and GSM8K answer extraction.

    loaded = build_eval_runner(checkpoint, settings, sampler="llada")    # model, tokenizer, sampler, settings
    chats = eval_chats(prepared_dir, rows, n_shot)                        # n-shot exemplars + the question
    gsm8k_extract_strict("... #### 1,234")  -> "1234";  gsm8k_extract_flexible(text): the last number

Prompts: the chat without its last assistant turn, after n-shot exemplars from the train split.
Scores: strict (the number after `####`) and flexible (the last number in the text), commas and `$`
ignored. Both evaluators import from here, never from each other.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from dllmflow.errors import UserError

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)

# ---- answer extraction --------------------------------------------------------------------------


def normalize_number(text: str | None) -> str | None:
    """'$1,234.50' -> '1234.5', '18.' -> '18', '-3' -> '-3'; None when no number is left."""
    if text is None:
        return None
    s = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_extract_strict(text: str) -> str | None:
    """The number after the first `####` (GSM8K's answer line), normalised; None if absent."""
    m = _STRICT.search(text)
    return normalize_number(m.group(1)) if m else None


def gsm8k_extract_flexible(text: str) -> str | None:
    """The last number anywhere in the text, normalised; None if there is none."""
    found = _ANY_NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def gold_answer(reference: str) -> str | None:
    return gsm8k_extract_strict(reference) or gsm8k_extract_flexible(reference)


# ---- prompts ------------------------------------------------------------------------------------


def prompt_messages(messages: list[dict], shots: list[list[dict]] = ()) -> list[dict]:
    """The chat to answer: n-shot exemplar turns, then every turn but the final assistant one."""
    head = [m for shot in shots for m in shot]
    body = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    return head + list(body)


def template_hash(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def _exemplars(prepared_dir: Path, n_shot: int) -> list[list[dict]]:
    if n_shot == 0:
        return []
    from dllmflow.data.dataset import PreparedDataset

    rows = PreparedDataset(prepared_dir, "train").rows(n_shot)
    return [[m for m in r["messages"] if m["role"] != "system"][-2:] for r in rows]


# ---- the checkpoint and its sampler -------------------------------------------------------------

EVAL_SETTINGS = ("max_new_tokens", "steps", "block_size", "threshold", "temperature", "seed")


@dataclass
class EvalRunner:
    """A checkpoint loaded for evaluation with one sampler (shared by `evaluate` and the lm-eval
    adapter in `harness.py`). settings: the run's Settings or the checkpoint's own (None = neither)."""

    model: Any
    tokenizer: Any
    runner: Any  # a dllmflow.diffusion.samplers Sampler
    settings: Any
    sampler: str

    @property
    def eval_cfg(self) -> Any:
        return self.settings.eval if self.settings is not None else None


def build_eval_runner(
    checkpoint: str | Path,
    settings: Any = None,
    sampler: str = "llada",
    overrides: dict[str, Any] | None = None,
    device: str | None = None,
) -> EvalRunner:
    """Load `checkpoint` (on `device`, None = cuda if available) and build `sampler` from its preset <
    settings.eval < `overrides` (one the sampler does not take is an error; `mask_id` picks the mask token)."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config
    from dllmflow.inference.generate import check_sampler_fits, load_for_generation, validate_sampler_request

    validate_sampler_request(sampler)
    overrides = dict(overrides or {})
    # A checkpoint's code runs only if the caller trusts it: --trust-remote-code or the settings passed.
    trust = bool(overrides.pop("trust_remote_code", False)) or bool(
        settings and settings.model.trust_remote_code
    )
    model, tokenizer, trained = load_for_generation(
        checkpoint,
        mask_id=overrides.pop("mask_id", None),
        adapter=overrides.pop("adapter", None),
        device=device,
        trust_remote_code=trust,
    )
    settings = settings or trained
    check_sampler_fits(sampler, trained or settings)
    eval_cfg = settings.eval if settings is not None else None
    # The eval section is shared by every sampler of the mode: a knob this one does not take is dropped.
    values = {k: getattr(eval_cfg, k) for k in EVAL_SETTINGS} if eval_cfg is not None else {}
    config = build_sampler_config(sampler, overrides, tokenizer, defaults=values)
    runner = SAMPLERS[sampler](model, tokenizer, config, mask_id=model.config.mask_token_id)
    return EvalRunner(model, tokenizer, runner, settings, sampler)


def resolve_prepared_dir(checkpoint: str | Path, settings: Any, prepared_dir: str | Path | None) -> Path:
    if prepared_dir is None:
        if settings is None:
            raise UserError(
                f"{checkpoint}: no settings.json next to the weights; pass --params or --prepared-dir"
            )
        prepared_dir = settings.dataset.prepared_dir
    return Path(prepared_dir)


def eval_chats(prepared_dir: Path, rows: list[dict], n_shot: int) -> list[list[dict]]:
    """The chat each row is asked as: n-shot exemplars from the train split, then its question."""
    shots = _exemplars(prepared_dir, n_shot)
    return [prompt_messages(r["messages"], shots) for r in rows]
