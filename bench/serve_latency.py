"""Short-request latency of `dllmflow serve` while a long request runs, vs with the server otherwise idle;
and (dLLM section) concurrent vs one-at-a-time serving of the demo dLLM.

    OMP_NUM_THREADS=1 python bench/serve_latency.py [--short 12] [--short-tokens 16] [--long-tokens 1500]
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm [--train-steps 1200] [--clients 16] [--rounds 15]
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm --settings recorded,cache=prefix,threshold=0.9
    OMP_NUM_THREADS=1 python bench/serve_latency.py --sections dllm --client httpx   # the old instrument

Scheduling gives every active batch `--chunk-tokens` new tokens per turn, so a short request arriving
while a long one generates waits a few turns, not for the long one to end. Printed: the p50 latency of
short requests sent at a steady pace to an idle server, then while one long request streams, and their
ratio; then the same with `--chunk-tokens` as large as the long request (one turn per request: the old
run-to-completion behaviour) for comparison; short requests are sent for as long as the long one runs.
Tiny random Llama whose stop token can never win, so the long request runs all its tokens. It does not
assert. Measured 2026-12-03 (2 Intel Xeon cores, defaults): round-robin 22 -> 32 ms (1.43x, 13 requests
during a 1.5 s long one), run to completion 24 -> 547 ms (23.2x).

dLLM section: trains the demo model (params/tiny_addition.yaml, `--train-steps` steps in-process, on every
core as `make demo` trains it) and gates it as the demo flow does (the recipe's sweep over the threshold on
64 held-out problems: the run dir then records the setting the flow registers it at, the one `dllmflow
serve` serves it with). It serves that run dir once per `--settings` entry (default
"recorded,threshold=none,cache=dual": the gated setting; no threshold, one token per step; the
fast-decoding issue's Fast-dLLM dual cache; a fresh server each, on its default threads) and sends
`--clients` streamed chat completions ("What is a + b?", the demo's 8 new tokens in 2 blocks of 4, the
served setting otherwise) first one at a time, then all at once: after a warm-up round of each, `--rounds`
rounds, each figure the median of the rounds' ratios. Printed, measured in this one run: total throughput
concurrent / sequential (goal >= 4x), p50 time to the first streamed block concurrent / a lone request's
(goal <= 1.5x), and the concurrent max latency / median (goal <= 3x: no request starved); also the
batches the server formed, the blocks it streamed before their batch's slowest row finished them, and
one block's decode time in-process at batch 1 and at batch `--clients` (on a CPU a batched forward costs
about as many times more as it has rows, which bounds what batching can give there; on an accelerator a
batch of 16 costs little more than one row). The clients are one aiohttp session (`--client`): httpx's
async pool cost the client itself 25-36 ms for 16 concurrent GET /v1/models on this CPU (aiohttp 2.5-5
ms), which the first-block ratio had counted as the server's; "the client alone" prints that floor.

Measured 2026-12-03 (defaults, --rounds 15, 2 quiet Intel Xeon cores; the demo gated at threshold 0.9,
exact match 1.000 at 1.7 forwards per 8 tokens vs 1.000 at 8), first block concurrent / lone (rounds'
range), runs in order:
    recorded (threshold 0.9):  1.39x (1.26-1.53), 1.33x (1.24-1.56), 1.37x (1.27-1.80), 1.36x (1.28-1.60);
                               throughput 7.2-7.4x
    cache=dual (+ 0.9):        1.32x (1.24-1.62), 1.50x (1.26-2.07), 1.31x (1.24-1.51); throughput 7.8-8.2x
    threshold=none:            1.61x, 1.64x, 1.63x, 1.64x (rounds 1.53-2.21 and, before the gc.freeze below,
                               one ~200 ms round a run); throughput 8.2-8.3x
    max latency / median 1.01x everywhere. That ~200 ms round was this process's (the clients'): a full
    garbage collection over the trained model, data and gate objects it holds; frozen before the rounds,
    the next run had none (threshold=none rounds 1.59-1.75).
What bounds the ratio here: a lone request's first block is ~0.5 ms of HTTP and preparing, the
scheduler's 5 ms batching window and its block; sixteen pay ~4.5 ms of arrivals (the client's and the
server's loop, ~0.25 ms a request), then the batch-16 block: 1.5 -> 3.3 ms with the threshold, 5.2 ->
11.4 ms with none (one token per step: 4 full forwards a block, 2.2x at 16 rows on one CPU thread).
Two changes of 2026-12-03 count: a row's block streams as soon as it is final, not when its batch's
slowest row finishes (with the threshold 15 of 16 rows finish the first block in one forward, the
batch takes two), and the server's forwards leave a core to the event loop (`serve_cli.default_threads`:
with both cores in the forwards the loop waited ~4 ms to send those blocks; threshold 0.9: 1.58x on two
threads, 1.38x on one; no threshold: 1.59x and 1.63x).

History (same bench, earlier code): the model was trained on one thread (this process's
OMP_NUM_THREADS=1; its gate keeps no threshold: another model) and served ungated (no threshold):
1.61-1.74x on one thread (AMD EPYC), 1.38-1.73x on two (Intel Xeon), dual cache 1.21-1.41x; before
uvicorn[standard] and preparing small bodies in place 1.74x, with the httpx client 3.04x.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dllmflow.inference.serve_cli import default_threads, local_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny model tests serve
from _serving import build_tiny_chat_lm  # noqa: E402

MODEL = "bench-target"
PROMPT = [{"role": "user", "content": "Natalia sold 48 clips to her friends in April."}]


async def short_latencies(
    client: httpx.AsyncClient, url: str, args, during: asyncio.Task | None = None
) -> list[float]:
    """Short greedy requests, one fired every `args.every_s` seconds: `args.short` of them, or (`during`)
    as many as are fired while that task runs (at least one), however fast the machine; seconds each."""

    async def one() -> float:
        t0 = time.perf_counter()
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": args.short_tokens, "temperature": 0}
        (await client.post(f"{url}/chat/completions", json=body)).raise_for_status()
        return time.perf_counter() - t0

    tasks = []
    while len(tasks) < args.short if during is None else not (tasks and during.done()):
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
        busy = await short_latencies(client, url, args, during=task)
        await task
    return {
        "idle_p50_s": statistics.median(idle),
        "busy_p50_s": statistics.median(busy),
        "long_s": long_s[0],
        "busy_n": len(busy),
    }


# ---- dLLM section ---------------------------------------------------------------------------------


def train_demo(root: Path, steps: int, gate: bool = False) -> Path:
    """The demo dLLM (params/tiny_addition.yaml) trained `steps` steps in this process -> its run dir.
    `gate`: then evaluated as the demo flow's evaluate step does (`evaluate_sampler`: the recipe's sweep
    over the threshold, 64 held-out problems), which records in the run dir the setting the flow
    registers it at, and so the one `dllmflow serve` serves it with."""
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training
    from dllmflow.workflow.finetune import evaluate_sampler

    recipe = Path(__file__).resolve().parents[1] / "params" / "tiny_addition.yaml"
    settings = load_settings(
        recipe, dataset={"prepared_dir": str(root / "prepared")}, train={"max_steps": steps},
        checkpoint={"every_steps": steps}, run_dir=str(root / "run"), eval={"untrained_baseline": False},
    )  # fmt: skip
    prepare(settings)
    run_training(settings, root / "run")
    if gate:
        evaluate_sampler(settings, str(root / "run"), "llada")
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
    out["first_x_rounds"] = [r["first_x"] for r in per_round]
    out["first_together_rounds_s"] = [r["first_together_p50_s"] for r in per_round]
    out["client_floor_s"] = floor
    return {**out, "rounds": rounds, "batches": served["batches"], "max_batch": served["max_batch_size_seen"],
            "early": served["early_events"]}  # fmt: skip


def block_cost(run: Path, clients: int, settings: dict | None = None) -> tuple[float, float]:
    """Seconds of one first block (llada, the bench's settings) in-process at batch 1 and `clients`."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.inference.dllm_engine import served_from_path, with_server_settings
    from dllmflow.inference.generate import encode_prompt, load_for_generation

    served = served_from_path(run)
    model, tok, trained = load_for_generation(served.checkpoint, device="cpu")
    recorded = with_server_settings(served.sampler_settings, settings or {})  # as `dllmflow serve` does
    over = {"max_new_tokens": 8, "block_size": 4}
    config = build_sampler_config(served.sampler, over, tok, defaults=recorded)
    sampler = SAMPLERS[served.sampler](
        model, tok, config, mask_id=model.config.mask_token_id, training_settings=trained
    )
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
    """The demo model served once per `--settings` entry ("recorded": the setting its evaluation sweep
    chose, as the demo flow registers it; "cache=dual+threshold=0.9": `dllmflow serve --sampler-setting`
    per pair, "threshold=none" back to the preset), a fresh server each."""
    import torch

    from dllmflow.inference.dllm_engine import served_from_path
    from dllmflow.inference.serve_cli import parse_sampler_settings

    # Trained on every core, as `make demo` trains it (this process runs under OMP_NUM_THREADS=1): on one
    # thread the demo's steps sum in another order, and at its lr that is another model (measured: trained
    # on one Intel Xeon thread its gate kept no threshold, on two it chose 0.9 at exact match 1.000).
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = train_demo(Path(tmp), args.train_steps, gate=True)
        trained_s = time.perf_counter() - t0
        gated = served_from_path(run).lineage.get("setting")
        # The clients run in this process, which now holds the trained model, its data and the gate's
        # objects: a full garbage collection in a round stalled the round's clients ~180 ms (a 16x round).
        gc.collect()
        gc.freeze()
        print(f"dLLM demo (tiny_addition, {args.train_steps} steps trained and gated in {trained_s:.0f} s; "
              f"recorded setting: {gated}), {args.clients} streamed completions of <= 8 tokens in blocks of 4")  # fmt: skip
        for name in args.settings.split(","):
            settings = None if name == "recorded" else parse_sampler_settings(name.split("+"))
            with local_server(
                run, served_model_name="demo", max_batch_size=args.clients, sampler_settings=settings,
                threads=args.threads,
            ) as url:  # fmt: skip
                r = asyncio.run(dllm_measure(url, args.clients, args.rounds, args.client))
            torch.set_num_threads(args.threads or default_threads())  # in-process: the server's threads
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
    print("    each round's ratio (concurrent ms): " + ", ".join(
        f"{x:.2f} ({t * 1e3:.0f})" for x, t in zip(r["first_x_rounds"], r["first_together_rounds_s"])))  # fmt: skip
    get_one, get_many = r["client_floor_s"]
    print(f"  the client ({args.client}) alone: GET /v1/models {get_one * 1e3:.1f} ms, {args.clients} at once "
          f"{get_many * 1e3:.1f} ms (no decoding: what concurrency costs the instrument and the HTTP stack)")  # fmt: skip
    print(f"  concurrent max latency / median {r['max_over_median']:.2f}x (goal <= 3x: no starvation)")
    print(f"  server: {r['batches']} batches in all, largest {r['max_batch']} rows, {r['early']} blocks streamed "
          "before their batch's slowest row finished them")  # fmt: skip
    print("  one block in-process: "
          f"{one * 1e3:.1f} ms at batch 1, {many * 1e3:.1f} ms at batch {args.clients} ({many / one:.1f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="causal,dllm", help="comma list: causal, dllm")
    p.add_argument(
        "--train-steps", type=int, default=1200, help="dllm: demo model training steps (the recipe's)"
    )
    p.add_argument("--clients", type=int, default=16, help="dllm: concurrent clients")
    p.add_argument("--rounds", type=int, default=15, help="dllm: measured rounds (median reported)")
    p.add_argument(
        "--settings", default="recorded,threshold=none,cache=dual",
        help="dllm: comma list of served settings: recorded (what the demo's gate chose, as registered) or "
        "KEY=VALUE pairs joined by + (e.g. cache=dual+threshold=0.9; threshold=none: no threshold), each a "
        "`dllmflow serve --sampler-setting`",
    )  # fmt: skip
    p.add_argument(
        "--client", choices=("aiohttp", "httpx"), default="aiohttp", help="dllm: the bench's HTTP client"
    )
    p.add_argument(
        "--threads", type=int, default=None,
        help="the server's torch threads (`dllmflow serve --threads`; default: the server's own, "
        "`serve_cli.default_threads()`, as deployed: every core but one, whatever this process's "
        "OMP_NUM_THREADS says)",
    )  # fmt: skip
    p.add_argument("--short", type=int, default=12, help="short requests per phase")
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--every-s", type=float, default=0.1, help="one short request every this many seconds")
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    args = p.parse_args()
    # This process runs on one thread (its client must not spread over the server's cores); the servers
    # it starts pick their own threads, as a deployed server does, unless --threads says.
    os.environ.pop("OMP_NUM_THREADS", None)
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
            f"while a long request runs {r['busy_p50_s'] * 1e3:.0f} ms ({r['busy_n']} requests), ratio "
            f"{r['busy_p50_s'] / r['idle_p50_s']:.2f}x (long request {r['long_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
