"""Peak memory and time of the SCDD loss forward+backward, chunked vs unchunked (docs/strategies.md §2.2).

    python bench/scdd_memory.py                       # vocab 32k, 1,024 positions, CUDA if available
    python bench/scdd_memory.py --vocab 32000 --positions 1024 --chunks 1024 256 128 --reps 3

Each configuration runs in a fresh subprocess so its peak is its own: on CUDA the peak of
`torch.cuda.max_memory_allocated` above the inputs, on CPU the growth of the process's peak RSS
(`ru_maxrss`, which only grows) above the inputs, so the CPU run has no warm-up. The figure includes the logits gradient, which every variant needs.
Printed as ratios against the unchunked baseline of the same run; the chunked value and gradient
are checked against the unchunked ones. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from dllmflow.diffusion.losses import scdd_loss_sum

T, R = 1000, 0.1


def make_inputs(vocab: int, positions: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, L = 1, positions
    mask_id = vocab - 1
    logits = torch.randn(B, L, vocab, generator=g).to(device)
    x = torch.randint(0, vocab - 1, (B, L), generator=g).to(device)
    z = x.clone()
    roll = torch.rand(B, L, generator=g).to(device)
    z[roll < 0.4] = mask_id
    swap = (roll >= 0.4) & (roll < 0.5)
    z[swap] = torch.randint(0, vocab - 1, (B, L), generator=g).to(device)[swap]
    sup = torch.ones(B, L, device=device)
    t = torch.full((B,), 0.5, device=device)
    return logits, x, z, sup, t, mask_id


def fwd_bwd(logits, x, z, sup, t, mask_id, chunk):
    leaf = logits.detach().requires_grad_(True)
    loss = scdd_loss_sum(leaf, x, z, sup, t, mask_id, T, R, chunk_size=chunk)
    loss.backward()
    return loss.detach(), leaf.grad


def measure_one(vocab: int, positions: int, chunk: int | None, reps: int, device: str) -> dict:
    inputs = make_inputs(vocab, positions, device)
    if device == "cuda":  # warm-up (kernels, allocator); on CPU it would raise the peak-RSS baseline
        fwd_bwd(*inputs, chunk)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        loss, grad = fwd_bwd(*inputs, chunk)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del loss, grad
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_bytes": peak, "time_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 256, 128])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: one chunk setting
    args = ap.parse_args()

    if args.one is not None:
        chunk = None if args.one == "none" else int(args.one)
        print(json.dumps(measure_one(args.vocab, args.positions, chunk, args.reps, args.device)))
        return

    def child(chunk: int | None) -> dict:
        cmd = [sys.executable, __file__, "--vocab", str(args.vocab), "--positions", str(args.positions)]
        cmd += [
            "--reps",
            str(args.reps),
            "--device",
            args.device,
            "--one",
            "none" if chunk is None else str(chunk),
        ]
        # A fixed glibc mmap threshold returns every large block to the OS on free, so peak RSS
        # tracks live tensors instead of heap the allocator kept.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    mib = 2**20
    logits_mib = args.positions * args.vocab * 4 / mib
    print(f"SCDD loss fwd+bwd: vocab {args.vocab}, {args.positions} positions, fp32 logits "
          f"({logits_mib:.0f} MiB), device {args.device}, median of {args.reps}")  # fmt: skip
    base = child(None)
    print(
        f"  unchunked          peak +{base['peak_bytes'] / mib:8.0f} MiB   time {base['time_s'] * 1e3:8.1f} ms  (baseline)"
    )
    for chunk in args.chunks:
        r = child(chunk)
        print(
            f"  chunk_size {chunk:<6}  peak +{r['peak_bytes'] / mib:8.0f} MiB   time {r['time_s'] * 1e3:8.1f} ms   "
            f"memory x{r['peak_bytes'] / max(base['peak_bytes'], 1):.2f}   time x{r['time_s'] / base['time_s']:.2f}"
        )

    # Equal value and gradient, in this process.
    inputs = make_inputs(args.vocab, args.positions, args.device)
    ref_loss, ref_grad = fwd_bwd(*inputs, None)
    for chunk in args.chunks:
        loss, grad = fwd_bwd(*inputs, chunk)
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        gdiff = (grad - ref_grad).abs().max().item()
        print(f"  chunk_size {chunk:<6}  value {loss.item():.6f} vs {ref_loss.item():.6f} (rel diff {rel:.1e}), "
              f"max |grad diff| {gdiff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
