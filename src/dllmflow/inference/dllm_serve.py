"""The HTTP side of `dllmflow serve` for a dLLM: OpenAI chat and text completions over a `DllmEngine`,
streamed block by block. Routes, API key, body/message/JSON caps and timeouts are the causal server's
(`inference/serve.py`, whose `ChatServer` this extends); decoding is `inference/dllm_engine.py`.

    dllmflow serve --model models:/dllmflow-tiny-addition@champion --port 30000
    curl -s localhost:30000/v1/completions -d '{"model": "dllmflow-tiny-addition", "prompt": "What is 2 + 3?"}'

    app = build_dllm_app(DllmEngine(served), "tiny", max_tokens_cap=256)   # a Starlette app

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (`"stream": true`: server-sent events,
one per committed block as it is committed, ending in `data: [DONE]`), `GET /v1/models` (the served
name plus its lineage under `dllmflow`: registered name, version, alias, run id, sampler, the settings
it decodes with, the sweep setting it was gated at, and what `--sampler-setting` changed from it),
`GET /health`, `GET /stats`. `usage` carries `prompt_tokens`, `completion_tokens`, `total_tokens` and
`dllmflow: {nfe, tokens_per_forward, positions, effective_token_ratio, sampler}` (forwards the
request's row took part in, the positions they computed for it, completion tokens ÷ positions). Per-request
sampler overrides go under the `dllmflow` key (`inference/dllm_requests.py`), e.g.
`{"dllmflow": {"threshold": 0.9, "cache": "dual"}}`; with the openai client:
`extra_body={"dllmflow": {...}}`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dllmflow.inference.dllm_engine import DllmEngine, DllmRequest
from dllmflow.inference.dllm_requests import parse_dllm_request
from dllmflow.inference.requests import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
    RequestError,
    RequestLimits,
    read_body,
)
from dllmflow.inference.scheduler import Scheduler
from dllmflow.inference.serve import ChatServer, _error, _sse, starlette_app


def _usage(res: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = res["prompt_tokens"], res["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "dllmflow": res["dllmflow"],
    }


class DllmServer(ChatServer):
    """`ChatServer`'s routes for a dLLM engine, plus text completions; chat and text share one path."""

    engine: DllmEngine
    preparing = 0  # requests being read and validated (not yet submitted)
    usage = staticmethod(_usage)  # with NFE and tokens per forward under `dllmflow`

    async def wait_answer(self, req: DllmRequest) -> tuple[str, Any]:
        """Wait for "done" or "error" of a submitted request (streamed "tokens" events are skipped)."""
        while (event := await req.events.get())[0] == "tokens":
            pass
        return event

    async def models(self, request):
        from starlette.responses import JSONResponse

        served = self.engine.served
        card = {
            "id": self.name,
            "object": "model",
            "owned_by": "dllmflow",
            "max_model_len": self.engine.max_length,
            "dllmflow": {
                **served.lineage,
                "mode": served.mode,
                "sampler": self.engine.sampler,
                "sampler_settings": self.engine.preset.model_dump(),
                # what `--sampler-setting` changed from the recorded (gated) setting, if anything
                **({"server_settings": self.engine.settings} if self.engine.settings else {}),
            },
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request):
        return await self.handle(request, chat=True)

    async def completions(self, request):
        return await self.handle(request, chat=False)

    async def handle(self, request, *, chat: bool):
        from starlette.responses import StreamingResponse

        self.stats["requests"] += 1
        self.preparing += 1  # the scheduler forms a batch once the requests sent together are in
        try:
            body, req = await self.accept_dllm(request, chat)
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
            stream = self.stream_blocks(req, deadline, head, usage, chat)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self.complete_dllm(req, deadline, head, chat)

    async def accept_dllm(self, request, chat: bool):
        """Read a request's body, then validate and tokenise it and build its sampler config (`prep`)."""
        raw = await read_body(request, self.limits.max_body_bytes)
        return await self.prep(self.prepare_dllm, raw, chat)

    def prepare_dllm(self, raw: bytes, chat: bool) -> tuple[Any, DllmRequest]:
        """Body bytes -> (validated body, request); RequestError (400/404, naming the field) if refused."""
        body = parse_dllm_request(raw, self.limits, chat=chat)
        self.check_model(body.model)
        if chat:
            prompt_ids = self.encode_chat(body.messages, body.chat_template_kwargs)
        else:
            prompt_ids = self.engine.encode_text(body.prompt)
        req = self.engine.request(
            prompt_ids, body.sampler_overrides(), body.max_tokens, stream=body.stream,
            steps_cap=self.limits.max_tokens_cap,
        )  # fmt: skip
        self.check_length(len(prompt_ids), req.max_tokens)
        return body, req

    @staticmethod
    def _choice(chat: bool, text: str, finish_reason: str | None, *, delta: bool, role: bool = False):
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        content = {"role": "assistant", "content": text} if role or not delta else {"content": text}
        if delta and finish_reason is not None and not text:
            content = {}
        return {"index": 0, ("delta" if delta else "message"): content, "finish_reason": finish_reason}

    async def complete_dllm(self, req: DllmRequest, deadline: float, head: dict[str, Any], chat: bool):
        from starlette.responses import JSONResponse

        self._enter()
        try:
            left = deadline - asyncio.get_running_loop().time()
            kind, res = await asyncio.wait_for(self.wait_answer(req), left)
        except TimeoutError:
            self.stats["timed_out"] += 1
            return _error(504, self.timeout_message, "timeout")
        finally:
            req.cancelled = True  # a no-op once finished; otherwise the row leaves its batch next turn
            self.stats["in_flight"] -= 1
        if kind == "error":
            return _error(500, f"generation failed: {type(res).__name__}: {res}", "server_error")
        self.stats["completed"] += 1
        obj = "chat.completion" if chat else "text_completion"
        choice = self._choice(chat, res["text"], res["finish_reason"], delta=False)
        return JSONResponse({**head, "object": obj, "choices": [choice], "usage": _usage(res)})

    async def stream_blocks(
        self, req: DllmRequest, deadline: float, head: dict[str, Any], include_usage: bool, chat: bool
    ):
        """Server-sent events: (chat: the role first) the text of each block as it is committed, the
        finish reason, usage if asked, then `[DONE]`. Errors after the 200 go out as an `error` event."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish_reason: str | None = None, role: bool = False) -> str:
            choice = self._choice(chat, text, finish_reason, delta=True, role=role)
            return _sse({**head, "object": obj, "choices": [choice]})

        def text_of(kind: str, payload: Any) -> str:  # a block may end inside a multi-byte character
            return payload["text"] if kind == "done" else self.engine.partial_text(payload)

        self._enter()
        try:
            if chat:
                yield chunk("", role=True)
            usage_head = {**head, "object": obj} if include_usage else None
            async for event in self.stream_deltas(
                req, deadline, text_of, chunk, lambda fr: chunk("", fr), usage_head
            ):
                yield event
        finally:  # also on a client disconnect (the request was submitted before the response started):
            # the scheduler drops the row at its next turn
            req.cancelled = True
            self.stats["in_flight"] -= 1


def build_dllm_app(
    engine: DllmEngine,
    served_model_name: str,
    *,
    max_batch_size: int = 16,
    max_tokens_cap: int = 1024,
    request_timeout_s: float = 300.0,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_messages: int = DEFAULT_MAX_MESSAGES,
):
    """The Starlette app; `engine` is loaded before the app starts, so `/health` means ready. A turn is
    one block of one batch (the causal server's `--chunk-tokens` has no meaning here)."""
    limits = RequestLimits(max_tokens_cap, max_body_bytes, max_messages)
    scheduler = Scheduler(engine, max_batch_size, 1)
    engine.publish = scheduler.publish  # a row's block streams as soon as it is final, mid-turn
    server = DllmServer(engine, served_model_name, scheduler, limits, request_timeout_s, api_key)
    scheduler.incoming = lambda: server.preparing
    return starlette_app(server, scheduler, completions=True)
