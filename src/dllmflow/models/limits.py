"""What a loaded model can take at generation time: its vocabulary and position range.

    from dllmflow.models.limits import check_generation_fits
    check_generation_fits(model, prompt_length=max(map(len, ids)), max_new_tokens=128, mask_id=M)

Called by `dllmflow generate` and `dllmflow evaluate` before the first forward, so that a mask id
outside the embedding (an IndexError deep in the model) or a canvas far beyond the trained
positions (`--max-new-tokens 100000` allocates tens of GB of attention) becomes one clear error.
"""

from __future__ import annotations

from typing import Any

from dllmflow.errors import UserError


def vocab_rows(model: Any) -> int | None:
    """Rows of the input embedding (the ids the model can look up); None if the model hides them."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        return config_vocab_size(model)


def config_vocab_size(model: Any) -> int | None:
    """`vocab_size` of the model's (text) config, what the strategies check `dllm.*` ids against; None
    for a model without a config."""
    return getattr(_text_config(model), "vocab_size", None)


def max_positions(model: Any) -> int | None:
    """The model's `max_position_embeddings` (text config of composite models); None if it has none."""
    return getattr(_text_config(model), "max_position_embeddings", None)


def check_generation_fits(model: Any, prompt_length: int, max_new_tokens: int, mask_id: int | None) -> None:
    """UserError naming the flag when the mask id is not a row of the embedding (None: a causal sampler
    fills no mask), or the longest prompt plus `max_new_tokens` exceeds the model's positions."""
    rows = vocab_rows(model)
    if rows is not None and mask_id is not None and not 0 <= mask_id < rows:
        raise UserError(
            f"--mask-id {mask_id} (or dllm.mask_token_id) is outside the model's vocabulary "
            f"(0..{rows - 1}); pass the mask token id the model was trained with"
        )
    limit = max_positions(model)
    if limit is not None and prompt_length + max_new_tokens > limit:
        room = limit - prompt_length  # --max-new-tokens must be >= 1: suggest it only when one fits
        fix = (f"use --max-new-tokens {room} or less" if room >= 1
               else "the prompt alone fills them: shorten the prompt")  # fmt: skip
        raise UserError(
            f"--max-new-tokens {max_new_tokens} (or eval.max_new_tokens) plus the longest prompt "
            f"({prompt_length} tokens) exceeds the model's max_position_embeddings ({limit}); {fix}"
        )


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config
