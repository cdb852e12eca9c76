"""Short-request latency of `dllmflow serve` while a long request runs, vs with the server otherwise idle;
and (dLLM section) concurrent vs one-at-a-time serving of the demo dLLM.

    OMP_NUM_THREADS=1 python bench/serve_latency.py [--short 12] [--short-tokens 16] [--long-tokens 1500]
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm [--train-steps 300] [--clients 16] [--rounds 5]
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm --settings recorded,cache=prefix,threshold=0.9
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm --client httpx   # the old instrument

Scheduling gives every active batch `--chunk-tokens` new tokens per turn, so a short request arriving
while a long one generates waits a few turns, not for the long one to end. Printed: the p50 latency of
short requests sent at a steady pace to an idle server, then while one long request streams, and their
ratio; then the same with `--chunk-tokens` as large as the long request (one turn per request: the old
run-to-completion behaviour) for comparison. Tiny random Llama whose stop token can never win, so the long request runs
all its tokens. It does not assert.

dLLM section: trains the demo model (params/tiny_addition.yaml, `--train-steps` steps in-process), serves
its run dir once per `--settings` entry (default "recorded,cache=dual": the sampler setting recorded
with the model, no cache; then `dllmflow serve --sampler-setting cache=dual`, the fast-decoding issue's
Fast-dLLM cache; a fresh server each), and sends `--clients` streamed chat completions ("What is a + b?",
the demo's 8 new tokens in 2 blocks of 4, the served setting otherwise) first one at a time, then all at once: after a warm-up round
of each, `--rounds` rounds, each figure the median of the rounds' ratios. Also printed: the
batches the server formed, and one block's decode time in-process at batch 1 and at batch `--clients`
(on a CPU a batched forward costs about as many times more as it has rows, which bounds what batching
can give there; on an accelerator a batch of 16 costs little more than one row). Printed, measured in this one run: total throughput concurrent / sequential (goal
>= 4x), p50 time to the first streamed block concurrent / a lone request's (goal <= 1.5x), and the
concurrent max latency / median (goal <= 3x: no request starved). The clients are one aiohttp session
(`--client`): httpx's async pool cost the client itself 25-36 ms for 16 concurrent GET /v1/models on
this CPU (aiohttp 2.5-5 ms, one request ~1 ms), which the first-block ratio had counted as the server's;
the line "the client alone" prints that floor for the client used.

Measured 2026-12-02 (dLLM section, defaults, 2 quiet AMD EPYC cores, OMP_NUM_THREADS=1), after the
server moved to uvicorn[standard] and prepares small bodies in place:
    aiohttp: throughput 7.24x, p50 first block 23 ms vs lone 14 ms = 1.74x (rounds 1.39-1.86), max /
             median 1.01x; client floor 0.4 ms one GET, 2.5 ms sixteen; one block in-process 4.7 ms at
             batch 1, 12.7 ms at batch 16 (2.7x)
    httpx:   throughput 5.12x, first block 3.04x (rounds 2.85-3.73); client floor 1.5 ms / 25.1 ms
A lone request's first block is ~2 ms of HTTP and preparing, the scheduler's 5 ms batching window, and
its block (~5 ms); sixteen add ~6 ms of arrivals and the batch-16 block's extra ~7 ms of compute.

Measured 2026-12-03 (same machine and settings, three runs, the last two with --rounds 9), per setting:
    recorded (no cache): throughput 7.96 / 8.21 / 8.10x; first block 1.67 / 1.61 / 1.61x (rounds
             1.19-1.97); max / median 1.01x; one block 3.9-4.2 ms at batch 1, 10.9-12.5 ms at batch 16
    dual:    throughput 9.60 / 9.18 / 9.27x; first block 1.35 / 1.33 / 1.27x (rounds 1.07-1.95);
             max / median 1.01x; one block 3.5-5.9 ms at batch 1, 6.4-9.9 ms at batch 16
The dual cache recomputes only the block being decoded after its first step, so a batch-16 block costs
1.4-1.8x a lone one instead of 2.6-3.1x: what batching can give on this compute-bound CPU grows. It
costs the demo no accuracy: fully trained (1,200 steps), 256 held-out problems in blocks of 4, exact
match 0.949 without a cache and 0.957 with the dual cache (2.2x the tokens/s).
The fully trained demo (--train-steps 1200 --rounds 9 --settings
recorded,threshold=0.9,cache=dual,cache=dual+threshold=0.9), first block concurrent / lone:
    recorded 1.74x, threshold=0.9 1.84x (the point the demo flow's sweep registers), cache=dual 1.40x,
    cache=dual+threshold=0.9 1.62x; throughput 7.0-8.8x, max / median 1.45-1.49x (some answers stop
    early). With a threshold a lone block takes 1-2 forwards (2.2-2.7 ms), so the fixed cost of sixteen
    arrivals and sixteen streams (the client floor alone: 2.5 ms for sixteen GETs vs 0.3 ms for one)
    outweighs what the batch saves.
All of the above served on ONE torch thread: the bench ran under OMP_NUM_THREADS=1 and the server, a
subprocess, inherited it, leaving the second core to the client. The server now runs on `--threads`
(default: the CPUs this process may use), as it would be deployed; lone and concurrent are measured on
the same server, so the ratio compares like with like. Measured 2026-12-03 on 2 quiet Intel Xeon cores,
--rounds 9, first block concurrent / lone (rounds' range), throughput, one block batch 16 / batch 1:
    300-step demo, text prompts:  recorded 1.38x (1.31-1.92), threshold=0.9 1.29x, cache=dual 1.21x,
                                  cache=dual+threshold=0.9 1.26x; throughput 9.6-10.8x; blocks 1.5-1.9x
    300-step demo, chats:         recorded 1.49x (1.39-1.73), threshold=0.9 1.56x, cache=dual 1.41x,
                                  cache=dual+threshold=0.9 1.50x; throughput 8.9-10.1x
    1,200-step demo, chats:       recorded 1.69x (1.35-2.83; reruns 1.56x, 1.73x), threshold=0.9 1.45x, cache=dual 1.35x,
                                  cache=dual+threshold=0.9 1.44x; throughput 8.3-10.5x; max / median 1.01x
A batch-16 block now costs 1.4-1.9x a lone one (2.6-3.1x on one thread): a batch's forward spreads its
rows over both cores, a lone small one barely does. The clients send chats since the trained demo
answers chat-templated prompts (a raw text prompt got an empty answer from a 1,200-step demo). The
no-cache setting stays near the 1.5x line and swings with the run; with a cache or a threshold it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


# ---- dLLM section ---------------------------------------------------------------------------------


def train_demo(root: Path, steps: int) -> Path:
    """The demo dLLM (params/tiny_addition.yaml) trained `steps` steps in this process -> its run dir."""
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    recipe = Path(__file__).resolve().parents[1] / "params" / "tiny_addition.yaml"
    settings = load_settings(
        recipe, dataset={"prepared_dir": str(root / "prepared")}, train={"max_steps": steps},
        checkpoint={"every_steps": steps}, run_dir=str(root / "run"),
    )  # fmt: skip
    prepare(settings)
    run_training(settings, root / "run")
    return root / "run"


async def streamed(client, url: str, body: dict) -> dict[str, float]:
    """One streamed completion: seconds to its first block with text and to its end; tokens. `client`:
    an aiohttp session (the default) or an httpx.AsyncClient (`--client httpx`)."""
    t0 = time.perf_counter()
    first, usage = None, None
    async for line in _sse_lines(client, f"{url}/chat/completions", {**body, "stream": True}):
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
            first = time.perf_counter() - t0
        usage = event.get("usage") or usage
    end = time.perf_counter() - t0
    return {
        "first_s": first if first is not None else end,
        "total_s": end,
        "tokens": usage["completion_tokens"],
    }


async def _sse_lines(client, url: str, body: dict):
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                yield line
        return
    async with client.post(url, json=body) as r:
        r.raise_for_status()
        async for raw in r.content:  # aiohttp's StreamReader yields lines
            yield raw.decode().rstrip("\r\n")


async def _get_json(client, url: str) -> dict:
    if isinstance(client, httpx.AsyncClient):
        r = await client.get(url)
        r.raise_for_status()
        return r.json()
    async with client.get(url) as r:
        r.raise_for_status()
        return await r.json()


def _client(kind: str):
    """The bench's HTTP client, an aiohttp session unless `kind` is "httpx" (why: the module docstring)."""
    if kind == "httpx":
        return httpx.AsyncClient(timeout=600)
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=64)
    )


async def client_floor(client, url: str, clients: int) -> tuple[float, float]:
    """Seconds of one GET /v1/models alone and of `clients` at once (median of 5): the instrument's own
    cost of concurrency, no decoding in it."""
    alone, together = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        await _get_json(client, f"{url}/models")
        alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*[_get_json(client, f"{url}/models") for _ in range(clients)])
        together.append(time.perf_counter() - t0)
    return statistics.median(alone), statistics.median(together)


def dllm_bodies(clients: int) -> list[dict]:
    """`clients` different problems as chats (the demo learned chat-templated prompts: a raw text
    prompt may get an empty answer), 8 new tokens in blocks of 4."""
    bodies = []
    for i in range(clients):
        a, b = 10 + 7 * i % 89, 11 + 13 * i % 87
        chat = [{"role": "user", "content": f"What is {a} + {b}?"}]
        bodies.append({"model": "demo", "messages": chat, "max_tokens": 8,
                       "stream_options": {"include_usage": True}, "dllmflow": {"block_size": 4}})  # fmt: skip
    return bodies


async def dllm_measure(url: str, clients: int, rounds: int, client_kind: str = "aiohttp") -> dict[str, float]:
    """`rounds` rounds, each: the requests one at a time, then all at once. Warmed up first by one
    round of each (pooled connections open, batch shapes seen), so a round measures the steady state; each
    figure is the median over rounds of that round's ratio (one round of 16 swings by ~2x on a busy CPU)."""
    bodies = dllm_bodies(clients)
    per_round = []
    async with _client(client_kind) as client:
        await streamed(client, url, bodies[0])
        await asyncio.gather(*[streamed(client, url, b) for b in bodies])
        for _ in range(rounds):
            t0 = time.perf_counter()
            alone = [await streamed(client, url, b) for b in bodies]
            sequential_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            together = await asyncio.gather(*[streamed(client, url, b) for b in bodies])
            concurrent_s = time.perf_counter() - t0
            tokens = sum(r["tokens"] for r in together)
            latencies = [r["total_s"] for r in together]
            first_alone = statistics.median(r["first_s"] for r in alone)
            first_together = statistics.median(r["first_s"] for r in together)
            per_round.append({
                "tokens": tokens,
                "sequential_s": sequential_s,
                "concurrent_s": concurrent_s,
                "throughput_x": (tokens / concurrent_s) / (sum(r["tokens"] for r in alone) / sequential_s),
                "first_alone_p50_s": first_alone,
                "first_together_p50_s": first_together,
                "first_x": first_together / first_alone,
                "max_over_median": max(latencies) / statistics.median(latencies),
            })  # fmt: skip
        floor = await client_floor(client, url, clients)
        served = await _get_json(client, f"{url.removesuffix('/v1')}/stats")
    out = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    out["first_x_range"] = (min(r["first_x"] for r in per_round), max(r["first_x"] for r in per_round))
    out["client_floor_s"] = floor
    return {**out, "rounds": rounds, "batches": served["batches"], "max_batch": served["max_batch_size_seen"]}


def block_cost(run: Path, clients: int, settings: dict | None = None) -> tuple[float, float]:
    """Seconds of one first block (llada, the bench's settings) in-process at batch 1 and `clients`."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.inference.dllm_engine import served_from_path
    from dllmflow.inference.generate import encode_prompt, load_for_generation

    served = served_from_path(run)
    model, tok, _ = load_for_generation(served.checkpoint, device="cpu")
    over = {"max_new_tokens": 8, "block_size": 4, **(settings or {})}
    config = build_sampler_config(served.sampler, over, tok, defaults=served.sampler_settings)
    sampler = SAMPLERS[served.sampler](model, tok, config, mask_id=model.config.mask_token_id)
    prompt = encode_prompt(tok, "What is 47 + 38?")
    out = []
    for batch in (1, clients):
        sampler.stepper([prompt] * batch).step()  # warm-up
        t0 = time.perf_counter()
        for _ in range(5):
            sampler.stepper([prompt] * batch).step()
        out.append((time.perf_counter() - t0) / 5)
    return out[0], out[1]


def dllm_section(args) -> None:
    """The demo model served once per `--settings` entry ("recorded": the sampler setting recorded with
    it, no cache; "cache=dual+threshold=0.9": `dllmflow serve --sampler-setting` per pair), a fresh
    server each."""
    import torch

    from dllmflow.inference.serve_cli import parse_sampler_settings

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = train_demo(Path(tmp), args.train_steps)
        trained_s = time.perf_counter() - t0
        print(f"dLLM demo (tiny_addition, {args.train_steps} steps trained in {trained_s:.0f} s), {args.clients} "
              f"streamed completions of <= 8 tokens in blocks of 4")  # fmt: skip
        for name in args.settings.split(","):
            settings = None if name == "recorded" else parse_sampler_settings(name.split("+"))
            with local_server(
                run, served_model_name="demo", max_batch_size=args.clients, sampler_settings=settings,
                threads=args.threads,
            ) as url:  # fmt: skip
                r = asyncio.run(dllm_measure(url, args.clients, args.rounds, args.client))
            torch.set_num_threads(args.threads)  # the in-process figures on the server's threads
            one, many = block_cost(run, args.clients, settings)
            print(f"setting: {name}")
            _print_dllm(r, args, one, many)


def _print_dllm(r: dict, args, one: float, many: float) -> None:
    print(f"  median of {r['rounds']} rounds: one at a time {r['sequential_s']:.2f} s, all at once "
          f"{r['concurrent_s']:.2f} s, {r['tokens']:.0f} tokens")  # fmt: skip
    print(f"  throughput concurrent / sequential {r['throughput_x']:.2f}x (goal >= 4x)")
    print(f"  p50 time to first block: concurrent {r['first_together_p50_s'] * 1e3:.0f} ms, lone "
          f"{r['first_alone_p50_s'] * 1e3:.0f} ms, ratio {r['first_x']:.2f}x (rounds {r['first_x_range'][0]:.2f}-"
          f"{r['first_x_range'][1]:.2f}; goal <= 1.5x)")  # fmt: skip
    get_one, get_many = r["client_floor_s"]
    print(f"  the client ({args.client}) alone: GET /v1/models {get_one * 1e3:.1f} ms, {args.clients} at once "
          f"{get_many * 1e3:.1f} ms (no decoding: what concurrency costs the instrument and the HTTP stack)")  # fmt: skip
    print(f"  concurrent max latency / median {r['max_over_median']:.2f}x (goal <= 3x: no starvation)")
    print(f"  server: {r['batches']} batches in all, largest {r['max_batch']} rows; one block in-process: "
          f"{one * 1e3:.1f} ms at batch 1, {many * 1e3:.1f} ms at batch {args.clients} ({many / one:.1f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="causal,dllm", help="comma list: causal, dllm")
    p.add_argument("--train-steps", type=int, default=300, help="dllm: demo model training steps")
    p.add_argument("--clients", type=int, default=16, help="dllm: concurrent clients")
    p.add_argument("--rounds", type=int, default=5, help="dllm: measured rounds (median reported)")
    p.add_argument(
        "--settings", default="recorded,cache=dual",
        help="dllm: comma list of served settings: recorded (the model's own: no cache) or KEY=VALUE pairs "
        "joined by + (e.g. cache=dual+threshold=0.9), each a `dllmflow serve --sampler-setting`",
    )  # fmt: skip
    p.add_argument(
        "--client", choices=("aiohttp", "httpx"), default="aiohttp", help="dllm: the bench's HTTP client"
    )
    p.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)),
        help="the server's torch threads (`dllmflow serve --threads`; default: the CPUs this process may "
        "use, whatever OMP_NUM_THREADS says: a server uses its machine)",
    )  # fmt: skip
    p.add_argument("--short", type=int, default=12, help="short requests per phase")
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--every-s", type=float, default=0.3, help="one short request every this many seconds")
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    args = p.parse_args()
    sections = set(args.sections.split(","))
    if "causal" in sections:
        causal_section(args)
    if "dllm" in sections:
        dllm_section(args)


def causal_section(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_chat_lm(Path(tmp) / "model", args.hidden_size, 4096, never_stop=True)
        results = {}
        for chunk in (args.chunk_tokens, args.long_tokens):
            with local_server(
                Path(tmp) / "model",
                served_model_name=MODEL,
                max_tokens_cap=args.long_tokens,
                chunk_tokens=chunk,
                threads=args.threads,
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
