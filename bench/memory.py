"""Training memory on 2 CPU ranks (FSDP2, gloo, torchrun): every figure a ratio measured in this run.

    OMP_NUM_THREADS=1 python bench/memory.py                  # ~0.41B Qwen3 (hidden 1024, 24 layers, vocab 32k)
    python bench/memory.py --layers 8 --act-layers 2 --seq 512   # smaller, on a busy machine

1. build: peak RSS per rank (the larger of the two) over the fp32 bytes of the full model, for the
   eager build (whole fp32 model on every rank, then `fully_shard`) and the meta-device build
   (`models.meta.build_on_meta` -> `apply_fsdp` -> `materialize` with the seeded init). Each build runs
   in its own torchrun launch, so one's freed memory cannot hide the other's peak.
2. activations: RSS held after one forward at `--seq` tokens (batch 1; what backward will read),
   activation checkpointing `full` over `none`, on a model of the same width with `--act-layers` layers
   (a forward of the whole 0.4B model at L=1024 takes minutes per rank on 2 shared cores; the ratio is
   per layer). The logits ([L, 32k] fp32) are in both.
3. step: peak RSS of one training step (forward, backward, AdamW) above the materialised model,
   `train.dtype` bfloat16 (FSDP2 MixedPrecisionPolicy) over float32, on the `--act-layers` model.

4. pretrained load: peak RSS per rank (the larger of the two) over the fp32 bytes of the model while
   `build_parallel_model` loads a pretrained safetensors dir (~`--load-mb` MB, written in a temp dir) at
   2 ranks under FSDP2: each rank reading its own rows (models/sharded_load.py) and, for contrast, the
   rank-0 path (rank 0 loads the whole model and broadcasts it). `--only-load` runs just this row.

glibc is told to serve large blocks with mmap (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the
RSS and deltas measure what is live; peaks come from /proc/self/status VmHWM (reset via clear_refs).
Beside each measured row it prints the memory planner's prediction (`dllmflow.training.planner`,
docs/memory_planner.md) and measured / predicted: the activations one forward keeps and the first step's
peak above the materialised model (`MemoryPlan.first_step_above_weights`). Build peaks are not planned.
Does not assert.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def peak() -> int:
    return _status("VmHWM")


def qwen3_config(layers: int):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build(layers: int, how: str, param_dtype=None, ac: str = "none"):
    from transformers import AutoModelForCausalLM

    from dllmflow.models.meta import build_on_meta, materialize
    from dllmflow.training.parallelize import apply_ac, apply_fsdp

    torch.manual_seed(0)
    rng = torch.get_rng_state()
    if how == "eager":
        model = AutoModelForCausalLM.from_config(qwen3_config(layers), dtype=torch.float32)
        return apply_fsdp(apply_ac(model, ac), param_dtype)
    with build_on_meta():
        model = AutoModelForCausalLM.from_config(qwen3_config(layers), dtype=torch.float32)
    apply_fsdp(apply_ac(model, ac), param_dtype)
    return materialize(model, torch.device("cpu"), rng=rng)


def write_pretrained(out: Path, target_mb: int) -> int:
    """A Qwen3 checkpoint of about `target_mb` MB (fp32 safetensors, untied head) with a word-level
    tokenizer of its exact vocabulary; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dllmflow.settings import load_settings
    from dllmflow.training.planner import stand_in_tokenizer

    vocab, hidden = 16000, 512
    per_layer = 4 * hidden * hidden + 3 * hidden * 1536  # q/o 512x512, k/v 512x256 (= one 512x512), MLP
    layers = max(1, (target_mb * 2**20 // 4 - 2 * vocab * hidden) // per_layer)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    stand_in_tokenizer(load_settings("params/tiny_mdlm.yaml").tokenizer, vocab).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def load_worker(args) -> dict:
    """Peak RSS of `build_parallel_model` loading `args.ckpt` (after a warm-up load of the same dir)."""
    from dllmflow.data.tokenizer import build_tokenizer
    from dllmflow.settings import load_settings
    from dllmflow.training import parallelize
    from dllmflow.training.distributed import init_distributed

    if args.load_path == "rank0":  # the broadcast path: no rank reads its own shards
        parallelize.sharded_loader = lambda model, ckpt: None
    settings = load_settings(
        "params/tiny_mdlm.yaml",
        model={"tiny": None, "pretrained_model_name_or_path": args.ckpt},
        tokenizer={"name_or_path": args.ckpt},
        distributed={"strategy": "fsdp2"},
    )
    info = init_distributed(settings)
    tokenizer = build_tokenizer(settings, [])
    torch.manual_seed(0)
    parallelize.build_parallel_model(tokenizer, settings, info)  # warm-up: imports, lazy loads (freed)
    gc.collect()
    base = rss()
    reset_peak()
    model = parallelize.build_parallel_model(tokenizer, settings, info)
    out = {"load_peak": peak() - base, "params": sum(p.numel() for p in model.parameters())}
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, out)
    torch.distributed.destroy_process_group()
    return {k: max(g[k] for g in gathered) for k in out}


def predictions(args) -> dict:
    """The planner's bytes for the rows it predicts, on the bench's own model (2 ranks, FSDP2, batch 1)."""
    from transformers import AutoModelForCausalLM

    from dllmflow.models.meta import build_on_meta
    from dllmflow.training.planner import activation_bytes, count_built, memory_plan

    with build_on_meta():
        count = count_built(AutoModelForCausalLM.from_config(qwen3_config(args.act_layers)))
    out = {}
    for ac in ("none", "full"):  # what one fp32 forward keeps (its logits, no loss)
        out[f"act_{ac}"] = activation_bytes(count.shape, args.seq, 4, ac, backward=False)
    for name, c in (("float32", 4), ("bfloat16", 2)):
        plan = memory_plan(
            count, world=2, fsdp=True, master_bytes=4, compute_bytes=c, ac="none", tokens=args.seq
        )
        out[f"step_{name}"] = plan.first_step_above_weights
    return out


def worker(args) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out: dict = {}
    build(1, args.build)  # warm-up: imports and lazy module loads are not the model's memory
    # 1) the build
    gc.collect()
    base = rss()
    reset_peak()
    model = build(args.layers, args.build)
    out["build_peak"] = peak() - base
    out["params"] = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    if args.build == "meta" and args.act_layers:
        ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
        # 2) activations held after a forward, AC none vs full
        for ac in ("none", "full"):
            model = build(args.act_layers, "meta", ac=ac)
            gc.collect()
            before = rss()
            loss = model(input_ids=ids).logits.float().sum()
            out[f"act_{ac}"] = rss() - before
            del loss, model
            gc.collect()
        # 3) one training step, fp32 vs bf16 compute
        for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
            model = build(args.act_layers, "meta", param_dtype=dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            gc.collect()
            base = rss()
            reset_peak()
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            opt.step()
            out[f"step_{name}"] = peak() - base
            del model, opt
            gc.collect()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    dist.destroy_process_group()
    return {k: max(g[k] for g in gathered) for k in out}


def launch(args, how: str, extra: tuple[str, ...] = ()) -> dict:
    """One torchrun launch of 2 ranks for one build; returns rank 0's JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "out.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(args.port),
            __file__, "--worker", "--build", how, "--layers", str(args.layers),
            "--act-layers", str(args.act_layers if how == "meta" else 0), "--seq", str(args.seq),
            "--out", str(result), *extra,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, env=env)
        return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--act-layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--build", default="meta")
    p.add_argument("--out", default=None)
    p.add_argument("--load-mb", type=int, default=100, help="size of the pretrained checkpoint of row 4")
    p.add_argument("--only-load", action="store_true", help="run only the pretrained-load row")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--load-path", default="sharded")
    args = p.parse_args()
    if args.worker:
        res = load_worker(args) if args.ckpt else worker(args)
        if int(os.environ["RANK"]) == 0:
            Path(args.out).write_text(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        n = write_pretrained(Path(tmp) / "ckpt", args.load_mb)
        loads = {
            path: launch(args, "meta", ("--ckpt", str(Path(tmp) / "ckpt"), "--load-path", path))
            for path in ("sharded", "rank0")
        }
    load_rows = [
        (f"pretrained load: {n / 1e6:.1f}M params, {4 * n / 2**20:.0f} MB fp32 safetensors", ""),
        ("  load peak RSS per rank / fp32 model, sharded", f"{loads['sharded']['load_peak'] / (4 * n):.2f}   (goal <= 0.6)"),
        ("  load peak RSS per rank / fp32 model, rank-0 broadcast", f"{loads['rank0']['load_peak'] / (4 * n):.2f}"),
    ]  # fmt: skip
    if args.only_load:
        width = max(len(r[0]) for r in load_rows)
        for name, value in load_rows:
            print(f"{name:<{width}}  {value}")
        return
    eager, meta = launch(args, "eager"), launch(args, "meta")
    full = 4 * meta["params"]
    gib = 2**30
    pred = predictions(args) if args.act_layers else {}
    rows = [
        ("model", f"{meta['params'] / 1e9:.3f}B params, fp32 {full / gib:.2f} GiB, 2 ranks FSDP2"),
        ("build peak RSS / fp32 model, eager", f"{eager['build_peak'] / full:.2f}"),
        ("build peak RSS / fp32 model, meta", f"{meta['build_peak'] / full:.2f}   (goal <= 0.65)"),
    ]
    if args.act_layers:
        rows += [
            (f"activations AC full / none ({args.act_layers} layers, L={args.seq})",
             f"{meta['act_full'] / meta['act_none']:.2f}   (goal <= 0.5; "
             f"{meta['act_none'] / gib:.2f} -> {meta['act_full'] / gib:.2f} GiB)"),
            ("step peak RSS bf16 / fp32",
             f"{meta['step_bfloat16'] / meta['step_float32']:.2f}   "
             f"({meta['step_float32'] / gib:.2f} -> {meta['step_bfloat16'] / gib:.2f} GiB)"),
        ]  # fmt: skip
        rows.append(("planner (measured / predicted GiB = ratio):", ""))
        for key, label in (
            ("act_none", "activations AC none"),
            ("act_full", "activations AC full"),
            ("step_float32", "step peak fp32"),
            ("step_bfloat16", "step peak bf16"),
        ):
            rows.append((f"  {label}", f"{meta[key] / gib:.3f} / {pred[key] / gib:.3f} = "
                                       f"{meta[key] / pred[key]:.2f}"))  # fmt: skip
    rows += load_rows
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
