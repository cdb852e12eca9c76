"""What `dllmflow serve` accepts, for a causal LM and a dLLM alike: the bounded body read, the JSON decode
and the strict OpenAI schemas of chat and text completions. Every refusal is a `RequestError` whose
message names the field (or the limit and the flag that sets it); `inference/serve.py` turns it into the
HTTP error body.

    raw = await read_body(request, limits.max_body_bytes)   # 413 past the cap, read as a stream
    chat = parse_request(raw, limits, ChatBody)             # 400: bad JSON, too deep, bad/unknown field
    text = parse_request(raw, limits, CompletionBody)       # `prompt` is one string

A dLLM server parses `DllmChatBody` / `DllmCompletionBody`: the same fields plus the vendor key
`dllmflow` of per-request sampler overrides, e.g. `{"dllmflow": {"threshold": 0.9, "cache": "dual"}}`
(checked by `diffusion.samplers.asked.build_asked_config`, like `serve --sampler-setting`: a bad option is
400 naming `dllmflow.<field>`); its `top_p` may only be 1 (no nucleus) and `max_tokens` is the sampler's
`max_new_tokens` (`dllmflow.max_new_tokens` is refused).

Limits (`RequestLimits`): the body size (`--max-body-bytes`, HTTP 413; the declared Content-Length is
checked first, then the bytes actually received, so a missing or lying header cannot make the server
buffer more than the cap), the JSON nesting depth (`MAX_JSON_DEPTH`, 400), the number of messages
(`--max-messages`, 400) and `max_tokens` (`--max-tokens-cap`, 400). `parse_request` is CPU work on up
to a whole body: the server runs it off the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dllmflow.diffusion.samplers.asked import SEED_MAX, SEED_MIN, TEMPERATURE_MAX

DEFAULT_MAX_TOKENS = 256  # when a request gives neither max_tokens nor max_completion_tokens
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, above any context this server runs
DEFAULT_MAX_MESSAGES = 256
MAX_JSON_DEPTH = 32  # a chat body is 4 levels deep; chat_template_kwargs may nest a little


@dataclass(frozen=True)
class RequestLimits:
    max_tokens_cap: int = 1024
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES


class RequestError(ValueError):
    """A request the server refuses with HTTP `status` (400 by default); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


# ---- schema -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: a bool is not an int, "1" is not a number; extra keys are refused, never dropped.
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: str
    content: str
    name: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    """What every completion request may hold. `temperature`, `top_p` and `max_tokens` stay None when not
    given: the engine fills its own default (`inference/serve.py`)."""

    # fields a request may only set to 1, and why (the message a client sees otherwise)
    ONE_ONLY: ClassVar[dict[str, str]] = {"n": "this server returns one choice"}

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # the request's own sampling generator
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def check(self) -> None:
        """What a field's own validation cannot see (a RequestError); nothing here."""


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class CompletionBody(_Body):
    prompt: str = Field(min_length=1)


class _DllmBody(_Body):
    """A dLLM request: plus the vendor key `dllmflow` of sampler overrides (`inference/dllm_serve.py`)."""

    ONE_ONLY: ClassVar[dict[str, str]] = {**_Body.ONE_ONLY, "top_p": "dLLM samplers have no nucleus"}

    top_p: float | None = Field(None, ge=1.0, le=1.0)
    dllmflow: dict[str, Any] = Field(default_factory=dict)

    def check(self) -> None:
        if "max_new_tokens" in self.dllmflow:
            raise RequestError(
                "'dllmflow.max_new_tokens': give 'max_tokens' instead", "dllmflow.max_new_tokens"
            )

    def sampler_overrides(self) -> dict[str, Any]:
        """The request's sampler options: the vendor key's, then temperature and seed when given."""
        out = dict(self.dllmflow)
        out.update({k: v for k in ("temperature", "seed") if (v := getattr(self, k)) is not None})
        return out


class DllmChatBody(_DllmBody, ChatBody):
    pass


class DllmCompletionBody(_DllmBody, CompletionBody):
    pass


# ---- reading and decoding -----------------------------------------------------------------------


def _too_large(max_bytes: int) -> RequestError:
    return RequestError(
        f"the request body is larger than this server's limit of {max_bytes} bytes (--max-body-bytes)",
        status=413,
    )


async def read_body(request, max_bytes: int) -> bytes:
    """The body of a Starlette `request`, read chunk by chunk and abandoned as soon as it passes
    `max_bytes` (RequestError 413); the server discards what the client still sends."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether `obj` nests lists/dicts more than `limit` levels (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def decode_json(raw: bytes) -> Any:
    """JSON bytes -> Python; RequestError 400 for invalid JSON or nesting deeper than MAX_JSON_DEPTH."""
    too_deep = RequestError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder's own guard against deep nesting
        raise too_deep from None
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON") from None
    if _deeper_than(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


# ---- validation ---------------------------------------------------------------------------------


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _explain(err: dict[str, Any], schema: type[_Body]) -> RequestError:
    """One pydantic error -> a message naming the field, what is wrong and what is accepted."""
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        where = f"this server honours {', '.join(schema.model_fields)}"
        if len(err["loc"]) > 1 and err["loc"][0] == "messages":
            where = "a message may hold role, content, name and reasoning_content"
        return RequestError(f"'{param}' is not supported: {where}", param)
    if param in schema.ONE_ONLY:
        return RequestError(f"'{param}' must be 1 (got {err['input']!r}): {schema.ONE_ONLY[param]}", param)
    got = repr(err["input"])
    return RequestError(f"'{param}': {err['msg']} (got {got[:80]}{'...' if len(got) > 80 else ''})", param)


def parse_body(body: Any, limits: RequestLimits, schema: type[_Body] = ChatBody) -> Any:
    """Validate a decoded request body against `schema` (a chat or text completion, causal or dLLM) and
    the server's `limits`; raises RequestError with the message the client sees (HTTP 400). The
    returned body's `max_tokens` is the one asked (`max_tokens` or `max_completion_tokens`), or None."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if (
        "messages" in schema.model_fields
        and isinstance(messages, list)
        and len(messages) > limits.max_messages
    ):
        raise RequestError(
            f"'messages' holds {len(messages)} messages, above this server's limit of "
            f"{limits.max_messages} (--max-messages)",
            "messages",
        )
    try:
        req = schema.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise _explain(e.errors()[0], schema) from None
    alt = getattr(req, "max_completion_tokens", None)  # chat only
    if None not in (req.max_tokens, alt) and req.max_tokens != alt:
        raise RequestError(
            "give 'max_tokens' or 'max_completion_tokens', not two different values", "max_tokens"
        )
    name = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    asked = req.max_tokens or alt
    cap = limits.max_tokens_cap
    if asked is not None and asked > cap:
        raise RequestError(f"'{name}' is {asked}, above this server's cap of {cap} (--max-tokens-cap)", name)
    req.check()
    if req.stream_options is not None and not req.stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    return req.model_copy(update={"max_tokens": asked})


def parse_request(raw: bytes, limits: RequestLimits, schema: type[_Body] = ChatBody) -> Any:
    """The body bytes of a request -> its validated `schema` body (RequestError 400 otherwise)."""
    return parse_body(decode_json(raw), limits, schema)
