"""`dllmflow evaluate`: GSM8K exact match and decoding speed of a checkpoint with one sampler.

    dllmflow evaluate --checkpoint runs/tiny_mdlm/checkpoints --limit 8
    dllmflow evaluate --checkpoint CKPT --params params/tiny_mdlm.yaml --sampler llada --threshold 0.9 \
        --output results.json
    dllmflow evaluate --checkpoint CKPT --sweep threshold=none,0.9 --sweep cache=none,dual   # sweep.py

Prompts and reference answers come from the prepared data's held-out split (`dataset.prepared_dir`,
split `eval`): the prompt is the chat without its last assistant turn, rendered with the
checkpoint's chat template and the generation prompt. Scores: strict (the number after `####`) and
flexible (the last number in the text), commas and `$` ignored. Speed: tokens/s over generated
(trimmed) tokens, NFE = forward passes per example, tokens per forward, and where the sampler counts
them the positions computed per answer and the effective-token ratio (answer tokens ÷ positions
computed: what padding and re-computed prompts cost); each prediction carries its own NFE, tokens per
forward, positions and ratio. The protocol (sampler and all
its settings, generation length, n-shot, chat template hash, limit, split, seed) is returned with the
metrics and the predictions. In Python: `evaluate(checkpoint, settings, sampler="llada", limit=8)`.
`--harness gsm8k` scores the same rows through lm-evaluation-harness instead (harness.py). The prompts
and the checkpoint loading both share live in protocol.py, the answer extraction in data/task.py. The
checkpoint is resolved once per evaluation (`inference.resolved.resolve`, or by the caller) and that
resolution is what the steps below are handed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from dllmflow.common.files import atomic_write_json
from dllmflow.common.outputs import check_output_file
from dllmflow.common.progress import Progress
from dllmflow.data.task import ANSWER_PARSER, gold_answer, gsm8k_extract_flexible, gsm8k_extract_strict
from dllmflow.errors import UserError
from dllmflow.evaluation.protocol import (
    EvalPrompts,
    EvalRunner,
    build_eval_runner,
    default_eval_sampler,
    eval_prompts,
    resolve_prepared_dir,
    split_sha256,
    template_hash,
)
from dllmflow.inference.resolved import ResolvedCheckpoint, resolve

# ---- evaluation ---------------------------------------------------------------------------------

RESULT_KEYS = ("metrics", "protocol")  # what every `evaluate --output` JSON holds: proves a file is one


def evaluate(
    checkpoint: str | Path | ResolvedCheckpoint,
    settings: Any = None,
    sampler: str | None = None,
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
    loaded = build_eval_runner(checkpoint, settings, sampler, overrides)
    return evaluate_loaded(loaded, split=split, limit=limit, prepared_dir=prepared_dir)


@dataclass
class Asked:
    """What an evaluation of `loaded` asks: its prepared dir, row limit, shots and prompts."""

    prepared_dir: Path
    limit: int | None
    n_shot: int
    asked: EvalPrompts


def asked_of(loaded: EvalRunner, split: str, limit: int | None, prepared_dir: str | Path | None) -> Asked:
    """The prompts `evaluate_loaded` asks (limit and shots from the eval section where unset): one
    place, so a sweep's timing pass asks what its evaluations asked."""
    eval_cfg = loaded.eval_cfg
    where = resolve_prepared_dir(loaded.checkpoint.given, loaded.settings, prepared_dir)
    limit = limit if limit is not None else getattr(eval_cfg, "limit", None)
    n_shot = eval_cfg.n_shot if eval_cfg is not None else 0
    return Asked(where, limit, n_shot, eval_prompts(loaded.tokenizer, where, split, limit, n_shot))


def evaluate_loaded(
    loaded: EvalRunner,
    *,
    split: str = "eval",
    limit: int | None = None,
    prepared_dir: str | Path | None = None,
) -> dict[str, Any]:
    """`evaluate` with the checkpoint already loaded (`build_eval_runner`; a sweep rebuilds only the
    sampler per point with `loaded.with_overrides`): it records `loaded.checkpoint` as what it ran."""
    from dllmflow.models.limits import check_generation_fits

    # 1) what to run
    runner, eval_cfg, sampler = loaded.runner, loaded.eval_cfg, loaded.sampler
    config = runner.config  # as it ran (scdd: the schedule read from the checkpoint)
    batch_size = eval_cfg.batch_size if eval_cfg is not None else 8

    # 2) prompts, shortest first so a batch pads little
    q = asked_of(loaded, split, limit, prepared_dir)
    prepared_dir, limit, n_shot, asked = q.prepared_dir, q.limit, q.n_shot, q.asked
    rows, chats, prompts, order = asked.rows, asked.chats, asked.prompts, asked.order
    check_generation_fits(loaded.model, len(prompts[order[-1]]), config.max_new_tokens, runner.mask_id)

    # 3) generate in batches, 4) score
    decoded = generate_in_batches(runner, prompts, order, batch_size, f"evaluate {sampler}")
    predictions = score_predictions(rows, chats, decoded, loaded.tokenizer)
    from dllmflow.diffusion.modes import decoding_of

    mode = getattr(getattr(loaded.trained, "dllm", None), "mode", None)
    protocol = {
        "sampler": sampler,
        "decoding": decoding_of(mode, sampler),  # uno: lossless (the LM's own answers) or lossy
        "sampler_settings": config.model_dump(mode="json"),
        "max_new_tokens": config.max_new_tokens,
        "n_shot": n_shot,
        "chat_template_sha256": template_hash(loaded.tokenizer),
        "limit": limit,
        "split": split,
        "split_sha256": split_sha256(prepared_dir, split),
        "answer_parser": ANSWER_PARSER,
        "seed": config.seed,
        "batch_size": batch_size,
        "mask_id": runner.mask_id,
        **loaded.checkpoint.record,
        "prepared_dir": str(prepared_dir),
        **asked.protocol(),
    }
    metrics = score_metrics(predictions, decoded.elapsed_s) | decoded.draft_metrics()
    return {"metrics": metrics, "protocol": protocol, "predictions": predictions}


def run_sweep(
    checkpoint: str | Path | ResolvedCheckpoint,
    settings: Any,
    sampler: str,
    axes: dict[str, list],
    *,
    split: str = "eval",
    limit: int | None = None,
    overrides: dict[str, Any] | None = None,
    prepared_dir: str | Path | None = None,
    strict: bool = True,
    tolerance: float = 0.01,
    metric: str = "exact_match_flexible",
) -> dict[str, Any]:
    """Evaluate `sampler` at every point of `axes` (over `overrides` and the eval section), the model
    loaded once. Points that run the same effective setting (None = a preset equal to a listed value)
    are evaluated once. -> the chosen point's {"metrics", "protocol", "predictions"} plus "sweep":
    {"grid", "metric", "tolerance", "points": [{"setting", "metrics", "sampler_settings"}], "pareto",
    "chosen"}."""
    from dllmflow.evaluation.sweep import (
        choose_setting,
        effective_setting,
        pareto_front,
        sampler_points,
        setting_label,
    )

    requested = sampler_points(sampler, axes, strict=strict)
    base = dict(overrides or {})
    loaded = build_eval_runner(checkpoint, settings, sampler, {**base, **requested[0]})
    sampler_options = {k: v for k, v in base.items() if k not in ("mask_id", "adapter", "trust_remote_code")}
    points, results, runners, seen = [], [], [], set()
    for i, point in enumerate(requested):
        runner = loaded if i == 0 else loaded.with_overrides({**sampler_options, **point})
        setting = effective_setting(runner.runner.config, list(point))
        key = tuple(sorted(setting.items(), key=lambda kv: kv[0]))
        if key in seen:
            continue
        seen.add(key)
        print(f"sweep {sampler} [{len(points) + 1}/{len(requested)}] {setting_label(setting)}", flush=True)
        result = evaluate_loaded(runner, split=split, limit=limit, prepared_dir=prepared_dir)
        points.append({"setting": setting, "metrics": result["metrics"],
                       "sampler_settings": result["protocol"]["sampler_settings"]})  # fmt: skip
        results.append(result)
        runners.append(runner.runner)
    if len(points) > 1:
        # The choice reads speeds timed with the points taking turns on the same prompts: each point's
        # own evaluation pass ran at its own moment, and a flow runs other evaluations beside it, so
        # those tok/s compare moments as much as settings (measured: a 2-forward point timed slower
        # than its 8-forward neighbour).
        from dllmflow.evaluation.speed import measure_speeds

        prompts = asked_of(loaded, split, limit, prepared_dir).asked.prompts
        speeds = measure_speeds(dict(enumerate(runners)), dict.fromkeys(range(len(runners)), prompts))
        for i, point in enumerate(points):
            point["timed"] = speeds[i]  # beside the metrics: those stay the evaluation's own
    chosen = choose_setting(points, tolerance, metric)
    sweep = {"grid": axes, "metric": metric, "tolerance": tolerance, "points": points,
             "pareto": pareto_front(points, metric), "chosen": chosen}  # fmt: skip
    return {**results[chosen], "sweep": sweep}


@dataclass
class Decoded:
    """The answers to a list of prompts, by prompt index, with what each cost."""

    sequences: dict[int, list[int]] = field(default_factory=dict)  # generated ids
    costs: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # (forwards, positions | None)
    elapsed_s: float = 0.0  # seconds spent generating
    draft_fed: list[int] = field(default_factory=list)  # per draft offset (drafting samplers: selfspec)
    draft_accepted: list[int] = field(default_factory=list)

    def add_drafts(self, fed: list[int], accepted: list[int]) -> None:
        n = max(len(self.draft_fed), len(fed))
        pad = lambda a: list(a) + [0] * (n - len(a))  # noqa: E731
        self.draft_fed = [a + b for a, b in zip(pad(self.draft_fed), pad(fed))]
        self.draft_accepted = [a + b for a, b in zip(pad(self.draft_accepted), pad(accepted))]

    def draft_metrics(self) -> dict[str, float]:
        """`draft_acc_k{k}`: the share of checks that fed a k-th draft and accepted it (none without drafts)."""
        return {f"draft_acc_k{k}": a / f for k, (f, a) in enumerate(zip(self.draft_fed, self.draft_accepted), 1)
                if f}  # fmt: skip


def generate_in_batches(
    runner: Any, prompts: list[list[int]], order: list[int], batch_size: int, label: str
) -> Decoded:
    """Generate for `prompts` in `order`, `batch_size` at a time. Each prompt's cost: its forwards and
    its positions computed (None where the sampler does not count them)."""
    out = Decoded()
    with Progress(label, len(order), unit="examples", every=batch_size) as bar:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            result = runner.generate([prompts[i] for i in idx])
            out.sequences.update(zip(idx, result.sequences))
            out.elapsed_s += result.elapsed_s
            nfes = result.row_nfe or [result.nfe] * len(idx)
            positions = getattr(result, "row_positions", None) or [None] * len(idx)
            out.costs.update(zip(idx, zip(nfes, positions)))
            out.add_drafts(getattr(result, "draft_fed", []), getattr(result, "draft_accepted", []))
            bar.advance(len(idx))
    return out


def score_predictions(
    rows: list[dict], chats: list[list[dict]], decoded: Decoded, tokenizer: Any
) -> list[dict[str, Any]]:
    """One prediction per row: the decoded response, its strict and flexible answers, whether each
    equals the gold answer, and its decoding cost (NFE, tokens per forward, positions computed and the
    effective-token ratio: answer tokens / positions; None when not counted)."""
    from dllmflow.inference.generate import decode_response

    predictions = []
    for i, r in enumerate(rows):
        ids, (nfe, positions) = decoded.sequences[i], decoded.costs[i]
        text = decode_response(tokenizer, ids)
        gold = gold_answer(r["answer"])
        strict, flexible = gsm8k_extract_strict(text), gsm8k_extract_flexible(text)
        predictions.append(
            dict(id=r["id"], prompt=chats[i][-1]["content"] if chats[i] else "", prediction=text, answer=gold,
                 pred_strict=strict, pred_flexible=flexible,
                 correct_strict=strict is not None and strict == gold,
                 correct_flexible=flexible is not None and flexible == gold, num_tokens=len(ids), ids=list(ids),
                 nfe=nfe, tokens_per_forward=len(ids) / max(nfe, 1), positions=positions,
                 effective_token_ratio=None if not positions else len(ids) / positions)
        )  # fmt: skip
    return predictions


def score_metrics(predictions: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Exact match (strict, flexible) beside speed: tokens/s, forwards per example, tokens per forward,
    and where every prediction counts its positions computed (`score_predictions`), their mean per
    answer and the effective-token ratio (answer tokens ÷ positions computed, over all answers)."""
    n = len(predictions)
    tokens = sum(p["num_tokens"] for p in predictions)
    row_nfe = sum(p["nfe"] for p in predictions)
    metrics = {
        "exact_match_strict": sum(p["correct_strict"] for p in predictions) / n,
        "exact_match_flexible": sum(p["correct_flexible"] for p in predictions) / n,
        "tokens_per_s": tokens / max(elapsed, 1e-9),
        "nfe": row_nfe / n,
        "tokens_per_forward": tokens / max(row_nfe, 1),
        "num_examples": n,
    }
    positions = [p.get("positions") for p in predictions]
    if all(positions):
        metrics["positions_per_answer"] = sum(positions) / n
        metrics["effective_token_ratio"] = tokens / sum(positions)
    return metrics


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
    parser.add_argument(
        "--sampler",
        help="default: the first of the recipe's eval.samplers that fits the checkpoint's mode, else the "
        "checkpoint's own (its export's, else its mode's first); one that does not fit the mode is refused",
    )
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples")
    parser.add_argument("--split", default="eval")
    add_flag(parser, "--prepared-dir", help="default: dataset.prepared_dir of the settings")
    parser.add_argument("--output", help="write metrics, protocol and predictions to this JSON file")
    parser.add_argument(
        "--harness", metavar="TASK", help="score with lm-evaluation-harness instead (gsm8k; docs/lm_eval.md)"
    )
    parser.add_argument("--adapter", help="LoRA adapter dir (peft layout) to load onto --checkpoint")
    sweep = parser.add_argument_group("accuracy-speed sweep (evaluation/sweep.py)")
    sweep.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        help="evaluate every combination (threshold, cache, steps, block-size; none = the preset); repeat "
        "per key. Prints each point, the Pareto frontier and the fastest within --sweep-tolerance",
    )
    add_flag(sweep, "--sweep-file", help="YAML/JSON grid, e.g. {threshold: [null, 0.9], cache: [none, dual]}")
    add_flag(
        sweep,
        "--sweep-tolerance",
        type=float,
        help="exact match a faster point may give up; default eval.sweep_tolerance",
    )
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
        f"threshold={s.get('threshold')} cache={s.get('cache', 'none')} temperature={s.get('temperature')} "
        f"n_shot={proto['n_shot']} "
        f"limit={proto['limit']} seed={proto['seed']} template={proto['chat_template_sha256']}\n"
        f"checkpoint: {proto['checkpoint']}"
    )


def cli_main(args: argparse.Namespace) -> int:
    from dllmflow.inference.generate import sampler_overrides
    from dllmflow.settings import load_settings

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.output:  # before the model loads: replaced only if it is an evaluation result already
        check_output_file(args.output, kind="dllmflow evaluation result", keys=RESULT_KEYS, field="--output")
    settings = load_settings(args.params) if args.params else None
    checkpoint = args.checkpoint  # resolved once: here when the default sampler needs it, else at the load
    if args.sampler is None:  # from the checkpoint's mode and the recipe, before anything loads
        checkpoint = resolve(args.checkpoint)
        args.sampler = default_eval_sampler(checkpoint, settings)
    overrides = {**sampler_overrides(args), "mask_id": args.mask_id, "adapter": args.adapter,
                 "trust_remote_code": getattr(args, "trust_remote_code", False)}  # fmt: skip
    if args.sweep or args.sweep_file:
        return _cli_sweep(args, checkpoint, settings, overrides)
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
        checkpoint, settings, sampler=args.sampler, split=args.split, limit=args.limit,
        overrides=overrides, prepared_dir=args.prepared_dir,
    )  # fmt: skip
    print_results(results)
    if args.output:
        print(f"wrote {atomic_write_json(args.output, results, sort_keys=False)}")
    return 0


def _cli_sweep(
    args: argparse.Namespace, checkpoint: str | ResolvedCheckpoint, settings: Any, overrides: dict[str, Any]
) -> int:
    from dllmflow.evaluation.sweep import build_grid, sweep_table

    if args.harness:
        raise UserError("--sweep runs `dllmflow evaluate`'s own scoring; drop --harness")
    axes = build_grid(args.sweep, args.sweep_file)
    tolerance = args.sweep_tolerance
    if tolerance is None:
        tolerance = settings.eval.sweep_tolerance if settings is not None else 0.01
    if not 0 <= tolerance <= 1:
        raise UserError(f"--sweep-tolerance must be in [0, 1], got {tolerance}")
    results = run_sweep(
        checkpoint, settings, args.sampler, axes, split=args.split, limit=args.limit,
        overrides=overrides, prepared_dir=args.prepared_dir, tolerance=tolerance,
    )  # fmt: skip
    print(sweep_table(results))
    if args.output:
        print(f"wrote {atomic_write_json(args.output, results, sort_keys=False)}")
    return 0
