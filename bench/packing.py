"""Supervised tokens per second of packed (`dataset.packing: true`) against padded training, in one run.

    OMP_NUM_THREADS=2 python bench/packing.py                       # mdlm, GSM8K rows, seq 1024, 16 rows/step
    python bench/packing.py --mode scdd --steps 6 --rows 32
    python bench/packing.py --set model.tiny.hidden_size=256 --set model.tiny.num_hidden_layers=4

Both runners train the same model on the same rows: the embedded GSM8K data prepared with the tiny
recipe (`params/tiny_<mode>.yaml`, its tokenizer, `dataset.seq_length` 1024), `--rows` rows per step,
through the trainer's own step (`GlobalBatches` -> `train_step`: collate, per-sample corruption,
global counts, forward, loss, backward) plus clipping and the AdamW update. Padded: one row per
sequence, every sequence padded to the full 1024 (`dllm.pad_seq_len_divisible: 1024`). Packed: the
same rows, several to a sequence (docs/strategies.md §1.8), sequences also 1024 long. The runners
alternate step by step (same step index, hence the same rows and the same noise), so machine-load
drift hits both alike. Printed: supervised tok/s of each (supervised tokens of the timed steps over
their wall time), sequences per step, and the ratio packed / padded (goal: >= 2.5).

Measured (CPU only, 2 cores shared with other jobs, `OMP_NUM_THREADS=2`; the tiny recipes' Qwen3 at
hidden 128 / 2 layers, 256 GSM8K training rows of 243 tokens on average (max 674), 16 rows per step,
1 warm-up + 8 timed steps; packed = 4.2 sequences per step against 16):

    mdlm  padded 1882 / packed 6626 supervised tok/s = 3.52 (median per-step ratio 3.55), load ~3
    scdd  padded 1673 / packed 6471 supervised tok/s = 3.87 (5 steps)
    mdlm  under heavy load (load average 5-6 on the 2 cores): 2.36-2.48, steps 3-5x slower overall

The ratio is below the sequence ratio (16 / 4.2 = 3.8) by the per-step costs that do not shrink with
the sequences (per-document corruption, the optimizer step) and, on an oversubscribed CPU, by
scheduling overhead that weighs more on the shorter packed step. No GPU figure yet.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GOAL = 2.5
DEFAULT_SET = {"model.tiny.hidden_size": 128, "model.tiny.intermediate_size": 256}


def build_settings(args, prepared: Path, packing: bool):
    from dllmflow.settings import load_settings, parse_overrides

    overrides = {
        **DEFAULT_SET,
        "dataset.seq_length": args.seq_len,
        "dataset.limit": args.limit,
        "dataset.prepared_dir": str(prepared),
        "dataset.packing": packing,
        "dllm.pad_seq_len_divisible": args.seq_len,  # padded: every sequence is seq_len long
        "dllm.supervise_padding": False,  # packing has no padding tail to supervise (tiny_scdd does)
        "train.local_batch_size": args.rows,
        "train.global_batch_size": args.rows,
        "train.max_steps": args.warmup + args.steps,
        **parse_overrides(args.set),
    }
    return load_settings(ROOT / "params" / f"tiny_{args.mode}.yaml", **overrides)


class Runner:
    """The trainer's step for one settings object: train_step + clip + AdamW, on a shared model."""

    def __init__(self, settings, data, tokenizer, model, strategy, device):
        from dllmflow.data.pack import build_collator
        from dllmflow.training.data import GlobalBatches
        from dllmflow.training.distributed import DistInfo

        t = settings.train
        self.settings, self.model, self.strategy = settings, model, strategy
        self.info = DistInfo(0, 0, 1, device, False)
        collate = build_collator(settings, tokenizer)
        self.batches = GlobalBatches(data, collate, t.global_batch_size, t.local_batch_size, 0, 1, t.seed)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.seconds, self.supervised, self.sequences, self.tokens = 0.0, 0, 0, 0
        self.times: list[float] = []  # wall time of each timed step

    def step(self, step: int, timed: bool) -> None:
        from dllmflow.training.step import clip_grad_norm, train_step

        sync()
        t0 = time.perf_counter()
        record = train_step(
            self.model, self.strategy, self.batches, step, self.settings, self.info, nullcontext()
        )
        clip_grad_norm(self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.seconds += self.times[-1]
            self.supervised += record["supervised_tokens"]
            self.tokens += record["tokens_per_step"]
            self.sequences += record["tokens_per_step"] // self.settings.dataset.seq_length

    def report(self, name: str, steps: int) -> float:
        tps = self.supervised / self.seconds
        print(
            f"{name:<7} {tps:10.0f} supervised tok/s   {self.sequences / steps:5.1f} sequences/step   "
            f"{self.supervised / self.tokens:6.1%} of tokens supervised   {self.seconds / steps:6.2f} s/step"
        )
        return tps


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="mdlm", choices=["mdlm", "scdd"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=16, help="rows (documents) per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--limit", type=int, default=256, help="prepared training rows")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        padded_s, packed_s = (build_settings(args, Path(tmp) / "prepared", p) for p in (False, True))
        prepare(padded_s)
        tokenizer = load_tokenizer(padded_s.dataset.prepared_dir)
        data = PreparedDataset(padded_s.dataset.prepared_dir, "train")
        lengths = [len(data[i]["input_ids"]) for i in range(len(data))]
        torch.manual_seed(0)
        model = build_mode_model(padded_s, tokenizer).to(device).train()
        strategies = [build_strategy(s) for s in (padded_s, packed_s)]
        for strategy in strategies:
            strategy.setup(model, tokenizer, device)
        padded, packed = (
            Runner(s, data, tokenizer, model, st, device) for s, st in zip((padded_s, packed_s), strategies)
        )
        for step in range(args.warmup + args.steps):
            for runner in (padded, packed):
                runner.step(step, timed=step >= args.warmup)
    print(
        f"mode {args.mode}, seq {args.seq_len}, {args.rows} rows/step, {len(lengths)} GSM8K rows of "
        f"{sum(lengths) / len(lengths):.0f} tokens on average (max {max(lengths)}), device {device.type}"
    )
    a, b = padded.report("padded", args.steps), packed.report("packed", args.steps)
    ratio = b / a
    # Both runners train the same supervised tokens at each step, so a step's ratio is a time ratio;
    # its median over the interleaved pairs resists the load drift of a shared machine.
    median = statistics.median(p / q for p, q in zip(padded.times, packed.times))
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"packed / padded supervised tok/s = {ratio:.2f} (median of per-step ratios {median:.2f}; "
          f"goal >= {GOAL}: {verdict})")  # fmt: skip
    return ratio


if __name__ == "__main__":
    main()
