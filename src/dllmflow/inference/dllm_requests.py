"""What `dllmflow serve` accepts for a dLLM: the OpenAI chat and text completion bodies, strict as the
causal server's (`inference/requests.py`: the same body cap, JSON depth, message cap, unknown fields
refused by name), plus the vendor key `dllmflow` of per-request sampler overrides.

    chat = parse_dllm_request(raw, limits, chat=True)     # DllmChatBody (400 naming the field otherwise)
    text = parse_dllm_request(raw, limits, chat=False)    # CompletionBody: `prompt` is one string

    {"model": "m", "messages": [...], "max_tokens": 16, "dllmflow": {"threshold": 0.9, "cache": "dual"}}

The overrides are checked by `diffusion.samplers.asked.build_asked_config` (what `serve
--sampler-setting`, `generate`'s flags and the registered pyfunc's params go through too): each value
parsed strictly by its field's type (no string or bool for a number, no float for an int, finite
floats), then capped (`steps` by the generation length and `--max-tokens-cap`); an option the sampler
does not take or a bad value is HTTP 400 naming `dllmflow.<field>`. `temperature` and `seed` are the sampler's (absent: the
recorded ones; dLLM samplers decode greedily unless told otherwise); `top_p` has no dLLM meaning and only
1 is accepted; `max_tokens` is the sampler's `max_new_tokens`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from dllmflow.diffusion.samplers.asked import SEED_MAX, SEED_MIN, TEMPERATURE_MAX
from dllmflow.inference.requests import (
    Message,
    RequestError,
    RequestLimits,
    StreamOptions,
    _explain,
    _Strict,
    decode_json,
)

VENDOR_KEY = "dllmflow"


class _DllmBody(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=1.0, le=1.0)  # a dLLM sampler has no nucleus: 1 only
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    dllmflow: dict[str, Any] = Field(default_factory=dict)  # sampler overrides (module docstring)

    def sampler_overrides(self) -> dict[str, Any]:
        """The request's sampler options: the vendor key's, then temperature and seed when given."""
        out = dict(self.dllmflow)
        out.update({k: v for k in ("temperature", "seed") if (v := getattr(self, k)) is not None})
        return out


class DllmChatBody(_DllmBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class CompletionBody(_DllmBody):
    prompt: str = Field(min_length=1)


def parse_dllm_request(raw: bytes, limits: RequestLimits, *, chat: bool) -> DllmChatBody | CompletionBody:
    """The body bytes of a chat (`chat`) or text completion request -> its validated body; RequestError
    (400, naming the field) otherwise. `max_tokens` stays None when the request gives none (the server
    then decodes the recorded `max_new_tokens`)."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    schema = DllmChatBody if chat else CompletionBody
    messages = body.get("messages")
    if chat and isinstance(messages, list) and len(messages) > limits.max_messages:
        raise RequestError(
            f"'messages' holds {len(messages)} messages, above this server's limit of "
            f"{limits.max_messages} (--max-messages)",
            "messages",
        )
    try:
        req = schema.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"] and err["loc"][0] == "top_p":
            message = f"'top_p' must be 1 (got {err['input']!r}): dLLM samplers have no nucleus"
            raise RequestError(message, "top_p") from None
        raise _explain(err, tuple(schema.model_fields)) from None
    asked = req.max_tokens
    if chat:
        if (
            None not in (req.max_tokens, req.max_completion_tokens)
            and req.max_tokens != req.max_completion_tokens
        ):
            raise RequestError(
                "give 'max_tokens' or 'max_completion_tokens', not two different values", "max_tokens"
            )
        asked = req.max_tokens or req.max_completion_tokens
    if asked is not None and asked > limits.max_tokens_cap:
        raise RequestError(
            f"'max_tokens' is {asked}, above this server's cap of {limits.max_tokens_cap} (--max-tokens-cap)",
            "max_tokens",
        )
    if "max_new_tokens" in req.dllmflow:
        raise RequestError("'dllmflow.max_new_tokens': give 'max_tokens' instead", "dllmflow.max_new_tokens")
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    return req.model_copy(update={"max_tokens": asked})
