"""The HTTP side of `dllmflow serve`: an OpenAI-compatible chat and text completion API over a `ChatEngine`
(routes, API key, server-sent events); `inference/dllm_serve.py` puts the same server over a dLLM.
Batched decoding lives in `inference/engine.py` and `inference/scheduler.py`, request validation in
`inference/requests.py`, the command line and `local_server` in `inference/serve_cli.py`.

    dllmflow serve --model-path runs/target --port 30000 --served-model-name target
    curl -s localhost:30000/v1/chat/completions -d '{"model": "target", "messages": [{"role": "user", "content": "hi"}]}'

    app = build_app(ChatEngine("runs/target"), "target", max_tokens_cap=1024)   # a Starlette app
    uvicorn.run(app, port=30000)

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (a `prompt` string, encoded as
`dllmflow generate --raw` does; also `"stream": true`: server-sent `chat.completion.chunk` /
`text_completion` events ending in `data: [DONE]`), `GET /v1/models`, `GET /health` (200 once the model is loaded) and `GET /stats`
(counters, for tests and benchmarks). Production users point `dllmflow regenerate --target-server` at
SGLang or vLLM instead; this server exists so the pipeline runs without them.

Requests are validated strictly (`inference/requests.py`): the honoured fields are `model`, `messages`
(`role`, `content`, optional `name` and `reasoning_content`, all passed to the chat template; a text
completion's `prompt` instead),
`max_tokens` / `max_completion_tokens` (at most `--max-tokens-cap`), `temperature` in [0, 2], `top_p` in
(0, 1], `seed` (an int64: the request samples from its own generator seeded with it, so the same request
and seed give the same tokens whatever is batched with it), `n` (1 only), `stream`,
`stream_options.include_usage` and `chat_template_kwargs`; any other field is refused with HTTP 400
naming it, never silently ignored (a `null` value counts as absent). A body over `--max-body-bytes` is
HTTP 413 (read as a stream and abandoned at the cap), JSON nested deeper than 32 levels or more than
`--max-messages` messages is 400. Decoding, validation and the chat template run in
a worker thread, so `/health` and other requests stay answered while a large request is examined.

Scheduling (`inference/scheduler.py`): one worker owns the model. Requests that arrive together with the
same sampling settings are batched (up to `--max-batch-size`, left-padded); active batches then take
turns, `--chunk-tokens` new tokens per turn, so a long request delays a short one by a few turns instead
of holding the model until it is done. A request still unanswered after `--request-timeout-s` gets HTTP
504 and its row is dropped from its batch at the next turn. `--api-key` (or $DLLMFLOW_SERVE_API_KEY)
requires that Bearer token on every route except `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dllmflow.inference.engine import ChatEngine, ChatRequest
from dllmflow.inference.requests import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_TOKENS,
    ChatBody,
    CompletionBody,
    RequestError,
    RequestLimits,
    parse_request,
    read_body,
)
from dllmflow.inference.scheduler import Scheduler

# Bodies up to this size are prepared on the event loop (ChatServer.prep): a chat of a few turns, a
# completion prompt. Preparing the demo dLLM's completion takes 0.07 ms on this CPU, less than handing
# it to a thread and back.
INLINE_PREP_BYTES = 16 * 1024


def _error_body(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(status, message, kind, param), status_code=status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(res: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage of a finished request; a dLLM's carries its decoding figures under `dllmflow`."""
    prompt, completion = res["prompt_tokens"], res["completion_tokens"]
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return usage | ({"dllmflow": res["dllmflow"]} if "dllmflow" in res else {})


def _choice(chat: bool, text: str, finish_reason: str | None, *, delta: bool, role: bool = False):
    """One choice of a chat or text completion (`delta`: of a stream chunk)."""
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    content = {"role": "assistant", "content": text} if role or not delta else {"content": text}
    if delta and finish_reason is not None and not text:
        content = {}
    return {"index": 0, ("delta" if delta else "message"): content, "finish_reason": finish_reason}


class ChatServer:
    """The routes over one engine and its scheduler; `build_app` mounts them. Chat and text completions
    share one path (`handle`): read and validate the body (`SCHEMAS`), build the engine's request
    (`build_request`), submit it, then answer it whole (`complete`) or stream it (`stream`). A dLLM
    server (`inference/dllm_serve.py`) changes only the schemas, the request and the model card."""

    SCHEMAS: dict[bool, type] = {True: ChatBody, False: CompletionBody}  # chat? -> the body it parses

    def __init__(
        self, engine: ChatEngine, served_model_name: str, scheduler: Scheduler, limits: RequestLimits,
        request_timeout_s: float, api_key: str | None,
    ):  # fmt: skip
        self.engine, self.name, self.scheduler, self.limits = engine, served_model_name, scheduler, limits
        self.request_timeout_s, self.api_key = request_timeout_s, api_key
        self.stats = {"requests": 0, "completed": 0, "in_flight": 0, "max_in_flight": 0, "timed_out": 0}
        self.stats["rejected"] = 0
        self.preparing = 0  # requests being read and validated (not yet submitted)
        # Decoding, validating and templating a large body is CPU work: it runs here, not on the event
        # loop, and not in the default executor the scheduler's turns use (`prep`).
        self.prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-prep")
        self.timeout_message = (
            f"the request took longer than this server's --request-timeout-s {request_timeout_s:g}"
        )

    # ---- plain routes --------------------------------------------------------------------------------

    def guarded(self, endpoint):
        """The API key applies to every route but /health (a load balancer probes it without one)."""

        async def check(request):
            given = request.headers.get("authorization", "")
            if self.api_key and not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error(
                    401, "missing or wrong API key (expected an Authorization: Bearer header)", "auth_error"
                )
            return await endpoint(request)

        return check

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self.card()]})

    def card(self) -> dict[str, Any]:
        """The served model's `/v1/models` entry."""
        return {
            "id": self.name,
            "object": "model",
            "owned_by": "dllmflow",
            "max_model_len": self.engine.max_length,
        }

    async def get_stats(self, request):
        import torch
        from starlette.responses import JSONResponse

        # threads: what a forward may use (`--threads`), for reading a benchmark's figures
        return JSONResponse({**self.stats, **self.scheduler.stats(), "threads": torch.get_num_threads()})

    # ---- chat and text completions -------------------------------------------------------------------

    async def chat_completions(self, request):
        return await self.handle(request, chat=True)

    async def completions(self, request):
        return await self.handle(request, chat=False)

    async def handle(self, request, *, chat: bool):
        from starlette.responses import StreamingResponse

        self.stats["requests"] += 1
        self.preparing += 1  # the scheduler forms a batch once the requests sent together are in
        try:
            body, req = await self.accept(request, chat)
            self.scheduler.submit(req)
        except RequestError as e:
            self.stats["rejected"] += 1
            return _error(e.status, str(e), param=e.param)
        finally:
            self.preparing -= 1
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        prefix = "chatcmpl" if chat else "cmpl"
        head = {"id": f"{prefix}-{self.stats['requests']}", "created": int(time.time()), "model": self.name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self.stream(req, deadline, head, usage, chat), media_type="text/event-stream"
            )
        return await self.complete(req, deadline, head, chat)

    async def accept(self, request, chat: bool):
        """Read a request's body, then validate and tokenise it and build the engine's request (`prep`)."""
        raw = await read_body(request, self.limits.max_body_bytes)
        return await self.prep(self.prepare, raw, chat)

    async def prep(self, fn, raw: bytes, *args):
        """`fn(raw, *args)`: on the event loop for a body of at most INLINE_PREP_BYTES, else in ONE hop to
        `prep_pool`, so a huge or deeply nested body never stalls the loop (/health, other streams). A
        usual request prepares in ~0.1 ms, less than the hop itself: a thread handoff and GIL round trip,
        serialised over every request that arrives together, which delayed a burst's batch."""
        if len(raw) <= INLINE_PREP_BYTES:
            return fn(raw, *args)
        return await asyncio.get_running_loop().run_in_executor(self.prep_pool, fn, raw, *args)

    def prepare(self, raw: bytes, chat: bool) -> tuple[Any, ChatRequest]:
        """Body bytes -> (validated body, request); RequestError (400/404, naming the field) if refused."""
        body = parse_request(raw, self.limits, self.SCHEMAS[chat])
        self.check_model(body.model)
        if chat:
            prompt_ids = self.encode_chat(body.messages, body.chat_template_kwargs)
        else:  # as `dllmflow generate --raw` encodes a prompt
            prompt_ids = self.engine.tokenizer.encode(body.prompt, add_special_tokens=True)
        req = self.build_request(body, prompt_ids)
        self.check_length(len(prompt_ids), req.max_tokens)
        return body, req

    def build_request(self, body: Any, prompt_ids: list[int]) -> ChatRequest:
        """What the scheduler decodes for a validated body: OpenAI's defaults where the body is silent."""
        max_tokens = body.max_tokens or min(DEFAULT_MAX_TOKENS, self.limits.max_tokens_cap)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        return ChatRequest(prompt_ids, max_tokens, temperature, top_p, stream=body.stream, seed=body.seed)

    def check_model(self, model: str) -> None:
        if model != self.name:
            message = f"model {model!r} does not exist; this server serves {self.name!r}"
            raise RequestError(message, "model", status=404)

    def encode_chat(self, messages: list, template_kwargs: dict[str, Any]) -> list[int]:
        """The conversation through the chat template; template variables only, never its own arguments."""
        if bad := sorted(set(template_kwargs) & self.engine.reserved_template_args):
            param = f"chat_template_kwargs.{bad[0]}"
            raise RequestError(
                f"'{param}' is not allowed: only template variables (e.g. enable_thinking)", param
            )
        try:
            return self.engine.encode([m.model_dump(exclude_none=True) for m in messages], template_kwargs)
        except Exception as e:  # the chat template rejected the conversation
            raise RequestError(
                f"cannot apply the chat template: {type(e).__name__}: {e}", "messages"
            ) from None

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.engine.max_length:
            raise RequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"max_model_len ({self.engine.max_length})",
                "max_tokens",
            )

    def _enter(self) -> None:
        self.stats["in_flight"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])

    async def complete(self, req: ChatRequest, deadline: float, head: dict[str, Any], chat: bool):
        """The whole completion once the scheduler finished the (submitted) row; 504 past the deadline."""
        from starlette.responses import JSONResponse

        self._enter()
        try:
            left = deadline - asyncio.get_running_loop().time()
            kind, res = await asyncio.wait_for(self.answer(req), left)
        except TimeoutError:
            self.stats["timed_out"] += 1
            return _error(504, self.timeout_message, "timeout")
        finally:
            req.cancelled = True  # a no-op once finished; otherwise the scheduler drops the row
            self.stats["in_flight"] -= 1
        if kind == "error":
            return _error(500, f"generation failed: {type(res).__name__}: {res}", "server_error")
        self.stats["completed"] += 1
        obj = "chat.completion" if chat else "text_completion"
        choice = _choice(chat, res["text"], res["finish_reason"], delta=False)
        return JSONResponse({**head, "object": obj, "choices": [choice], "usage": _usage(res)})

    @staticmethod
    async def answer(req: ChatRequest) -> tuple[str, Any]:
        """Wait for "done" or "error" of a submitted request (streamed "tokens" events are skipped)."""
        while (event := await req.events.get())[0] == "tokens":
            pass
        return event

    async def stream(
        self, req: ChatRequest, deadline: float, head: dict[str, Any], include_usage: bool, chat: bool
    ):
        """Server-sent events of a submitted request: (chat: the role first) a text delta whenever the text
        so far grows (a causal turn's tokens, a dLLM's committed block), the finish reason, usage if
        asked, then `[DONE]`. Errors after the 200 go out as an `error` event (504 past the deadline)."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish_reason: str | None = None, role: bool = False) -> str:
            choice = _choice(chat, text, finish_reason, delta=True, role=role)
            return _sse({**head, "object": obj, "choices": [choice]})

        self._enter()
        try:
            if chat:
                yield chunk("", role=True)
            async for event in self.stream_deltas(
                req, deadline, chunk, {**head, "object": obj} if include_usage else None
            ):
                yield event
        finally:  # also on a client disconnect: the scheduler drops the row at its next turn
            req.cancelled = True
            self.stats["in_flight"] -= 1

    async def stream_deltas(
        self, req: ChatRequest, deadline: float, chunk, usage_head: dict[str, Any] | None
    ):
        """The events of `stream` from the request's queue: a text delta (`chunk(text)`) whenever the text
        so far grows, a 504 / 500 `error` event, then the finish reason, usage (on `usage_head`, when
        asked) and `[DONE]`."""
        sent = ""  # the text streamed so far; every delta extends it
        while True:
            try:  # a timeout scope, not wait_for: no task per event, so a block reaches the socket sooner
                async with asyncio.timeout_at(deadline):
                    kind, payload = await req.events.get()
            except TimeoutError:
                self.stats["timed_out"] += 1
                yield _sse(_error_body(504, self.timeout_message, "timeout", None))
                return
            if kind == "error":
                message = f"generation failed: {type(payload).__name__}: {payload}"
                yield _sse(_error_body(500, message, "server_error", None))
                return
            text = payload["text"] if kind == "done" else self.engine.partial_text(payload)
            # A turn may end inside a multi-byte character (decoded as U+FFFD): wait for the rest.
            if text.startswith(sent) and (kind == "done" or not text.endswith("\ufffd")):
                if delta := text[len(sent) :]:
                    yield chunk(delta)
                sent = text
            if kind == "done":
                yield chunk("", payload["finish_reason"])
                if usage_head is not None:
                    yield _sse({**usage_head, "choices": [], "usage": _usage(payload)})
                yield "data: [DONE]\n\n"
                self.stats["completed"] += 1
                return


def build_app(
    engine: ChatEngine,
    served_model_name: str,
    *,
    server_cls: type[ChatServer] = ChatServer,
    max_batch_size: int = 16,
    max_tokens_cap: int = 1024,
    request_timeout_s: float = 300.0,
    chunk_tokens: int = 8,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_messages: int = DEFAULT_MAX_MESSAGES,
):
    """The Starlette app: health, stats, models, chat and text completions, with the scheduler's worker
    running for the app's lifetime. `engine` is loaded before the app starts, so `/health` means ready.
    `server_cls`: `dllm_serve.DllmServer` over a `DllmEngine` (`dllm_serve.build_dllm_app`)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    limits = RequestLimits(max_tokens_cap, max_body_bytes, max_messages)
    scheduler = Scheduler(engine, max_batch_size, chunk_tokens)
    server = server_cls(engine, served_model_name, scheduler, limits, request_timeout_s, api_key)
    scheduler.incoming = lambda: server.preparing

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = asyncio.create_task(scheduler.run())
        yield
        # a dLLM turn stops at its next forward (DllmEngine._abort_check), so the process exits now
        server.engine.stopping = True
        worker.cancel()
        server.prep_pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/stats", server.guarded(server.get_stats), methods=["GET"]),
        Route("/v1/models", server.guarded(server.models), methods=["GET"]),
        Route("/v1/chat/completions", server.guarded(server.chat_completions), methods=["POST"]),
        Route("/v1/completions", server.guarded(server.completions), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
