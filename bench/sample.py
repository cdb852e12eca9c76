"""Sampler speed: `llada` with threshold 0.9 against one token per step, same checkpoint, same prompts.

    OMP_NUM_THREADS=1 python bench/sample.py                       # trains a tiny overfit checkpoint (~30 s)
    python bench/sample.py --checkpoint runs/tiny_mdlm/checkpoints --split eval --limit 32

Without `--checkpoint` a tiny mdlm model is trained in-process on 16 short GSM-style chats and scored
on those same chats (exact match is only meaningful where the model learned something). Prints
tokens/s, NFE (forwards per example), tokens per forward and exact match of both settings, and the
threshold run as a ratio of the one-token-per-step baseline measured in the same run. Does not assert.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("tokens_per_s", "nfe", "tokens_per_forward", "exact_match_strict", "exact_match_flexible")


def train_overfit_checkpoint(root: Path, steps: int) -> Path:
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    data = root / "chat.jsonl"
    with data.open("w") as f:
        for i in range(16):
            a, b = 3 + 7 * i % 50, 11 + 5 * i % 40
            chat = [{"role": "user", "content": f"Tom has {a} apples and buys {b} more. How many now?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}\n#### {a + b}"}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")
    settings = load_settings(
        ROOT / "params" / "tiny_mdlm.yaml",
        run_dir=str(root / "run"),
        dataset={"path_or_dataset_id": str(data), "prepared_dir": str(root / "prepared"), "eval_fraction": 0.0,
                 "seq_length": 64},
        tokenizer={"train_vocab_size": 300},
        train={"max_steps": steps, "global_batch_size": 16, "local_batch_size": 16, "lr": 3e-3, "warmup_steps": 10,
               "log_every": 100},
        checkpoint={"every_steps": steps},
        eval={"limit": 16, "batch_size": 16},
    )  # fmt: skip
    prepare(settings)
    run_training(settings, settings.run_dir)
    return root / "run" / "checkpoints"


def main() -> None:
    from dllmflow.evaluate import evaluate

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="default: train a tiny overfit checkpoint first")
    p.add_argument("--split", help="default: train for the built checkpoint, eval otherwise")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--train_steps", type=int, default=300)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or train_overfit_checkpoint(Path(tmp), args.train_steps)
        split = args.split or ("eval" if args.checkpoint else "train")
        base = {"max_new_tokens": args.max_new_tokens, "steps": args.max_new_tokens}  # one token per step
        runs = {"one_per_step": base, f"threshold_{args.threshold}": {**base, "threshold": args.threshold}}
        evaluate(ckpt, split=split, limit=2, overrides=base)  # warm-up (allocator, first forwards)
        results = {
            name: evaluate(ckpt, split=split, limit=args.limit, overrides=o)["metrics"]
            for name, o in runs.items()
        }

    names = list(results)
    print(
        f"\nllada on {ckpt} ({split}, {results[names[0]]['num_examples']} prompts, {args.max_new_tokens} new tokens)"
    )
    print(f"{'':<18}" + "".join(f"{k:>22}" for k in KEYS))
    for name in names:
        print(f"{name:<18}" + "".join(f"{results[name][k]:>22.3f}" for k in KEYS))
    ratio = {
        k: results[names[1]][k] / results[names[0]][k] if results[names[0]][k] else float("nan") for k in KEYS
    }
    print(f"{'ratio thr/base':<18}" + "".join(f"{ratio[k]:>21.2f}x" for k in KEYS))


if __name__ == "__main__":
    main()
