"""`dllmflow evaluate`: GSM8K exact match and decoding speed of a checkpoint with one sampler.

    dllmflow evaluate --checkpoint runs/tiny_mdlm/checkpoints --limit 8
    dllmflow evaluate --checkpoint CKPT --params params/tiny_mdlm.yaml --sampler llada --threshold 0.9 \
        --output results.json

Prompts and reference answers come from the prepared data's held-out split (`dataset.prepared_dir`,
split `eval`): the prompt is the chat without its last assistant turn, rendered with the
checkpoint's chat template and the generation prompt. Scores: strict (the number after `####`) and
flexible (the last number in the text), commas and `$` ignored. Speed: tokens/s over generated
(trimmed) tokens, NFE = forward passes per example, tokens per forward. The protocol (sampler and all
its settings, generation length, n-shot, chat template hash, limit, split, seed) is returned with the
metrics and the predictions. In Python: `evaluate(checkpoint, settings, sampler="llada", limit=8)`.
`--harness gsm8k` scores the same rows through lm-evaluation-harness instead (harness.py).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import Path
from typing import Any

from dllmflow.common.files import atomic_write_json
from dllmflow.common.progress import Progress
from dllmflow.errors import UserError

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
EVAL_SETTINGS = ("max_new_tokens", "steps", "block_size", "threshold", "temperature", "seed")


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


# ---- evaluation ---------------------------------------------------------------------------------


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


def evaluate(
    checkpoint: str | Path,
    settings: Any = None,
    sampler: str = "llada",
    split: str = "eval",
    limit: int | None = None,
    overrides: dict[str, Any] | None = None,
    prepared_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Generate answers for `split` of the prepared data and score them.

    settings: the run's Settings (eval section, dataset.prepared_dir); None = the checkpoint's own
    settings.json. limit: None = settings.eval.limit (None there = the whole split). overrides: sampler
    settings that win over the preset and settings.eval (one the sampler does not take is an error).
    -> {"metrics", "protocol", "predictions"}.
    """
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.inference.generate import decode_response
    from dllmflow.models.limits import check_generation_fits

    # 1) what to run
    loaded = build_eval_runner(checkpoint, settings, sampler, overrides)
    model, tokenizer, runner, settings, eval_cfg = (
        loaded.model, loaded.tokenizer, loaded.runner, loaded.settings, loaded.eval_cfg
    )  # fmt: skip
    prepared_dir = resolve_prepared_dir(checkpoint, settings, prepared_dir)
    limit = limit if limit is not None else getattr(eval_cfg, "limit", None)
    config = runner.config  # as it ran (scdd: the schedule read from the checkpoint)
    n_shot = eval_cfg.n_shot if eval_cfg is not None else 0
    batch_size = eval_cfg.batch_size if eval_cfg is not None else 8

    # 2) prompts, shortest first so a batch pads little
    rows = PreparedDataset(prepared_dir, split).rows(limit)
    if not rows:
        raise UserError(f"{prepared_dir}: split {split!r} has no rows to evaluate")
    chats = eval_chats(prepared_dir, rows, n_shot)
    prompts = [
        list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
        for chat in chats
    ]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    check_generation_fits(model, len(prompts[order[-1]]), config.max_new_tokens, runner.mask_id)

    # 3) generate in batches
    outputs: dict[int, list[int]] = {}
    elapsed, row_nfe = 0.0, 0
    with Progress(f"evaluate {sampler}", len(order), unit="examples", every=batch_size) as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            result = runner.generate([prompts[i] for i in idx])
            outputs.update(zip(idx, result.sequences))
            elapsed += result.elapsed_s
            row_nfe += sum(result.row_nfe) if result.row_nfe else result.nfe * len(idx)
            bar.advance(len(idx))

    # 4) score
    predictions = []
    for i, r in enumerate(rows):
        text = decode_response(tokenizer, outputs[i])
        gold = gold_answer(r["answer"])
        strict, flexible = gsm8k_extract_strict(text), gsm8k_extract_flexible(text)
        predictions.append(
            dict(id=r["id"], prompt=chats[i][-1]["content"] if chats[i] else "", prediction=text, answer=gold,
                 pred_strict=strict, pred_flexible=flexible,
                 correct_strict=strict is not None and strict == gold,
                 correct_flexible=flexible is not None and flexible == gold, num_tokens=len(outputs[i]))
        )  # fmt: skip
    n = len(predictions)
    tokens = sum(p["num_tokens"] for p in predictions)
    metrics = {
        "exact_match_strict": sum(p["correct_strict"] for p in predictions) / n,
        "exact_match_flexible": sum(p["correct_flexible"] for p in predictions) / n,
        "tokens_per_s": tokens / max(elapsed, 1e-9),
        "nfe": row_nfe / n,
        "tokens_per_forward": tokens / max(row_nfe, 1),
        "num_examples": n,
    }
    protocol = {
        "sampler": sampler,
        "sampler_settings": config.model_dump(mode="json"),
        "max_new_tokens": config.max_new_tokens,
        "n_shot": n_shot,
        "chat_template_sha256": template_hash(tokenizer),
        "limit": limit,
        "split": split,
        "seed": config.seed,
        "batch_size": batch_size,
        "mask_id": runner.mask_id,
        "checkpoint": str(checkpoint),
        "prepared_dir": str(prepared_dir),
    }
    return {"metrics": metrics, "protocol": protocol, "predictions": predictions}


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from dllmflow.common.cli_args import add_flag
    from dllmflow.inference.generate import add_sampler_args, add_trust_arg

    parser.add_argument(
        "--checkpoint", required=True, help="consolidated dir, step dir, checkpoint root or run dir"
    )
    parser.add_argument(
        "--params", help="recipe YAML (eval section, dataset.prepared_dir); default: the checkpoint's"
    )
    parser.add_argument("--sampler", default="llada")
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples")
    parser.add_argument("--split", default="eval")
    add_flag(parser, "--prepared-dir", help="default: dataset.prepared_dir of the settings")
    parser.add_argument("--output", help="write metrics, protocol and predictions to this JSON file")
    parser.add_argument(
        "--harness", metavar="TASK", help="score with lm-evaluation-harness instead (gsm8k; docs/lm_eval.md)"
    )
    parser.add_argument("--adapter", help="LoRA adapter dir (peft layout) to load onto --checkpoint")
    add_trust_arg(parser)
    add_sampler_args(parser, seed_default=None)


def print_results(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    proto = results["protocol"]
    harness = f" · {proto['harness']} {proto['task']}" if "harness" in proto else ""
    table = Table(title=f"GSM8K {proto['split']} · sampler {proto['sampler']}{harness}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results["metrics"].items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    s = proto["sampler_settings"]  # only the knobs this sampler takes
    print(
        f"protocol: steps={s['steps']} max_new_tokens={s['max_new_tokens']} block_size={s.get('block_size')} "
        f"threshold={s.get('threshold')} temperature={s.get('temperature')} n_shot={proto['n_shot']} "
        f"limit={proto['limit']} seed={proto['seed']} template={proto['chat_template_sha256']}\n"
        f"checkpoint: {proto['checkpoint']}"
    )


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.inference.generate import sampler_overrides
    from dllmflow.settings import load_settings

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    settings = load_settings(args.params) if args.params else None
    overrides = {**sampler_overrides(args), "mask_id": args.mask_id, "adapter": args.adapter,
                 "trust_remote_code": getattr(args, "trust_remote_code", False)}  # fmt: skip
    run = evaluate
    if args.harness:
        try:
            from dllmflow.evaluation.harness import check_harness_task, run_harness
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("lm_eval"):
                raise
            raise UserError("--harness needs lm-evaluation-harness: pip install 'dllmflow[lmeval]'") from None
        check_harness_task(args.harness)
        run = partial(run_harness, task=args.harness)
    results = run(
        args.checkpoint, settings, sampler=args.sampler, split=args.split, limit=args.limit,
        overrides=overrides, prepared_dir=args.prepared_dir,
    )  # fmt: skip
    print_results(results)
    if args.output:
        print(f"wrote {atomic_write_json(args.output, results, sort_keys=False)}")
    return 0
