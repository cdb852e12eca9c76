"""Peak RSS of GRPO with LoRA over the SFT LoRA run's, from the same starting export, in one run.

    OMP_NUM_THREADS=1 python bench/grpo_memory.py                  # ~0.1B Qwen3 (hidden 768, 12 layers)
    python bench/grpo_memory.py --layers 4 --hidden 512            # smaller, on a busy machine

Everything in a temp dir it removes: prepare params/tiny_addition.yaml (embedded:addition), write a
random starting export of a wider model (`--hidden`, `--layers`; one full SFT step, so it is a real
consolidated export), then two arms, each in its own process so one's freed memory cannot hide the
other's peak, both with LoRA (`peft:` r 8 on the attention + MLP projections), `--steps` steps:

  sft:  the Trainer on the addition rows from the export (train.global_batch_size 8)
  grpo: the GRPOTrainer from the export (rl.prompts_per_step 2 x rl.num_generations 4, mu 1)

Each arm prints its process's peak RSS (VmHWM) and the RSS after its imports; the bench prints both
peaks, the ratio grpo / sft, and the ratio of the peaks above the import baseline (what the model,
optimizer and activations add). Issue 41's goal: grpo / sft <= 1.1 (the KL reference is the policy
with its adapters disabled, not a second copy of the model). Does not assert.

Measured 2026-12-04 (defaults, 2 shared CPU cores), before and after the reference became the policy
with its adapters disabled:
    before (a second full model as reference): sft 1.13 GiB | grpo 1.48 GiB | 1.31x (above imports 1.42x)
    after:                                     sft 1.14 GiB | grpo 1.10 GiB | 0.97x (above imports 0.96x)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT_RECIPE = ROOT / "params" / "tiny_addition.yaml"
RL_RECIPE = ROOT / "params" / "tiny_addition_grpo.yaml"
LORA = {"r": 8, "alpha": 16, "dropout": 0.0}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _data(tmp: Path) -> dict:
    return {
        "dataset": {"limit": 256, "prepared_dir": str(tmp / "prep")},
        "registry": {"live_tracking": False},
    }


def _model(args) -> dict:
    return {
        "tiny": {
            "architecture": "qwen3",
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(1, args.hidden // 256),
            "intermediate_size": 4 * args.hidden,
        }
    }


def arm(args) -> dict:
    """One arm in this process: its peak RSS and the RSS after its imports."""
    from dllmflow.rl.grpo_trainer import run_grpo
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training
    from dllmflow.workflow.grpo import starting_settings

    tmp = Path(args.tmp)
    base = _status("VmRSS")
    steps = {"max_steps": args.steps, "log_every": 1, "global_batch_size": 8, "local_batch_size": 8}
    ckpt = {"every_steps": args.steps, "save_consolidated": "false"}
    if args.arm == "sft":
        model = {"tiny": None, "pretrained_model_name_or_path": str(tmp / "start")}
        s = load_settings(SFT_RECIPE, **_data(tmp), model=model, peft=LORA, train=steps, checkpoint=ckpt)
        run_training(s, tmp / "sft")
    else:
        rl = {"prompts_per_step": 2, "num_generations": 4, "num_iterations": 1, "eval_every": 0}
        s = load_settings(RL_RECIPE, **_data(tmp), peft=LORA, train=steps, checkpoint=ckpt, rl=rl)
        s, _ = starting_settings(s, str(tmp / "start"))
        run_grpo(s, tmp / "grpo")
    return {"peak": _status("VmHWM"), "base": base}


def start_export(args, tmp: Path) -> None:
    """The prepared addition data and a random starting export of the wider model (one SFT step)."""
    from dllmflow.data.prepare import prepare
    from dllmflow.runs import find_consolidated
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    prepare(load_settings(SFT_RECIPE, **_data(tmp)))
    s = load_settings(
        SFT_RECIPE, **_data(tmp), model=_model(args),
        train={"max_steps": 1, "global_batch_size": 8, "local_batch_size": 8, "warmup_steps": 0},
        checkpoint={"every_steps": 1},
    )  # fmt: skip
    run_training(s, tmp / "sft_start")
    os.symlink(find_consolidated(tmp / "sft_start"), tmp / "start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--arm", choices=["sft", "grpo"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        print(json.dumps(arm(args)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-grpo-mem-") as tmp:
        start_export(args, Path(tmp))
        out = {}
        for name in ("sft", "grpo"):
            cmd = [sys.executable, __file__, "--arm", name, "--tmp", tmp, "--steps", str(args.steps)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[name] = json.loads(done.stdout.strip().splitlines()[-1])
    gib = 2**30
    sft, grpo = out["sft"], out["grpo"]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, LoRA r {LORA['r']}, {args.steps} steps per arm"
    )
    print(f"peak RSS   sft {sft['peak'] / gib:.2f} GiB | grpo {grpo['peak'] / gib:.2f} GiB | "
          f"grpo / sft {grpo['peak'] / sft['peak']:.2f}x")  # fmt: skip
    above = (grpo["peak"] - grpo["base"]) / max(sft["peak"] - sft["base"], 1)
    print(f"above the imports: sft {(sft['peak'] - sft['base']) / gib:.2f} GiB | "
          f"grpo {(grpo['peak'] - grpo['base']) / gib:.2f} GiB | grpo / sft {above:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
