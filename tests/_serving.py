"""Serving helpers for tests: the tiny models they serve (`build_tiny_chat_lm`, `tiny_dllm_export`) and a
`dllmflow serve` with faults injected: the real app (`serve_cli.app_from_args`, the same
flags) wrapped in an ASGI middleware that fails or delays chat requests, and an engine whose turns can
be slowed. None of this is in the product CLI.

    with fault_server(model_dir, served_model_name="m", fail_first=2, fail_status=[500, 429]) as url:
        ...                                             # http://127.0.0.1:PORT/v1
    python tests/_serving.py --model-path DIR --port 30000 --fail-first 2 --turn-delay-s 0.05

Faults: the first `fail_first` chat requests are answered with `fail_status` (a list is cycled) before
the app sees them; `delay_s` is slept before each chat request reaches the app; `turn_delay_s` is slept
in every decoding step of the engine (a slow scheduling turn). `GET /faults` returns
`{"injected_failures": n}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from dllmflow.common.net import free_port
from dllmflow.inference.serve_cli import add_cli_args, app_from_args, serve_args, serve_process


class FaultInjection:
    """ASGI middleware: fail the first `fail_first` chat requests, delay the others by `delay_s`."""

    def __init__(self, app, fail_first: int = 0, statuses: Sequence[int] = (500,), delay_s: float = 0.0):
        self.app, self.fail_first, self.statuses, self.delay_s = app, fail_first, list(statuses), delay_s
        self.injected = 0

    async def _json(self, send, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/faults":
            return await self._json(send, 200, {"injected_failures": self.injected})
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            if (n := self.injected) < self.fail_first:
                self.injected += 1
                status = self.statuses[n % len(self.statuses)]
                message = f"injected failure {n + 1}/{self.fail_first}"
                error = {"message": message, "type": "server_error", "param": None, "code": status}
                return await self._json(send, status, {"error": error})
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        await self.app(scope, receive, send)


def build_tiny_chat_lm(
    out: str | os.PathLike, hidden_size: int = 32, max_positions: int = 512, never_stop: bool = False
) -> Path:
    """Write a tiny random Llama chat LM (~40k parameters at hidden 32, BPE tokenizer of 300 tokens with
    the default chat template) to `out`, seeded: something to serve offline (tests, benchmarks, trying
    `dllmflow serve`). The head is untied: a tied tiny head just repeats the last token. `never_stop`
    zeroes the stop token's output row, so among ~300 random logits one always beats it and greedy
    decoding runs to max_tokens (a long request really is long)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dllmflow.data.tokenizer import train_bpe_tokenizer

    out = Path(out)
    tok = train_bpe_tokenizer(
        ["Natalia sold 48 clips to her friends in April and May."] * 8, 300, "<mask>", "<pad>", "<eos>"
    )
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, initializer_range=0.5, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if never_stop:
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] = 0
    model.save_pretrained(out)
    return out


TINY_DLLM_TEXTS = [
    "Natalia sold 48 clips in April and half as many in May. #### 72",
    "What is 2 + 3? The answer is 5.",
]


def tiny_dllm_export(out: Path) -> Path:
    """A tiny random dLLM export (mdlm, 1 layer, 2,048 positions) with its tokenizer and settings.json:
    what `dllmflow serve --model` serves as a dLLM."""
    import torch

    from dllmflow.data.tokenizer import train_bpe_tokenizer
    from dllmflow.models.build import build_model
    from dllmflow.settings import load_settings

    tok = train_bpe_tokenizer(TINY_DLLM_TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")
    settings = load_settings(
        model={"tiny": {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64}}
    )
    torch.manual_seed(0)
    build_model(settings, tok).save_pretrained(out)
    tok.save_pretrained(out)
    settings.write_json(out / "settings.json")
    return out


def slow_turns(turn_delay_s: float) -> None:
    """Every decoding step of this process's engines sleeps `turn_delay_s` first (it runs in the scheduler's
    worker thread, so the turn itself is slow, as on a loaded accelerator). The process serves one model."""
    from dllmflow.inference.dllm_engine import DllmEngine
    from dllmflow.inference.engine import ChatEngine

    for cls in (ChatEngine, DllmEngine):

        def slow_step(self, decode, num, _step=cls.step):
            time.sleep(turn_delay_s)
            return _step(self, decode, num)

        cls.step = slow_step


@contextlib.contextmanager
def fault_server(
    model_path: str | os.PathLike,
    *,
    fail_first: int = 0,
    fail_status: int | Sequence[int] = 500,
    delay_s: float = 0.0,
    turn_delay_s: float = 0.0,
    api_key: str | None = None,
    **options,
) -> Iterator[str]:
    """This module's server in a subprocess (like `serve_cli.local_server`); `options` are `dllmflow
    serve` flags in snake_case (served_model_name, max_tokens_cap, request_timeout_s, ...)."""
    host, port = "127.0.0.1", free_port()
    statuses = ",".join(map(str, [fail_status] if isinstance(fail_status, int) else fail_status))
    faults = ["--fail-first", str(fail_first), "--fail-status", statuses]
    faults += ["--delay-s", str(delay_s), "--turn-delay-s", str(turn_delay_s)]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *serve_args(model_path, host, port, **options),
        *faults,
    ]
    env = {**os.environ, "DLLMFLOW_SERVE_API_KEY": api_key or ""}
    with serve_process(cmd, f"http://{host}:{port}", env=env, what=f"tests/_serving.py {model_path}") as url:
        yield url


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(p)
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--fail-status", default="500", help="a status or a comma list, cycled")
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--turn-delay-s", type=float, default=0.0)
    args = p.parse_args()
    if args.turn_delay_s:
        slow_turns(args.turn_delay_s)
    app, _ = app_from_args(args)
    statuses = [int(s) for s in args.fail_status.split(",")]
    wrapped = FaultInjection(app, args.fail_first, statuses, args.delay_s)
    uvicorn.run(wrapped, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False)


if __name__ == "__main__":
    main()
