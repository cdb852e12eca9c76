#!/usr/bin/env bash
# GPU throughput: mdlm on a ~0.5B Qwen3-shaped model (random init) in bf16 with FSDP2 (world 1: fully_shard
# still applies under torchrun with one process) and full activation checkpointing, then the same with
# LoRA r=16. Prints median tokens/s and MFU over the steps after the warm-up, to stdout and to
# $OUT/gpu_bench.txt when $OUT is set. Budget: under 8 minutes on one H200 (prepare ~30 s, each variant
# ~1-2 min including start-up and the final checkpoint).
#
#   bash bench/gpu.sh                      # one GPU; GPU_BENCH_PEAK_TFLOPS=989 (H200 bf16 dense)
#   GPU_BENCH_TINY=1 bash bench/gpu.sh     # CPU dry run: tiny model, 3 steps (checks the script, not speed)
#
# Needs (nothing is installed; the device machine is offline): `python` on PATH with torch (CUDA), and the
# repo's dependencies (transformers, tokenizers, peft, pyarrow, pydantic-settings, ...) importable with
# dllmflow itself - the carried repo venv (`source .venv/bin/activate`) or an image built from
# infra/Dockerfile; the script puts ./src on PYTHONPATH. Data: the embedded GSM8K (no download), tokenised
# by `dllmflow prepare` with a trained BPE. Writes under $GPU_BENCH_DIR (default: a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TINY="${GPU_BENCH_TINY:-0}"
WORK="${GPU_BENCH_DIR:-$(mktemp -d -t dllmflow-gpu-bench.XXXXXX)}"
PEAK="${GPU_BENCH_PEAK_TFLOPS:-989}"
mkdir -p "$WORK"

# 1) the recipe override (on top of params/tiny_mdlm.yaml): model size, batch, steps, bf16 + FSDP2 + AC
if [ "$TINY" = 1 ]; then
  MODEL='{architecture: qwen3, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 128}'
  STEPS=3 WARMUP=1 BATCH=2 SEQ=128 VOCAB=512 BACKEND=gloo
else  # 32 x (attention 3.1M + MLP 12.6M) + embeddings = ~0.51B parameters
  MODEL='{architecture: qwen3, hidden_size: 1024, num_hidden_layers: 32, num_attention_heads: 16, num_key_value_heads: 8, intermediate_size: 4096}'
  STEPS=40 WARMUP=10 BATCH=32 SEQ=512 VOCAB=8192 BACKEND=nccl
fi
cat > "$WORK/override.yaml" <<EOF
name: gpu_bench
model:
  tiny: $MODEL
tokenizer: {train_vocab_size: $VOCAB}
dataset: {seq_length: $SEQ, prepared_dir: $WORK/prepared}
train:
  max_steps: $STEPS
  global_batch_size: $BATCH
  local_batch_size: $BATCH
  warmup_steps: 0
  dtype: bfloat16
  activation_checkpointing: full
  peak_tflops: $PEAK
checkpoint: {every_steps: 100000, save_consolidated: "false"}
distributed: {strategy: fsdp2, backend: $BACKEND}
EOF

# 2) data: the embedded GSM8K, tokenised once
python -m dllmflow.cli prepare --params params/tiny_mdlm.yaml "$WORK/override.yaml" >"$WORK/prepare.log" 2>&1 \
  || { cat "$WORK/prepare.log"; exit 1; }

# 3) one variant: settings.json from the recipes + --set overrides, torchrun with one process
run_variant() {  # NAME [KEY=VALUE ...]
  local name="$1"; shift
  local run="$WORK/runs/$name"
  mkdir -p "$run"
  python - "$run/settings.json" "$WORK/override.yaml" "$@" <<'PY'
import sys

from dllmflow.settings import load_settings
from dllmflow.training.launch import parse_overrides

out, override, *pairs = sys.argv[1:]
load_settings("params/tiny_mdlm.yaml", override, **parse_overrides(pairs)).write_json(out)
PY
  python -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m dllmflow.training.main --settings "$run/settings.json" >"$run/train.log" 2>&1 \
    || { tail -n 40 "$run/train.log"; exit 1; }
}

run_variant full
run_variant lora peft.r=16 peft.alpha=32

# 4) the summary: median tps / mfu after the warm-up steps, from each run's metrics.jsonl
python - "$WORK" "$WARMUP" "${OUT:-}" <<'PY'
import json
import statistics
import sys
from pathlib import Path

from dllmflow.runs import RunLayout
from dllmflow.settings import load_settings_json
from dllmflow.training.planner import plan_memory

work, warmup, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
settings = load_settings_json(work / "runs/full/settings.json")
t, tiny = settings.train, settings.model.tiny
rows = [
    f"mdlm, Qwen3-shaped {tiny.num_hidden_layers} x {tiny.hidden_size} (random init), bf16, FSDP2 world 1, "
    f"AC full, micro-batch {t.local_batch_size} x {settings.dataset.seq_length}, peak {t.peak_tflops} TFLOP/s; "
    f"medians over steps > {warmup}; planned = the memory planner's peak",
    f"{'variant':<8} {'params':>13} {'trainable':>13} {'tokens/s':>11} {'MFU %':>7} {'mem GiB':>8} {'planned':>8}",
]
for name in ("full", "lora"):
    run = work / "runs" / name
    records = [json.loads(line) for line in RunLayout(run).metrics_jsonl.read_text().splitlines()]
    steady = [r for r in records if r["step"] > warmup] or records
    plan = plan_memory(load_settings_json(run / "settings.json"), world_size=1)
    tps = statistics.median(r["tps"] for r in steady)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in steady)
    mem = max(r.get("mem", 0.0) for r in steady)  # CUDA: max allocated; CPU: the process's peak RSS
    rows.append(
        f"{name:<8} {plan.params:>13,} {plan.trainable:>13,} {tps:>11,.0f} {mfu:>7.2f} {mem:>8.2f} "
        f"{plan.peak / 2**30:>8.2f}"
    )
rows.append("MFU = 6 x all parameters x tokens / time / peak (LoRA skips most weight gradients: its MFU reads low)")
text = "\n".join(rows)
print(text)
if out:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_bench.txt").write_text(text + "\n")
PY
