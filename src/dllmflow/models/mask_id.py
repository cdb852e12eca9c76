"""The [MASK] token id, looked up in one order everywhere (docs/strategies.md §3.0): an explicit id (a flag, the
settings' `dllm.mask_token_id`) > the tokenizer's mask token > `model.config.mask_token_id`.

    mask_id = find_mask_id(settings.dllm.mask_token_id, tokenizer=tokenizer)       # None when unknown
    mask_id = resolve_mask_id(args.mask_id, tokenizer, model)                       # UserError when unknown
"""

from __future__ import annotations

from typing import Any

from dllmflow.errors import UserError


def find_mask_id(*explicit: int | None, tokenizer: Any = None, model: Any = None) -> int | None:
    """The first id that is set among `explicit` (in order), the tokenizer's and the model config's."""
    config = getattr(model, "config", None)
    for candidate in (
        *explicit,
        getattr(tokenizer, "mask_token_id", None),
        getattr(config, "mask_token_id", None),
    ):
        if candidate is not None:
            return int(candidate)
    return None


def resolve_mask_id(explicit: int | None, tokenizer: Any, model: Any = None) -> int:
    """`find_mask_id`, or a UserError that says how to give one."""
    found = find_mask_id(explicit, tokenizer=tokenizer, model=model)
    if found is None:
        raise UserError(
            "no mask token id: the tokenizer has no mask token and model.config.mask_token_id is unset; "
            "pass --mask-id"
        )
    return found
