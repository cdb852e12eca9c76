"""A small OpenAI-compatible chat server over a local Hugging Face causal LM (offline use and tests).

    dllmflow serve --model-path runs/target --port 30000 --served-model-name target
    curl -s localhost:30000/v1/chat/completions -d '{"model": "target", "messages": [{"role": "user", "content": "hi"}]}'

Endpoints: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health` (200 once the model is loaded) and
`GET /stats` (request counters, for tests and benchmarks). Production users point `dllmflow regenerate
--target-server` at SGLang or vLLM instead; this server exists so the pipeline runs without them.

Requests that arrive together are batched: a single worker takes every queued request with the same
sampling settings (up to `--max-batch-size`), left-pads them and runs one `generate` in a worker thread,
so concurrent clients overlap instead of queueing one by one. Fault injection for tests: `--fail-first N
--fail-status 500|429` answers the first N chat requests with that status (a list such as `500,429` is
cycled); `--delay-s` adds latency. `--api-key` (or $DLLMFLOW_SERVE_API_KEY) requires that Bearer token on
`/v1/*`.

From Python, `local_server(model_path)` starts it in a subprocess, waits for `/health`, yields the base
URL (`http://127.0.0.1:PORT/v1`) and stops it on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllmflow.common.net import free_port
from dllmflow.errors import UserError
from dllmflow.runs import find_export

log = logging.getLogger("dllmflow.inference.serve")


# ---- generation ---------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float
    top_p: float
    template_kwargs: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    future: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]

    def batch_key(self) -> tuple:
        """Requests are batched only with others that sample the same way."""
        return (
            self.max_tokens,
            self.temperature,
            self.top_p,
            json.dumps(self.template_kwargs, sort_keys=True),
        )


class ChatEngine:
    """A causal LM + tokenizer with a chat template; `generate(batch)` answers a list of requests."""

    def __init__(self, model_path: str | os.PathLike, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path)
        if not path.is_dir():
            raise UserError(
                f"--model-path {path}: not a directory; point it at a saved HF model (config + weights)"
            )
        path = find_export(path) or path  # a run dir or checkpoint root serves its consolidated export
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if not self.tokenizer.chat_template:
            raise UserError(
                f"--model-path {path}: the tokenizer has no chat_template; save one with the tokenizer"
            )
        self.tokenizer.padding_side = "left"  # generated tokens start at the same column for every row
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def encode(self, req: ChatRequest) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=True, tokenize=True, **req.template_kwargs
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def generate(self, batch: list[ChatRequest]) -> list[dict[str, Any]]:
        """One left-padded `generate` call for requests sharing a batch key."""
        import torch

        prompts = [r.prompt_ids or self.encode(r) for r in batch]
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, L]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, L]
        first = batch[0]
        sampling = (
            {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p}
            if first.temperature > 0
            else {"do_sample": False}
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=first.max_tokens,
                pad_token_id=pad,
                eos_token_id=self.eos_ids or None,
                **sampling,
            )  # [B, L + new]
        results = []
        for row, prompt in zip(out[:, width:].tolist(), prompts):
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            new = row if stop is None else row[:stop]
            results.append(
                {
                    "text": self.tokenizer.decode(new, skip_special_tokens=True),
                    "finish_reason": "length" if stop is None else "stop",
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(new) + (stop is not None),
                }
            )
        return results


class Batcher:
    """Queue of pending requests drained by one worker: the model only ever runs in one thread."""

    def __init__(self, engine: ChatEngine, max_batch_size: int, batch_wait_s: float = 0.005):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.queue: asyncio.Queue[ChatRequest] = asyncio.Queue()
        self.batches = 0
        self.max_batch_seen = 0

    async def submit(self, req: ChatRequest) -> dict[str, Any]:
        req.future = asyncio.get_running_loop().create_future()
        await self.queue.put(req)
        return await req.future

    async def run(self) -> None:
        while True:
            pending = [await self.queue.get()]
            # Requests a client sends together arrive a few ms apart: collect while more keep coming.
            while len(pending) < self.max_batch_size:
                await asyncio.sleep(self.batch_wait_s)
                if self.queue.empty():
                    break
                while not self.queue.empty():
                    pending.append(self.queue.get_nowait())
            # Group by sampling settings; everything taken off the queue is answered in this round.
            groups: dict[tuple, list[ChatRequest]] = {}
            for req in pending:
                groups.setdefault(req.batch_key(), []).append(req)
            for group in groups.values():
                for start in range(0, len(group), self.max_batch_size):
                    await self._run_batch(group[start : start + self.max_batch_size])

    async def _run_batch(self, batch: list[ChatRequest]) -> None:
        self.batches += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        try:
            results = await asyncio.to_thread(self.engine.generate, batch)
        except Exception as e:  # answer every waiter; the server keeps running
            log.exception("generation failed")
            for req in batch:
                if not req.future.done():
                    req.future.set_exception(e)
            return
        for req, res in zip(batch, results):
            if not req.future.done():
                req.future.set_result(res)


# ---- HTTP ---------------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _parse_request(body: Any, max_length: int) -> ChatRequest:
    """Validate an OpenAI chat body; raises ValueError with the message the client sees (400)."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError("each message needs a string 'role' and a string 'content'")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 256))
    temperature = body.get("temperature", 1.0)
    top_p = body.get("top_p", 1.0)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_length:
        raise ValueError(f"'max_tokens' must be an integer in [1, {max_length}]")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError("'temperature' must be a number >= 0")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError("'top_p' must be in (0, 1]")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    return ChatRequest(
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        template_kwargs=kwargs,
    )


def build_app(
    engine: ChatEngine,
    served_model_name: str,
    *,
    max_batch_size: int = 16,
    fail_first: int = 0,
    fail_status: int | Sequence[int] = 500,
    delay_s: float = 0.0,
    api_key: str | None = None,
):
    """The Starlette app; `engine` is loaded before the app starts, so `/health` means ready."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    batcher = Batcher(engine, max_batch_size)
    statuses = [fail_status] if isinstance(fail_status, int) else list(fail_status)
    stats = {"requests": 0, "injected_failures": 0, "completed": 0, "in_flight": 0, "max_in_flight": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker = asyncio.create_task(batcher.run())
        yield
        worker.cancel()

    async def health(request):
        return JSONResponse({"status": "ok"})

    def unauthorized(request):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(
                401, "missing or wrong API key (expected an Authorization: Bearer header)", "auth_error"
            )
        return None

    async def models(request):
        if denied := unauthorized(request):
            return denied
        card = {
            "id": served_model_name,
            "object": "model",
            "owned_by": "dllmflow",
            "max_model_len": engine.max_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def get_stats(request):
        return JSONResponse(
            {**stats, "batches": batcher.batches, "max_batch_size_seen": batcher.max_batch_seen}
        )

    async def chat_completions(request):
        if denied := unauthorized(request):
            return denied
        stats["requests"] += 1
        if (n := stats["injected_failures"]) < fail_first:
            stats["injected_failures"] += 1
            return _error(
                statuses[n % len(statuses)], f"injected failure {n + 1}/{fail_first}", "server_error"
            )
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        try:
            req = _parse_request(body, engine.max_length)
        except ValueError as e:
            return _error(400, str(e))
        if body.get("model") != served_model_name:
            return _error(
                404, f"model {body.get('model')!r} does not exist; this server serves {served_model_name!r}"
            )
        try:
            req.prompt_ids = engine.encode(req)
        except Exception as e:  # the chat template rejected the conversation
            return _error(400, f"cannot apply the chat template: {type(e).__name__}: {e}")
        if len(req.prompt_ids) + req.max_tokens > engine.max_length:
            return _error(
                400,
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                f"max_model_len ({engine.max_length})",
            )
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            res = await batcher.submit(req)
        except Exception as e:
            return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
        finally:
            stats["in_flight"] -= 1
        stats["completed"] += 1
        return JSONResponse(
            {
                "id": f"chatcmpl-{stats['requests']}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": res["text"]},
                        "finish_reason": res["finish_reason"],
                    }
                ],
                "usage": {
                    "prompt_tokens": res["prompt_tokens"],
                    "completion_tokens": res["completion_tokens"],
                    "total_tokens": res["prompt_tokens"] + res["completion_tokens"],
                },
            }
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


# ---- CLI ----------------------------------------------------------------------------------------


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path",
        required=True,
        help="Local HF model dir (config, weights, tokenizer with a chat template).",
    )
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default loopback only).")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--served-model-name", default=None, help="The `model` clients must send (default: the dir name)."
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=16, help="Most requests generated together.")
    p.add_argument(
        "--fail-first", type=int, default=0, help="Answer the first N chat requests with --fail-status."
    )
    p.add_argument(
        "--fail-status",
        default="500",
        help="Status of injected failures: 500, 502, 503 or 429, or a list (500,429).",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="Require this Bearer token on /v1/* (default $DLLMFLOW_SERVE_API_KEY).",
    )
    p.add_argument("--delay-s", type=float, default=0.0, help="Extra latency per chat request (tests).")
    p.add_argument("--log-level", default="INFO")


def cli_main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.max_batch_size < 1 or args.fail_first < 0 or args.delay_s < 0:
        raise UserError("--max-batch-size must be >= 1, --fail-first and --delay-s >= 0")
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
        fail_first=args.fail_first,
        fail_status=statuses,
        delay_s=args.delay_s,
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
    fail_first: int = 0,
    fail_status: int | Sequence[int] = 500,
    delay_s: float = 0.0,
    max_batch_size: int = 16,
    api_key: str | None = None,
    startup_timeout_s: float = 300.0,
    log_path: str | os.PathLike | None = None,
) -> Iterator[str]:
    """Run `dllmflow serve` in a subprocess; yield its base URL (`http://host:port/v1`) once `/health` is 200.

    `port=None` picks a free one (give a fixed port when the URL must stay the same across runs, e.g. a
    resumed regeneration, whose manifest records the server URL). The server's log goes to `log_path`
    (default: a temp file) and its tail is shown if it fails to start.
    """
    import httpx

    port = port or free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "dllmflow.inference.serve",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
    ]
    statuses = ",".join(map(str, [fail_status] if isinstance(fail_status, int) else fail_status))
    cmd += ["--fail-first", str(fail_first), "--fail-status", statuses, "--delay-s", str(delay_s)]
    cmd += ["--max-batch-size", str(max_batch_size), "--log-level", "WARNING"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
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


if __name__ == "__main__":  # `python -m dllmflow.inference.serve ...` (what local_server runs)
    from dllmflow.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
