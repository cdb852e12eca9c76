"""Regeneration throughput: rows/s against the local `dllmflow serve` at concurrency 1 vs 8.

    OMP_NUM_THREADS=1 python bench/regenerate.py [--rows 48] [--max-new-tokens 16] [--concurrency 8]

The server batches requests that arrive together into one `generate` call, so concurrent requests
overlap; the figure printed is the speed-up of concurrency N over concurrency 1, measured in the same
run on the same server (tiny random Llama, greedy). It does not assert.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from dllmflow.data.regen_client import regenerate
from dllmflow.inference.serve_cli import local_server
from dllmflow.settings import RegenerateConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny model tests serve
from _serving import build_tiny_chat_lm  # noqa: E402

MODEL = "bench-target"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_tiny_chat_lm(tmp / "model", args.hidden_size, 512)
        rows = [
            {"messages": [{"role": "user", "content": f"question {i}: how many clips?"}]}
            for i in range(args.rows)
        ]
        (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        with local_server(tmp / "model", served_model_name=MODEL) as url:
            results = {}
            for conc in (1, args.concurrency, 1):  # 1 twice: the first run also warms the server up
                cfg = RegenerateConfig(
                    input_data=str(tmp / "in.jsonl"), output_dir=str(tmp / f"out-{conc}-{len(results)}"),
                    target_server=url, model=MODEL, shard_size=args.rows, concurrency=conc,
                    max_new_tokens=args.max_new_tokens,
                )  # fmt: skip
                before = httpx.get(url.removesuffix("/v1") + "/stats").json()["batches"]
                summary = regenerate(cfg, progress=False)
                batches = httpx.get(url.removesuffix("/v1") + "/stats").json()["batches"] - before
                results[conc] = (summary["rows_per_s"], args.rows / batches)
    base, base_batch = results[1]
    fast, fast_batch = results[args.concurrency]
    print(f"rows={args.rows} max_new_tokens={args.max_new_tokens} hidden={args.hidden_size}")
    print(f"concurrency 1: {base:.2f} rows/s (mean batch {base_batch:.1f})")
    print(f"concurrency {args.concurrency}: {fast:.2f} rows/s (mean batch {fast_batch:.1f})")
    print(f"speed-up concurrency {args.concurrency} / 1: {fast / base:.2f}x")


if __name__ == "__main__":
    main()
