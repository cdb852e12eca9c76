"""Short-request latency of `dllmflow serve` while a long request runs, vs with the server otherwise idle.

    OMP_NUM_THREADS=1 python bench/serve_latency.py [--short 12] [--short-tokens 16] [--long-tokens 1500]

Scheduling gives every active batch `--chunk-tokens` new tokens per turn, so a short request arriving
while a long one generates waits a few turns, not for the long one to end. Printed: the p50 latency of
short requests sent at a steady pace to an idle server, then while one long request streams, and their
ratio; then the same with `--chunk-tokens` as large as the long request (one turn per request: the old
run-to-completion behaviour) for comparison. Tiny random Llama whose stop token can never win, so the long request runs
all its tokens. It does not assert.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from dllmflow.inference.engine import build_tiny_chat_lm
from dllmflow.inference.serve_cli import local_server

MODEL = "bench-target"
PROMPT = [{"role": "user", "content": "Natalia sold 48 clips to her friends in April."}]


async def short_latencies(client: httpx.AsyncClient, url: str, args) -> list[float]:
    """`args.short` short greedy requests, one fired every `args.every_s` seconds; seconds each."""

    async def one() -> float:
        t0 = time.perf_counter()
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": args.short_tokens, "temperature": 0}
        (await client.post(f"{url}/chat/completions", json=body)).raise_for_status()
        return time.perf_counter() - t0

    tasks = []
    for _ in range(args.short):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(args.every_s)
    return list(await asyncio.gather(*tasks))


async def measure(url: str, args) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        await short_latencies(client, url, argparse.Namespace(**{**vars(args), "short": 2}))  # warm-up
        idle = await short_latencies(client, url, args)

        started = asyncio.Event()
        long_s: list[float] = []

        async def long() -> None:
            t0 = time.perf_counter()
            body = {"model": MODEL, "messages": PROMPT, "max_tokens": args.long_tokens, "temperature": 0}
            async with client.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    started.set()  # the role chunk: the request is being submitted
            long_s.append(time.perf_counter() - t0)

        task = asyncio.create_task(long())
        await started.wait()
        await asyncio.sleep(
            0.2
        )  # let the scheduler start it (with one turn per request, no text comes sooner)
        busy = await short_latencies(client, url, args)
        await task
    return {
        "idle_p50_s": statistics.median(idle),
        "busy_p50_s": statistics.median(busy),
        "long_s": long_s[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=12, help="short requests per phase")
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--every-s", type=float, default=0.3, help="one short request every this many seconds")
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_chat_lm(Path(tmp) / "model", args.hidden_size, 4096, never_stop=True)
        results = {}
        for chunk in (args.chunk_tokens, args.long_tokens):
            with local_server(
                Path(tmp) / "model",
                served_model_name=MODEL,
                max_tokens_cap=args.long_tokens,
                chunk_tokens=chunk,
            ) as url:
                results[chunk] = asyncio.run(measure(url, args))
    print(
        f"short={args.short}x{args.short_tokens} tokens, long={args.long_tokens} tokens, hidden={args.hidden_size}"
    )
    print(f"one short request every {args.every_s} s, latency measured from its own send")
    for chunk, r in results.items():
        label = "round-robin" if chunk == args.chunk_tokens else "run-to-completion"
        print(
            f"chunk-tokens {chunk} ({label}): short p50 idle {r['idle_p50_s'] * 1e3:.0f} ms, "
            f"while a long request runs {r['busy_p50_s'] * 1e3:.0f} ms, ratio {r['busy_p50_s'] / r['idle_p50_s']:.2f}x "
            f"(long request {r['long_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
