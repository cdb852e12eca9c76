"""Training step time: each dLLM strategy against a plain next-token (AR) step, same model, same batch.

    OMP_NUM_THREADS=1 python bench/train_step.py                                  # tiny_mdlm, 20 steps
    python bench/train_step.py --params params/tiny_mdlm.yaml --set model.tiny.hidden_size=256 --steps 30

A full optimizer step is timed for each mode (modes interleaved step by step): corrupt (strategies) + forward + loss + backward +
clip + AdamW step, on one collated batch of `train.local_batch_size` rows of the prepared training
data (prepared first if missing). Every mode starts from the same initial weights. Prints the
median step time of each mode and its ratio to the AR step measured in the same run, with the model
size and sequence length. Does not assert (goal for mdlm on CPU: ratio <= 1.10).
Add a mode by listing it in MODES (and its dllm overrides in MODE_SETTINGS when it needs any).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODES = ["mdlm"]  # dllm.mode names, timed through the strategy registry
MODE_SETTINGS: dict[str, dict] = {"mdlm": {"mode": "mdlm"}}


def ar_step_fn(model, batch):
    """The baseline: causal LM, next-token CE on the supervised positions."""
    ids, mask = batch["input_ids"], batch["loss_mask"]  # [B, L]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits  # [B, L, V]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    return (ce * mask[:, 1:].flatten()).sum() / mask[:, 1:].sum().clamp_min(1)


def strategy_step_fn(strategy, seed: int):
    def step(model, batch):
        b = dict(batch)
        b.update(strategy.corrupt(b, [seed + i for i in range(b["input_ids"].shape[0])]))
        counts = strategy.token_counts(b)
        out = strategy.loss(model, b)
        return sum(out.weight(k) * s / max(float(counts[k]), 1.0) for k, s in out.sums.items())

    return step


class Runner:
    """One mode's model + optimizer; `step()` times one full optimizer step."""

    def __init__(self, model, loss_fn, batch):
        self.model, self.loss_fn, self.batch = model, loss_fn, batch
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.times: list[float] = []

    def step(self, record: bool) -> None:
        t0 = time.perf_counter()
        self.loss_fn(self.model, self.batch).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if record:
            self.times.append(time.perf_counter() - t0)


def main() -> None:
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer
    from dllmflow.diffusion.strategies import STRATEGIES
    from dllmflow.launch import parse_overrides
    from dllmflow.models.build import build_model
    from dllmflow.settings import load_settings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", nargs="+", default=[str(ROOT / "params" / "tiny_mdlm.yaml")])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=MODES)
    args = p.parse_args()

    settings = load_settings(*args.params, **parse_overrides(args.set))
    if not (Path(settings.dataset.prepared_dir) / "manifest.json").is_file():
        prepare(settings)
    tokenizer = load_tokenizer(settings.dataset.prepared_dir)
    data = PreparedDataset(settings.dataset.prepared_dir, "train")
    rows = [data[i % len(data)] for i in range(settings.train.local_batch_size)]
    batch = DLLMCollator.from_settings(settings, tokenizer)(rows)
    torch.manual_seed(settings.train.seed)
    init = {k: v.clone() for k, v in build_model(settings, tokenizer).state_dict().items()}

    def fresh_model(mode_settings):
        model = build_model(mode_settings, tokenizer)
        model.load_state_dict(init)
        return model.train()

    runners = {"ar": Runner(fresh_model(settings), ar_step_fn, batch)}
    for mode in args.modes:
        mode_settings = settings
        if mode != settings.dllm.mode:
            mode_settings = load_settings(
                *args.params, **parse_overrides(args.set), dllm=MODE_SETTINGS.get(mode, {"mode": mode})
            )
        strategy = STRATEGIES[mode](mode_settings)
        model = fresh_model(mode_settings)
        strategy.setup(model, tokenizer, torch.device("cpu"))
        runners[mode] = Runner(model, strategy_step_fn(strategy, settings.train.seed), batch)
    # Interleave the modes step by step so drift in machine load hits all of them alike.
    for i in range(args.warmup + args.steps):
        for runner in runners.values():
            runner.step(record=i >= args.warmup)
    results = {mode: statistics.median(r.times) for mode, r in runners.items()}

    n_params = sum(t.numel() for t in init.values())
    B, L = batch["input_ids"].shape
    print(f"model {n_params / 1e6:.3f}M params | batch {B} x seq_len {L} | {args.steps} timed steps, median")
    print(f"{'mode':<16}{'step ms':>10}{'vs ar':>8}")
    for mode, t in results.items():
        print(f"{mode:<16}{t * 1e3:>10.2f}{t / results['ar']:>8.3f}")


if __name__ == "__main__":
    main()
