"""A small OpenAI-compatible chat server over a local Hugging Face causal LM (offline use and tests).

    dllmflow serve --model-path runs/target --port 30000 --served-model-name target
    curl -s localhost:30000/v1/chat/completions -d '{"model": "target", "messages": [{"role": "user", "content": "hi"}]}'

Endpoints: `POST /v1/chat/completions` (also `"stream": true`: server-sent `chat.completion.chunk` events
ending in `data: [DONE]`), `GET /v1/models`, `GET /health` (200 once the model is loaded) and `GET /stats`
(counters, for tests and benchmarks). Production users point `dllmflow regenerate --target-server` at
SGLang or vLLM instead; this server exists so the pipeline runs without them.

Requests are validated strictly (pydantic, strict types): the honoured fields are `model`, `messages`
(`role`, `content`, optional `name` and `reasoning_content`, all passed to the chat template),
`max_tokens` / `max_completion_tokens` (at most `--max-tokens-cap`), `temperature` in [0, 2], `top_p` in
(0, 1], `n` (1 only), `stream`, `stream_options.include_usage` and `chat_template_kwargs`; any other field
is refused with HTTP 400 naming it, never silently ignored (a `null` value counts as absent).

Scheduling (`inference/engine.py`): one worker owns the model. Requests that arrive together with the same sampling settings are
batched (up to `--max-batch-size`, left-padded); active batches then take turns, `--chunk-tokens` new
tokens per turn, so a long request delays a short one by a few turns instead of holding the model until
it is done. A request still unanswered after `--request-timeout-s` gets HTTP 504 and its row is dropped
from its batch at the next turn. `--api-key` (or $DLLMFLOW_SERVE_API_KEY) requires that Bearer token on
every route except `/health`. Hidden fault-injection flags for tests: `--fail-first N --fail-status
500|429` answers the first N chat requests with that status (a list such as `500,429` is cycled);
`--delay-s` adds latency per request; `--turn-delay-s` slows every scheduling turn.

From Python, `local_server(model_path)` starts it in a subprocess, waits for `/health`, yields the base
URL (`http://127.0.0.1:PORT/v1`) and stops it on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dllmflow.common.cli_args import add_flag
from dllmflow.common.net import free_port
from dllmflow.errors import UserError
from dllmflow.inference.engine import ChatEngine, ChatRequest, Scheduler

log = logging.getLogger("dllmflow.inference.serve")

DEFAULT_MAX_TOKENS = 256  # when a request gives neither max_tokens nor max_completion_tokens


# ---- request schema -----------------------------------------------------------------------------


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


class ChatBody(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


HONOURED = tuple(ChatBody.model_fields)


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _explain(err: dict[str, Any]) -> RequestError:
    """One pydantic error -> a message naming the field, what is wrong and what is accepted."""
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        where = f"this server honours {', '.join(HONOURED)}"
        if len(err["loc"]) > 1 and err["loc"][0] == "messages":
            where = "a message may hold role, content, name and reasoning_content"
        return RequestError(f"'{param}' is not supported: {where}", param)
    if param == "n":
        return RequestError(f"'n' must be 1 (got {err['input']!r}): this server returns one choice", param)
    got = repr(err["input"])
    return RequestError(f"'{param}': {err['msg']} (got {got[:80]}{'...' if len(got) > 80 else ''})", param)


def parse_body(body: Any, max_tokens_cap: int) -> ChatBody:
    """Validate an OpenAI chat body; raises RequestError with the message the client sees (HTTP 400)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        chat = ChatBody.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise _explain(e.errors()[0]) from None
    if (
        None not in (chat.max_tokens, chat.max_completion_tokens)
        and chat.max_tokens != chat.max_completion_tokens
    ):
        raise RequestError(
            "give 'max_tokens' or 'max_completion_tokens', not two different values", "max_tokens"
        )
    name = "max_tokens" if chat.max_tokens is not None else "max_completion_tokens"
    asked = chat.max_tokens or chat.max_completion_tokens
    if asked is not None and asked > max_tokens_cap:
        raise RequestError(
            f"'{name}' is {asked}, above this server's cap of {max_tokens_cap} (--max-tokens-cap)", name
        )
    if chat.stream_options is not None and not chat.stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    return chat.model_copy(update={"max_tokens": asked or min(DEFAULT_MAX_TOKENS, max_tokens_cap)})


# ---- HTTP ---------------------------------------------------------------------------------------


def _error_body(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(status, message, kind, param), status_code=status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(
    engine: ChatEngine,
    served_model_name: str,
    *,
    max_batch_size: int = 16,
    max_tokens_cap: int = 1024,
    request_timeout_s: float = 300.0,
    chunk_tokens: int = 8,
    fail_first: int = 0,
    fail_status: int | Sequence[int] = 500,
    delay_s: float = 0.0,
    turn_delay_s: float = 0.0,
    api_key: str | None = None,
):
    """The Starlette app; `engine` is loaded before the app starts, so `/health` means ready."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    scheduler = Scheduler(engine, max_batch_size, chunk_tokens, turn_delay_s=turn_delay_s)
    statuses = [fail_status] if isinstance(fail_status, int) else list(fail_status)
    stats = {"requests": 0, "injected_failures": 0, "completed": 0, "in_flight": 0, "max_in_flight": 0}
    stats |= {"timed_out": 0, "rejected": 0}
    timeout_message = f"the request took longer than this server's --request-timeout-s {request_timeout_s:g}"

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = asyncio.create_task(scheduler.run())
        yield
        worker.cancel()

    def guarded(endpoint):
        """The API key applies to every route but /health (a load balancer probes it without one)."""

        async def check(request):
            given = request.headers.get("authorization", "")
            if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(
                    401, "missing or wrong API key (expected an Authorization: Bearer header)", "auth_error"
                )
            return await endpoint(request)

        return check

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        card = {
            "id": served_model_name,
            "object": "model",
            "owned_by": "dllmflow",
            "max_model_len": engine.max_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def get_stats(request):
        return JSONResponse({**stats, **scheduler.stats()})

    def reject(status: int, message: str, param: str | None = None):
        stats["rejected"] += 1
        return _error(status, message, param=param)

    async def chat_completions(request):
        stats["requests"] += 1
        if (n := stats["injected_failures"]) < fail_first:
            stats["injected_failures"] += 1
            return _error(
                statuses[n % len(statuses)], f"injected failure {n + 1}/{fail_first}", "server_error"
            )
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return reject(400, "the request body is not valid JSON")
        try:
            chat = parse_body(body, max_tokens_cap)
        except RequestError as e:
            return reject(400, str(e), e.param)
        if chat.model != served_model_name:
            return _error(
                404,
                f"model {chat.model!r} does not exist; this server serves {served_model_name!r}",
                param="model",
            )
        if bad := sorted(set(chat.chat_template_kwargs) & engine.reserved_template_args):
            param = f"chat_template_kwargs.{bad[0]}"
            return reject(
                400, f"'{param}' is not allowed: only template variables (e.g. enable_thinking)", param
            )
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        try:
            prompt_ids = engine.encode(messages, chat.chat_template_kwargs)
        except Exception as e:  # the chat template rejected the conversation
            return reject(400, f"cannot apply the chat template: {type(e).__name__}: {e}", "messages")
        if len(prompt_ids) + chat.max_tokens > engine.max_length:
            return reject(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({chat.max_tokens}) exceeds the model's "
                f"max_model_len ({engine.max_length})",
                "max_tokens",
            )
        req = ChatRequest(prompt_ids, chat.max_tokens, chat.temperature, chat.top_p, stream=chat.stream)
        deadline = asyncio.get_running_loop().time() + request_timeout_s
        head = {
            "id": f"chatcmpl-{stats['requests']}",
            "created": int(time.time()),
            "model": served_model_name,
        }
        if chat.stream:
            usage = chat.stream_options is not None and chat.stream_options.include_usage
            return StreamingResponse(stream(req, deadline, head, usage), media_type="text/event-stream")
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            kind, res = await asyncio.wait_for(answer(req), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            stats["timed_out"] += 1
            return _error(504, timeout_message, "timeout")
        finally:
            req.cancelled = True  # a no-op once finished; otherwise the scheduler drops the row
            stats["in_flight"] -= 1
        if kind == "error":
            return _error(500, f"generation failed: {type(res).__name__}: {res}", "server_error")
        stats["completed"] += 1
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": res["text"]},
                        "finish_reason": res["finish_reason"],
                    }
                ],
                "usage": usage_of(res),
            }
        )

    async def answer(req: ChatRequest) -> tuple[str, Any]:
        """Submit after the injected delay (inside the timeout); wait for "done" or "error"."""
        if delay_s:
            await asyncio.sleep(delay_s)
        scheduler.submit(req)
        while (event := await req.events.get())[0] == "tokens":
            pass
        return event

    def usage_of(res: dict[str, Any]) -> dict[str, int]:
        total = res["prompt_tokens"] + res["completion_tokens"]
        return {
            "prompt_tokens": res["prompt_tokens"],
            "completion_tokens": res["completion_tokens"],
            "total_tokens": total,
        }

    async def stream(req: ChatRequest, deadline: float, head: dict[str, Any], include_usage: bool):
        """Server-sent `chat.completion.chunk` events: the role, text deltas as turns finish, the finish
        reason, usage if asked, then `[DONE]`. Errors after the 200 go out as an `error` event."""
        loop = asyncio.get_running_loop()

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return _sse({**head, "object": "chat.completion.chunk", "choices": [choice]})

        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        sent = ""  # the text streamed so far; every delta extends it
        try:
            yield chunk({"role": "assistant", "content": ""})
            if delay_s:
                await asyncio.sleep(delay_s)
            scheduler.submit(req)
            while True:
                try:
                    kind, payload = await asyncio.wait_for(req.events.get(), deadline - loop.time())
                except TimeoutError:
                    stats["timed_out"] += 1
                    yield _sse(_error_body(504, timeout_message, "timeout", None))
                    return
                if kind == "error":
                    message = f"generation failed: {type(payload).__name__}: {payload}"
                    yield _sse(_error_body(500, message, "server_error", None))
                    return
                text = (
                    engine.text(req)
                    if kind == "done"
                    else engine.tokenizer.decode(payload, skip_special_tokens=True)
                )
                # A token may end inside a multi-byte character (decoded as U+FFFD): wait for the rest.
                if text.startswith(sent) and (kind == "done" or not text.endswith("\ufffd")):
                    if delta := text[len(sent) :]:
                        yield chunk({"content": delta})
                    sent = text
                if kind == "done":
                    yield chunk({}, payload["finish_reason"])
                    if include_usage:
                        yield _sse(
                            {
                                **head,
                                "object": "chat.completion.chunk",
                                "choices": [],
                                "usage": usage_of(payload),
                            }
                        )
                    yield "data: [DONE]\n\n"
                    stats["completed"] += 1
                    return
        finally:  # also on a client disconnect: the scheduler drops the row at its next turn
            req.cancelled = True
            stats["in_flight"] -= 1

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/stats", guarded(get_stats), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_flag(
        p,
        "--model-path",
        required=True,
        help="Local HF model dir (config, weights, tokenizer with a chat template).",
    )
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default loopback only).")
    p.add_argument("--port", type=int, default=30000)
    add_flag(
        p, "--served-model-name", default=None, help="The `model` clients must send (default: the dir name)."
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_flag(p, "--max-batch-size", type=int, default=16, help="Most requests generated together.")
    add_flag(
        p,
        "--max-tokens-cap",
        type=int,
        default=1024,
        help="Largest max_tokens a request may ask for (400 above).",
    )
    add_flag(
        p,
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="A request unanswered after this long gets HTTP 504 and leaves its batch (default 300).",
    )
    add_flag(
        p,
        "--chunk-tokens",
        type=int,
        default=8,
        help="New tokens per batch per scheduling turn: smaller lets short requests past long ones sooner.",
    )
    add_flag(
        p,
        "--api-key",
        default=None,
        help="Require this Bearer token on every route but /health (default $DLLMFLOW_SERVE_API_KEY).",
    )
    add_flag(p, "--log-level", default="INFO")
    # Fault injection for tests, hidden from --help: the first N chat requests fail with --fail-status
    # (500, 502, 503 or 429, or a list such as 500,429), --delay-s per request, --turn-delay-s per turn.
    add_flag(p, "--fail-first", type=int, default=0, help=argparse.SUPPRESS)
    add_flag(p, "--fail-status", default="500", help=argparse.SUPPRESS)
    add_flag(p, "--delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    add_flag(p, "--turn-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)


def cli_main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if min(args.max_batch_size, args.max_tokens_cap, args.chunk_tokens) < 1 or args.request_timeout_s <= 0:
        raise UserError(
            "--max-batch-size, --max-tokens-cap and --chunk-tokens must be >= 1, --request-timeout-s > 0"
        )
    if min(args.fail_first, args.delay_s, args.turn_delay_s) < 0:
        raise UserError("--fail-first, --delay-s and --turn-delay-s must be >= 0")
    try:
        statuses = [int(s) for s in str(args.fail_status).split(",")]
    except ValueError:
        statuses = []
    if not statuses or any(s not in (429, 500, 502, 503) for s in statuses):
        raise UserError(
            f"--fail-status {args.fail_status}: use 500, 502, 503 or 429, or a comma list of them"
        )
    engine = ChatEngine(args.model_path, args.dtype)
    name = args.served_model_name or Path(args.model_path).resolve().name
    app = build_app(
        engine,
        name,
        max_batch_size=args.max_batch_size,
        max_tokens_cap=args.max_tokens_cap,
        request_timeout_s=args.request_timeout_s,
        chunk_tokens=args.chunk_tokens,
        fail_first=args.fail_first,
        fail_status=statuses,
        delay_s=args.delay_s,
        turn_delay_s=args.turn_delay_s,
        api_key=args.api_key or os.environ.get("DLLMFLOW_SERVE_API_KEY") or None,
    )
    log.info("serving %s as %r on http://%s:%d/v1", args.model_path, name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False)
    return 0


# ---- subprocess helper --------------------------------------------------------------------------


@contextlib.contextmanager
def local_server(
    model_path: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    max_batch_size: int = 16,
    max_tokens_cap: int | None = None,
    request_timeout_s: float | None = None,
    chunk_tokens: int | None = None,
    api_key: str | None = None,
    fail_first: int = 0,
    fail_status: int | Sequence[int] = 500,
    delay_s: float = 0.0,
    turn_delay_s: float = 0.0,
    startup_timeout_s: float = 300.0,
    log_path: str | os.PathLike | None = None,
) -> Iterator[str]:
    """Run `dllmflow serve` in a subprocess; yield its base URL (`http://host:port/v1`) once `/health` is 200.

    `port=None` picks a free one (give a fixed port when the URL must stay the same across runs, e.g. a
    resumed regeneration, whose manifest records the server URL). Options left `None` keep the CLI
    defaults. The server's log goes to `log_path` (default: a temp file) and its tail is shown if it fails
    to start.
    """
    import httpx

    port = port or free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "dllmflow.cli",
        "serve",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
    ]
    statuses = ",".join(map(str, [fail_status] if isinstance(fail_status, int) else fail_status))
    cmd += ["--fail-first", str(fail_first), "--fail-status", statuses, "--delay-s", str(delay_s)]
    cmd += [
        "--turn-delay-s",
        str(turn_delay_s),
        "--max-batch-size",
        str(max_batch_size),
        "--log-level",
        "WARNING",
    ]
    optional = {
        "--served-model-name": served_model_name,
        "--max-tokens-cap": max_tokens_cap,
        "--request-timeout-s": request_timeout_s,
        "--chunk-tokens": chunk_tokens,
    }
    cmd += [str(a) for flag, value in optional.items() if value is not None for a in (flag, value)]
    own_log = log_path is None
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="dllmflow-serve-", suffix=".log")
        os.close(fd)
    log_file = Path(log_path)
    with open(log_file, "wb") as out:
        env = {**os.environ, "DLLMFLOW_SERVE_API_KEY": api_key or ""}  # not on the command line (ps)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_file.read_text(errors="replace")[-3000:]
                raise UserError(
                    f"dllmflow serve --model-path {model_path} exited with {proc.returncode}:\n{tail}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise UserError(
                    f"dllmflow serve did not answer {base}/health within {startup_timeout_s:.0f} s"
                )
            time.sleep(0.2)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if own_log:
            log_file.unlink(missing_ok=True)


if (
    __name__ == "__main__"
):  # `python -m dllmflow.inference.serve ...` = `dllmflow serve ...` (no cli import: layers)
    from dllmflow.common.cli_args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="dllmflow serve", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    add_cli_args(parser)
    try:
        sys.exit(cli_main(parser.parse_args()))
    except UserError as e:
        print(f"dllmflow serve: error: {e}", file=sys.stderr)
        sys.exit(2)
