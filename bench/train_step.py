"""Training step time of every `dllm.mode` against a plain next-token (AR) step on the same backbone.

    OMP_NUM_THREADS=1 python bench/train_step.py                          # all modes, fp32 / bf16 / AC
    python bench/train_step.py --modes mdlm idlm --steps 30 --seq-len 256 --variants fp32
    python bench/train_step.py --set model.tiny.hidden_size=128 --set model.tiny.num_hidden_layers=4
    python bench/train_step.py --sweep --modes idlm --steps 3              # L = 128 .. 2048 at B = 1

Each mode runs its own tiny recipe `params/tiny_<mode>.yaml` (plus `--set` overrides) through the real
code paths: `prepare` (into a temp dir, `dataset.limit` small), `load_tokenizer`,
`DLLMCollator.from_settings`, `build_strategy` + `build_mode_model` -> `setup` / `corrupt` / `token_counts`
/ `loss`, the trainer's optimizer and its global-count reduction of the loss terms. A timed step is
what the trainer does per step: corrupt + forward + loss + backward + clip + AdamW step, on one
collated batch of `train.local_batch_size` prepared rows (fresh per-sample seeds every step).

The AR baseline is a causal-LM next-token CE step on the same backbone, batch and sequence length:
the plain tiny causal LM (mdlm, scdd, hybrid, idlm), the DiffusionGemma encoder alone as a causal LM
(block_diffusion), and full fine-tuning of the frozen target (dflash: the alternative to training a
draft). Every runner is stepped in turn (interleaved) so machine-load drift hits all alike; the
median over `--steps` timed steps after `--warmup` is reported. Printed, not asserted:

    mode ratio = median mode step / median AR step     (goals: mdlm <= 1.10, idlm <= 2.2)
    corrupt %  = share of the step spent in strategy.corrupt
    dflash     = target forward (strategy.target_features) vs draft step (draft_loss + backward + opt)
    block_diffusion: self_conditioning_p 1 vs 0 (cost of the extra no-grad decoder pass) and the share
                     of building the encoder/decoder attention masks

Variants (`--variants`, each mode and its AR baseline alike, as the trainer runs them on one process):
fp32; bf16 = `train.dtype: bfloat16` (CPU/GPU autocast, fp32 master weights); ac =
`train.activation_checkpointing: full` (every decoder block recomputed in backward). `--sweep` runs the
fp32 ratio at L = 128, 256, 512, 1024, 2048 (`--lengths`) with B = 1: one long row per L (a GSM8K
prompt + its answer repeated up to L, so every mode sees exactly L tokens), all modes and their AR
baselines interleaved at each L. `--no-optimizer` times forward + backward only.

Measured (`OMP_NUM_THREADS=2 ... --sweep --modes idlm --steps 5`, medians of 3-14 runs on a shared
2-core CPU; single runs vary by about +-0.1): idlm 1.6 / 1.7 / 1.9 / 2.05 / 2.14 x AR at L = 128 / 256
/ 512 / 1024 / 2048 with the block-shifted noisy half (`dllmflow.models.shifted_attention`); the
chunked-mask noisy half it replaced measured 1.6 / 1.7 / 1.9 / 2.27 / 2.47 x in the same session.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODES = ["mdlm", "scdd", "hybrid", "idlm", "block_diffusion", "dflash"]
GOALS = {"mdlm": 1.10, "idlm": 2.2}  # issue goals: mode step <= goal x AR step
DATA_LIMIT = 64  # prepared training rows: enough for one batch, quick to tokenise
# A bit wider than the recipes' 64-wide model so per-token compute, not Python overhead, dominates
# (the dflash target is sized from it too); `--set model.tiny.hidden_size=64` gives the recipes' size.
DEFAULT_SET = {"model.tiny.hidden_size": 128, "model.tiny.intermediate_size": 256}
VARIANTS = {  # column -> settings overrides
    "fp32": {},
    "bf16": {"train.dtype": "bfloat16"},
    "ac": {"train.activation_checkpointing": "full"},
}
SWEEP_LENGTHS = [128, 256, 512, 1024, 2048]


# ---- settings and data ----------------------------------------------------------------------------


def mode_settings(mode: str, args, tmp: Path, **extra):
    """The tiny recipe of `mode` with the CLI overrides, data and targets under `tmp`."""
    from dllmflow.settings import load_settings
    from dllmflow.training.launch import parse_overrides

    overrides = {"dataset.limit": DATA_LIMIT, **DEFAULT_SET, **parse_overrides(args.set), **extra}
    if args.seq_len:
        overrides["dataset.seq_length"] = args.seq_len
    if mode == "dflash":
        overrides["dflash.target_model_id"] = f"tiny:{tmp / 'target'}"
    settings = load_settings(ROOT / "params" / f"tiny_{mode}.yaml", **overrides)
    # Prepared data depends on the dataset + tokenizer sections only: share it between recipes.
    used = {"d": settings.dataset.model_dump(mode="json"), "t": settings.tokenizer.model_dump(mode="json")}
    key = hashlib.sha256(json.dumps(used, sort_keys=True).encode()).hexdigest()[:12]
    return load_settings(
        ROOT / "params" / f"tiny_{mode}.yaml", **overrides, **{"dataset.prepared_dir": str(tmp / key)}
    )


def load_batch(settings):
    """Prepare (once per dataset config), then collate the first `local_batch_size` training rows."""
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer

    if not (Path(settings.dataset.prepared_dir) / "manifest.json").is_file():
        prepare(settings)
    tokenizer = load_tokenizer(settings.dataset.prepared_dir)
    data = PreparedDataset(settings.dataset.prepared_dir, "train")
    rows = [data[i % len(data)] for i in range(settings.train.local_batch_size)]
    batch = DLLMCollator.from_settings(settings, tokenizer)(rows)
    batch.pop("global_index", None)
    return tokenizer, batch


def long_batch(settings, length: int):
    """One row of exactly `length` tokens (B = 1): a prompt + its answer repeated, collated as training is."""
    from dllmflow.data.collate import DLLMCollator
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.prepare import prepare
    from dllmflow.data.tokenizer import load_tokenizer

    if not (Path(settings.dataset.prepared_dir) / "manifest.json").is_file():
        prepare(settings)
    tokenizer = load_tokenizer(settings.dataset.prepared_dir)
    row = PreparedDataset(settings.dataset.prepared_dir, "train")[0]
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])
    start = next(i for i, m in enumerate(mask) if m)  # first supervised token
    prompt, answer = ids[: min(start, length // 4)], ids[start:]
    body = (answer * (length // len(answer) + 1))[: length - len(prompt)]
    long_row = {**row, "input_ids": prompt + body, "loss_mask": [0] * len(prompt) + [1] * len(body)}
    long_row["prompt_length"] = len(prompt)
    batch = DLLMCollator.from_settings(settings, tokenizer)([long_row])
    batch.pop("global_index", None)
    assert batch["input_ids"].shape == (1, length), batch["input_ids"].shape
    return tokenizer, batch


def batch_key(batch) -> str:
    h = hashlib.sha256()
    for k in ("input_ids", "attention_mask"):  # the AR step's cost does not depend on loss_mask
        h.update(batch[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


# ---- step functions: (model, batch, step index, marks) -> scalar loss -----------------------------


def ar_loss(model, batch, step: int, marks: dict) -> torch.Tensor:
    """The baseline: causal LM, next-token CE on the supervised positions."""
    ids, mask = batch["input_ids"], batch["loss_mask"]  # [B, L]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits  # [B, L, V]
    return _next_token_ce(logits, ids, mask)


def gemma_encoder_ar_loss(model, batch, step: int, marks: dict) -> torch.Tensor:
    """AR baseline on DiffusionGemma: the causal encoder alone + LM head (no canvas, no decoder)."""
    from dllmflow.diffusion.masks.block_diffusion import build_encoder_masks
    from dllmflow.models.diffusion_gemma import sliding_window_of, softcap

    ids, attn = batch["input_ids"], batch["attention_mask"]  # [B, L]
    B, L = ids.shape
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    hidden = model.model.encoder(
        input_ids=ids,
        attention_mask=build_encoder_masks(attn, sliding_window_of(model), dtype),
        position_ids=torch.arange(L)[None].expand(B, L),
    ).last_hidden_state  # [B, L, H]
    logits = softcap(model.lm_head(hidden).float(), model.final_logit_softcapping)  # [B, L, V]
    return _next_token_ce(logits, ids, batch["loss_mask"])


def _next_token_ce(logits, ids, mask) -> torch.Tensor:
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    return (ce * mask[:, 1:].flatten()).sum() / mask[:, 1:].sum().clamp_min(1)


def strategy_loss(strategy, seed: int, loss_fn: Callable | None = None) -> Callable:
    """corrupt -> token_counts -> loss, combined as the trainer does (term sum / global count)."""
    from dllmflow.diffusion.seeding import sample_seed

    def run(model, batch, step: int, marks: dict) -> torch.Tensor:
        t0 = time.perf_counter()
        b = dict(batch)
        B = b["input_ids"].shape[0]
        b.update(strategy.corrupt(b, [sample_seed(seed, step, step * B + i) for i in range(B)]))
        marks["corrupt"] = time.perf_counter() - t0
        counts = {k: float(v) for k, v in strategy.token_counts(b).items()}
        out = (loss_fn or strategy.loss)(model, b, marks)
        return sum(out.weight(k) * s / max(counts[k], 1.0) for k, s in out.sums.items())

    return run


def dflash_split(strategy) -> Callable:
    """DFlash loss with the frozen target forward timed on its own."""

    def loss(model, batch, marks: dict):
        t0 = time.perf_counter()
        target_hidden = strategy.target_features(batch)  # [B, L, |ids|·d]
        marks["target"] = time.perf_counter() - t0
        return strategy.draft_loss(model, batch, target_hidden)

    return loss


def plain_loss(strategy) -> Callable:
    return lambda model, batch, marks: strategy.loss(model, batch)


# ---- runner -----------------------------------------------------------------------------------------


class Runner:
    """One model + optimizer + batch; `step()` times one full optimizer step and its marked parts."""

    def __init__(self, model, loss_fn, batch, settings, optimizer: bool = True):
        from dllmflow.training.distributed import DistInfo
        from dllmflow.training.parallelize import apply_ac, compute_context
        from dllmflow.training.trainer import build_optimizer

        apply_ac(model, settings.train.activation_checkpointing)  # as the trainer does, per decoder block
        self.context = lambda: compute_context(settings, DistInfo(0, 0, 1, torch.device("cpu"), False))
        self.model, self.loss_fn, self.batch = model.train(), loss_fn, batch
        self.opt = build_optimizer(model, settings) if optimizer else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in model.parameters())
        self.times: list[float] = []
        self.parts: dict[str, list[float]] = defaultdict(list)  # mark -> share of its step
        self.count = 0

    def step(self, record: bool) -> None:
        marks: dict[str, float] = {}
        t0 = time.perf_counter()
        with self.context():
            loss = self.loss_fn(self.model, self.batch, self.count, marks)
        loss.backward()
        if self.opt is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], 1.0)
            self.opt.step()
        dt = time.perf_counter() - t0
        for p in self.params:
            p.grad = None
        self.count += 1
        if record:
            self.times.append(dt)
            for k, v in marks.items():
                self.parts[k].append(v / dt)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def share(self, mark: str) -> float:
        return statistics.median(self.parts[mark]) if self.parts.get(mark) else float("nan")


# ---- building the runners of one mode --------------------------------------------------------------


def build_mode(
    mode: str, args, tmp: Path, ar_runners: dict, variant: str = "fp32", length: int | None = None
) -> dict:
    """Runners of `mode` (its own, and block_diffusion's sc p=0/1 variants) + its AR baseline's key.

    `variant` is a `VARIANTS` key; `length` (the sweep) = one row of exactly that many tokens."""
    from dllmflow.diffusion.modes import build_mode_model
    from dllmflow.diffusion.strategies import build_strategy

    extra = dict(VARIANTS[variant])
    if length is not None:
        extra.update(
            {"dataset.seq_length": length, "train.local_batch_size": 1, "train.global_batch_size": 1}
        )
    settings = mode_settings(mode, args, tmp, **extra)
    tokenizer, batch = load_batch(settings) if length is None else long_batch(settings, length)
    if "vocab_size" in type(settings.dllm).model_fields and settings.dllm.vocab_size != len(tokenizer):
        extra["dllm.vocab_size"] = len(tokenizer)
        settings = mode_settings(mode, args, tmp, **extra)
    seed = settings.train.seed
    opt = args.optimizer

    def make(s, loss_wrapper=plain_loss):
        strategy = build_strategy(s)
        torch.manual_seed(seed)
        model = build_mode_model(s, tokenizer)
        strategy.setup(model, tokenizer, torch.device("cpu"))
        return strategy, Runner(model, strategy_loss(strategy, seed, loss_wrapper(strategy)), batch, s, opt)

    out: dict = {"settings": settings, "batch": batch}
    if mode == "dflash":
        from dllmflow.models.dflash_target import build_tiny_target

        tiny = settings.model.tiny
        if tiny is not None:  # size the target like the other modes' backbone (reused once written)
            build_tiny_target(
                tmp / "target", tokenizer, tiny.hidden_size, max(4, tiny.num_hidden_layers), seed=seed
            )
        strategy, out["runner"] = make(settings, dflash_split)
        ar_model, ar_fn, backbone = dflash_ar_target(strategy, tokenizer)
    elif mode == "block_diffusion":
        strategy, out["runner"] = make(settings)
        if variant == "fp32" and length is None:  # the sc cost split: main table only
            for p in (0.0, 1.0):
                s = mode_settings(
                    mode, args, tmp, **{"dllm.vocab_size": len(tokenizer), "dllm.self_conditioning_p": p}
                )
                out[f"sc{int(p)}"] = make(s)[1]
            out["mask_ms"] = block_diffusion_mask_time(strategy, out["runner"], batch)
        torch.manual_seed(seed)
        ar_model, ar_fn = build_mode_model(settings, tokenizer), gemma_encoder_ar_loss
        backbone = "DiffusionGemma encoder"
    else:
        from dllmflow.models.build import build_model

        strategy, out["runner"] = make(settings)
        torch.manual_seed(seed)
        ar_model, ar_fn = build_model(settings, tokenizer), ar_loss
        backbone = type(ar_model).__name__
    key = (backbone, ar_model.config.to_json_string(use_diff=False), batch_key(batch), variant)
    if key not in ar_runners:
        ar_runners[key] = Runner(ar_model, ar_fn, batch, settings, opt)
    out["ar_key"], out["backbone"] = key, backbone
    return out


def dflash_ar_target(strategy, tokenizer):
    """A trainable copy of the frozen target: AR fine-tuning of it is what the draft step replaces."""
    target = strategy.load_target(strategy.target_path(tokenizer), torch.device("cpu"))
    target.requires_grad_(True)
    return target, ar_loss, f"{type(target).__name__} (target)"


def block_diffusion_mask_time(strategy, runner, batch, repeats: int = 5) -> float:
    """Median seconds to build the encoder + decoder attention masks of one step (as `loss` does)."""
    from dllmflow.diffusion.masks.block_diffusion import build_decoder_masks, build_encoder_masks
    from dllmflow.diffusion.seeding import sample_seed

    b = dict(batch)
    B = b["input_ids"].shape[0]
    b.update(strategy.corrupt(b, [sample_seed(0, 0, i) for i in range(B)]))
    dtype = next(p.dtype for p in runner.model.parameters() if p.is_floating_point())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_decoder_masks(
            b["prefix_lengths"],
            b["response_lengths"],
            b["attention_mask"],
            b["canvas_ids"].shape[1],
            strategy.block_size,
            strategy.sliding_window,
            dtype,
        )
        build_encoder_masks(b["attention_mask"], strategy.sliding_window, dtype)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- main ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--steps", type=int, default=5, help="timed steps per runner (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=None, help="dataset.seq_length (default: the recipes')")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sweep", action="store_true", help="the fp32 ratio at --lengths, B=1, instead")
    p.add_argument("--lengths", nargs="+", type=int, default=SWEEP_LENGTHS)
    p.add_argument(
        "--optimizer", action=argparse.BooleanOptionalAction, default=True, help="time clip + AdamW step too"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="settings override, all modes"
    )
    args = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury the table

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp_dir:
        if args.sweep:
            rows = {}
            for length in args.lengths:
                ar_runners: dict = {}
                modes = {m: build_mode(m, args, Path(tmp_dir), ar_runners, length=length) for m in args.modes}
                interleave(list(ar_runners.values()) + [m["runner"] for m in modes.values()], args)
                rows[length] = {
                    m: (v["runner"].median, ar_runners[v["ar_key"]].median) for m, v in modes.items()
                }
                print(
                    f"L={length}: " + ", ".join(f"{m} {a / b:.2f}x" for m, (a, b) in rows[length].items()),
                    flush=True,
                )
            report_sweep(rows, args, time.perf_counter() - t_start)
            return
        ar_runners = {}
        tables = {
            v: {m: build_mode(m, args, Path(tmp_dir), ar_runners, variant=v) for m in args.modes}
            for v in args.variants
        }
        runners = list(ar_runners.values())
        for modes in tables.values():
            for m in modes.values():
                runners += [m[k] for k in ("runner", "sc0", "sc1") if k in m]
        interleave(runners, args)
    report(tables, ar_runners, args, time.perf_counter() - t_start)


def interleave(runners: list, args) -> None:
    """Step every runner in turn, so drift in machine load hits all of them alike."""
    for i in range(args.warmup + args.steps):
        for runner in runners:
            runner.step(record=i >= args.warmup)


def _setup_line(args, what: str) -> str:
    opt = "included (clip + AdamW)" if args.optimizer else "NOT included (forward + backward)"
    return (
        f"train step, {what}; median of {args.steps} timed steps after {args.warmup} warmup, interleaved; "
        f"optimizer step {opt}; torch threads {torch.get_num_threads()}"
    )


def report_sweep(rows: dict, args, elapsed: float) -> None:
    print(_setup_line(args, "length sweep, B=1, fp32"))
    print(f"{'mode / L':<16}" + "".join(f"{L:>14}" for L in rows))
    for mode in args.modes:
        cells = "".join(f"{rows[L][mode][0] / rows[L][mode][1]:>13.2f}x" for L in rows)
        goal = GOALS.get(mode)
        print(f"{mode:<16}{cells}" + ("" if goal is None else f"   goal <= {goal:.2f}"))
    print(
        f"{'AR ms':<16}"
        + "".join(f"{rows[L][args.modes[0]][1] * 1e3:>14.1f}" for L in rows)
        + f"   (AR baseline of {args.modes[0]})"
    )
    print(f"total wall time {elapsed:.0f} s")


def report(tables: dict, ar_runners: dict, args, elapsed: float) -> None:
    first = next(iter(tables.values()))
    B, L = next(iter(first.values()))["batch"]["input_ids"].shape
    print(_setup_line(args, f"B={B}, L={L} (per mode below)"))
    head = f"{'mode':<16}{'backbone (AR baseline)':<30}{'params':>9}{'B x L':>10}"
    head += "".join(f"{v + ' AR ms':>13}{v + ' ms':>10}{'x AR':>7}" for v in tables)
    print(head + f"{'goal (fp32)':>16}{'corrupt%':>10}")
    for mode, m in first.items():
        r = m["runner"]
        B, L = m["batch"]["input_ids"].shape
        line = f"{mode:<16}{m['backbone'][:29]:<30}{r.n_params / 1e3:>8.0f}k{f'{B}x{L}':>10}"
        for modes in tables.values():
            run, ar = modes[mode]["runner"], ar_runners[modes[mode]["ar_key"]]
            line += f"{ar.median * 1e3:>13.1f}{run.median * 1e3:>10.1f}{run.median / ar.median:>7.2f}"
        goal = GOALS.get(mode)
        ratio = r.median / ar_runners[m["ar_key"]].median
        goal_s = "" if goal is None else f"<={goal:.2f} " + ("met" if ratio <= goal else "missed")
        print(line + f"{goal_s:>16}{100 * r.share('corrupt'):>9.1f}%")
    modes = first
    ar_sizes = ", ".join(sorted({f"{k[0]} {v.n_params / 1e3:.0f}k" for k, v in ar_runners.items()}))
    print(f"(params = the trainable module of the mode; AR baselines: {ar_sizes})")
    if "dflash" in modes:
        r = modes["dflash"]["runner"]
        tgt, cor = r.share("target"), r.share("corrupt")
        print(
            f"dflash split: frozen target forward {100 * tgt:.1f}% | draft step (draft_loss + backward + "
            f"optimizer) {100 * (1 - tgt - cor):.1f}% | corrupt {100 * cor:.1f}% of {r.median * 1e3:.1f} ms"
        )
    if "sc0" in modes.get("block_diffusion", {}):
        m = modes["block_diffusion"]
        sc0, sc1 = m["sc0"].median, m["sc1"].median
        print(
            f"block_diffusion: self_conditioning_p 1 vs 0: {sc1 * 1e3:.1f} / {sc0 * 1e3:.1f} ms = {sc1 / sc0:.2f}x "
            f"(extra no-grad decoder pass); recipe p={m['settings'].dllm.self_conditioning_p}; "
            f"mask building {m['mask_ms'] * 1e3:.2f} ms = {100 * m['mask_ms'] / m['runner'].median:.1f}% of the step"
        )
    print(f"total wall time {elapsed:.0f} s")


if __name__ == "__main__":
    main()
