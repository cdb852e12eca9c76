"""The AR baseline (`eval.ar_baseline`): the causal LM a dLLM was converted from, decoding greedily on
the same held-out prompts, scored by the same answer parser as every dLLM sampler.

    from dllmflow.evaluation.ar_baseline import evaluate_ar
    result = evaluate_ar(settings)               # {"metrics", "protocol", "predictions", "model"}
    # in a recipe:  eval: {ar_baseline: true}     -> the flow's `ar` evaluation row (results table, card, MLflow)

The base is `models.build.build_model(settings, tokenizer)` seeded with `train.seed`, as the trainer
builds it before any conversion: for a pretrained recipe the checkpoint at
`model.pretrained_model_name_or_path`, for a tiny random one the untrained base. It decodes causally
(no bidirectional mask) with the `ar` sampler (diffusion/samplers/ar.py: greedy, KV cache,
`eval.max_new_tokens` at most, a row stopping at the tokenizer's stop ids), as an `ar` export (the AR
control) decodes. The prompts (chat template + generation prompt of the prepared tokenizer), the
examples (`eval.limit` of the held-out split), the batch size and the metrics (exact match, tokens/s,
NFE = forwards per example) are those of `dllmflow evaluate` (protocol.py, accuracy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dllmflow.settings.pipeline import AR_EVALUATION


def build_ar_base(settings: Any, tokenizer: Any, device: str | None = None) -> Any:
    """The causal LM the trainer converts (`build_model`, seeded with `train.seed`), in eval mode on
    `device` (None = cuda if available; bf16 there, fp32 on CPU as `dllmflow evaluate` loads)."""
    from dllmflow.models.build import build_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(settings.train.seed)  # a tiny base is drawn from the RNG, as the trainer draws it
    model = build_model(settings, tokenizer)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return model.to(device=device, dtype=dtype).eval()


def build_ar_sampler(model: Any, tokenizer: Any, max_new_tokens: int) -> Any:
    """The `ar` sampler (greedy, KV cache, left-padded batches) on a causal LM: what decodes the AR base
    here and an `ar` export (the AR control) everywhere else."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.configs import build_sampler_config

    return SAMPLERS["ar"](model, tokenizer, build_sampler_config("ar", {"max_new_tokens": max_new_tokens}))


def ar_model_name(settings: Any) -> str:
    if settings.model.tiny is not None:
        return f"AR base: untrained tiny (train.seed {settings.train.seed})"
    return f"AR base: {settings.model.pretrained_model_name_or_path}"


def evaluate_ar(
    settings: Any,
    *,
    split: str | None = None,
    limit: int | None = None,
    prepared_dir: str | Path | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """Greedy exact match and speed of the AR base on `split` (default eval.split) of the prepared data.
    limit: None = eval.limit. model: an already built base (else `build_ar_base`). -> {"metrics",
    "protocol", "predictions", "model"}, the shape of `evaluate`'s result."""
    from dllmflow.data.task import ANSWER_PARSER
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.evaluation.accuracy import generate_in_batches, score_metrics, score_predictions
    from dllmflow.evaluation.protocol import eval_prompts, split_sha256, template_hash

    ev = settings.eval
    split = split or ev.split
    limit = limit if limit is not None else ev.limit
    prepared_dir = Path(prepared_dir or settings.dataset.prepared_dir)
    tokenizer = load_tokenizer(str(prepared_dir))
    model = model if model is not None else build_ar_base(settings, tokenizer)
    asked = eval_prompts(tokenizer, prepared_dir, split, limit, ev.n_shot)
    runner = build_ar_sampler(model, tokenizer, ev.max_new_tokens)
    decoded = generate_in_batches(
        runner, asked.prompts, asked.order, ev.batch_size, f"evaluate {AR_EVALUATION} (greedy)"
    )
    predictions = score_predictions(asked.rows, asked.chats, decoded, tokenizer)
    protocol = {
        "sampler": AR_EVALUATION,
        "decoding": "greedy, causal, KV cache",
        "sampler_settings": {"max_new_tokens": ev.max_new_tokens},
        "max_new_tokens": ev.max_new_tokens,
        "n_shot": ev.n_shot,
        "chat_template_sha256": template_hash(tokenizer),
        "limit": limit,
        "split": split,
        "split_sha256": split_sha256(prepared_dir, split),
        "answer_parser": ANSWER_PARSER,
        "batch_size": ev.batch_size,
        "base_model": settings.model.pretrained_model_name_or_path,
        "prepared_dir": str(prepared_dir),
        **asked.protocol(),
    }
    return {
        "metrics": score_metrics(predictions, decoded.elapsed_s),
        "protocol": protocol,
        "predictions": predictions,
        "model": ar_model_name(settings),
    }
