"""Sampler speed, every figure a ratio against a baseline measured in the same run. Three tables:

1. `llada` one token per step, no cache (the base), against the prefix and dual caches, threshold 0.9
   and dual + threshold 0.9, in blocks of `--cache_block` (through `dllmflow evaluate`: exact match too;
   `--em_only` runs this table alone);
2. every sampler on the same prompts and the same checkpoint: tokens/s, NFE (forwards per prompt) and
   tokens per forward, against llada one-token-per-step (presets, scaled to `--max_new_tokens`;
   gemma runs a random tiny DiffusionGemma on the same token ids: a different network);
4. the samplers' caches on the random Qwen3 at `--kv_new_tokens`, blocks of `--cache_block`: llada
   with no cache (one token per step, the base), `cache` prefix, dual, dual + threshold; llada2 and
   idlm with and without their exact KV cache (identical tokens asserted). `--cache_only` runs this
   table alone, on a random Qwen3 with a sharpened LM head (no checkpoint, no training);
3. nemotron with and without the KV cache at `--kv_new_tokens` (256) new tokens, greedy, causal
   context on in both: tokens/s ratio and whether the outputs are identical token for token; on the
   checkpoint, and on a random Qwen3 of `--kv_hidden` x `--kv_layers` (no EOS stop: the whole window
   is decoded, and the forward's arithmetic outweighs its Python overhead).
5. stopping at EOS (`--eos_only`, through `dllmflow evaluate`): llada at `--max_new_tokens` in blocks of
   `--cache_block` and in one block, without a stop (the base), with the exact per-row EOS stop, and
   with EoTP truncation (`eos_truncate`): positions computed per answer, effective-token ratio,
   seconds per answer and NFE as ratios to the base, exact match, and the share of answers identical
   to the run without truncation (the stop is exact: 1.0 asserted; truncation is approximate).

    OMP_NUM_THREADS=1 python bench/sample.py                       # trains a tiny overfit checkpoint (~30 s)
    OMP_NUM_THREADS=1 python bench/sample.py --cache_only          # table 4 only
    OMP_NUM_THREADS=2 python bench/sample.py --long_demo --max_new_tokens 256 --cache_block 16 --limit 64 --em_only
    OMP_NUM_THREADS=2 python bench/sample.py --long_demo --max_new_tokens 256 --limit 32 --eos_only   # table 5
    python bench/sample.py --checkpoint runs/tiny_mdlm/checkpoints --split eval --limit 32

Without `--checkpoint` a tiny mdlm model is trained in-process on 16 short GSM-style chats and scored
on those same chats (exact match is only meaningful where the model learned something). `--long_demo`
trains the demo instead (1,200 steps), continues it on canvases of `--max_new_tokens` + 16 with the
padding supervised, and scores held-out problems: the fast-decoding issue's exact-match clause at 256
new tokens, in minutes (a SmolLM2 dLLM continued the same way: params/smollm2_mdlm_lora.yaml's header).
Does not assert.

Measured 2026-12-03 (table 1, --long_demo's model: 600 steps on 272-token canvases, 64 held-out
problems, 256 new tokens, 2 quiet Intel Xeon cores, OMP_NUM_THREADS=2), ratios to one token per step:
    blocks of 16: none EM 0.609 (12.9 tok/s); prefix 1.95x, dual 7.10x, threshold 0.9 12.7x,
                  dual + threshold 0.9 16.0x: every point 0.609 (39 of 64)
    blocks of 32: none EM 0.562 (13.3 tok/s); prefix 1.77x at 0.562, threshold 0.9 18.1x at 0.562,
                  dual 5.77x at 0.359, dual + threshold 0.9 25.5x at 0.375: with 8 blocks the suffix's
                  cached keys go stale over 32 positions and this 2-layer model loses 19 points
The same continuation with the padding hidden from attention (the code before 417a41f): EM 0.000 at
every point, every answer empty.

Table 5, measured 2026-12-04 on a loaded machine (load ~13 on 2 cores; ratios only): the demo continued
for only 100 steps on 272-token canvases (--long_demo_from, --long_demo_steps 100), 32 held-out
problems, 256 new tokens: EM 0.000 and empty answers at every point; no row committed its EOS with
nothing masked before it, so the exact stop and truncation computed as many positions as the base
(1.00x, answers identical 1.000), and threshold 0.9 + stop + truncate 0.04x positions, 0.04x NFE. The
600-step continuation (the figures above) is the one to measure the stop on. On the 30-step overfit
model (train split, 4 prompts, 32 new tokens, blocks of 8) the stop halved positions and NFE (0.50x)
at identical answers, truncation 0.46x positions (answers identical 0 of 4: an untrained model).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("tokens_per_s", "nfe", "tokens_per_forward", "exact_match_strict", "exact_match_flexible")
SPEED_KEYS = ("tokens_per_s", "nfe", "tokens_per_forward")


def train_overfit_checkpoint(root: Path, steps: int) -> Path:
    from dllmflow.data.prepare import prepare
    from dllmflow.data.toy import overfit_settings
    from dllmflow.training.trainer import run_training

    settings = overfit_settings(root, steps, ROOT / "params" / "tiny_mdlm.yaml")
    prepare(settings)
    run_training(settings, settings.run_dir)
    return root / "run" / "checkpoints"


def train_long_canvas_demo(
    root: Path, new_tokens: int, steps: int, long_steps: int, short_run: str | None = None
) -> Path:
    """The demo (params/tiny_addition.yaml, `steps` steps on its ~19-token rows), then `long_steps` more
    on canvases of `new_tokens` + 16 tokens with the padding supervised ("#### 085<eos><pad>..."), so
    that it answers with `new_tokens` masks after the prompt -> the second run's dir. A model trained only
    on short rows has never seen a long masked tail (docs/strategies.md §1.3). `short_run`: a demo run
    dir already trained (its `short/run`), continued instead of training one."""
    from dllmflow.data.prepare import prepare
    from dllmflow.runs import resolve_checkpoint
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    recipe = ROOT / "params" / "tiny_addition.yaml"
    short = load_settings(
        recipe, dataset={"prepared_dir": str(root / "short" / "prepared")}, train={"max_steps": steps},
        checkpoint={"every_steps": steps}, run_dir=str(root / "short" / "run"),
    )  # fmt: skip
    if short_run is None:
        prepare(short)
        run_training(short, root / "short" / "run")
    export = str(resolve_checkpoint(short_run or root / "short" / "run"))
    canvas = new_tokens + 16  # the prompts are ~12 tokens
    long = load_settings(
        recipe, model={"tiny": None, "pretrained_model_name_or_path": export}, tokenizer={"name_or_path": export},
        dataset={"prepared_dir": str(root / "long" / "prepared"), "seq_length": canvas},
        dllm={"supervise_padding": True, "pad_seq_len_divisible": canvas},
        train={"max_steps": long_steps, "lr": 1.0e-3}, checkpoint={"every_steps": long_steps},
        run_dir=str(root / "long" / "run"),
    )  # fmt: skip
    prepare(long)
    run_training(long, root / "long" / "run")
    return root / "long" / "run"


def bench_prompts(ckpt, split: str, limit: int):
    """(model, tokenizer, chat-templated prompt ids) of the checkpoint's prepared data, as evaluate builds them."""
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.data.task import prompt_messages
    from dllmflow.inference.generate import load_for_generation

    model, tok, settings = load_for_generation(ckpt, device="cpu")
    rows = PreparedDataset(settings.dataset.prepared_dir, split).rows(limit)
    prompts = [list(tok.apply_chat_template(prompt_messages(r["messages"]), add_generation_prompt=True,
                                            return_dict=False)) for r in rows]  # fmt: skip
    return model, tok, prompts


def run_sampler(model, tok, name: str, overrides: dict, prompts: list[list[int]]) -> dict:
    """One warm-up prompt, then every prompt (batched where the sampler batches)."""
    from dllmflow.diffusion.samplers import SAMPLERS
    from dllmflow.diffusion.samplers.base import build_sampler_config

    cfg = build_sampler_config(name, overrides, tok)
    if overrides.get("eos_token_id", "") is None:
        cfg = cfg.model_copy(update={"eos_token_id": None})
    sampler = SAMPLERS[name](model, tok, cfg, mask_id=getattr(model.config, "mask_token_id", None))
    sampler.generate(prompts[:1])
    r = sampler.generate(prompts)
    forwards = sum(r.row_nfe) if r.row_nfe else r.nfe * len(prompts)
    return {
        "tokens_per_s": r.num_generated_tokens / max(r.elapsed_s, 1e-9),
        "nfe": forwards / len(prompts),
        "tokens_per_forward": r.num_generated_tokens / max(forwards, 1),
        "sequences": r.sequences,
        "elapsed_s": r.elapsed_s,
    }


def print_table(title: str, results: dict[str, dict], baseline: str, keys=SPEED_KEYS) -> None:
    print(
        f"\n{title}\n{'':<24}" + "".join(f"{k:>22}" for k in keys) + "".join(f"{'x ' + k:>24}" for k in keys)
    )
    base = results[baseline]
    for name, res in results.items():
        if "error" in res:
            print(f"{name:<24}  skipped: {res['error']}")
            continue
        ratios = [res[k] / base[k] if base[k] else float("nan") for k in keys]
        print(
            f"{name:<24}"
            + "".join(f"{res[k]:>22.3f}" for k in keys)
            + "".join(f"{r:>23.2f}x" for r in ratios)
        )


def gemma_model(tok):
    """A random tiny DiffusionGemma over the same vocabulary (the bench has no trained one)."""
    from dllmflow.models.diffusion_gemma import build_tiny_diffusion_gemma
    from dllmflow.settings import load_settings

    return build_tiny_diffusion_gemma(
        load_settings(ROOT / "params" / "tiny_block_diffusion.yaml"), tok
    ).eval()


def every_sampler(model, tok, prompts, n: int) -> dict[str, dict]:
    """Presets scaled to n new tokens (steps = n where the preset has steps = max_new_tokens)."""
    runs = {
        "llada one/step (base)": ("llada", {"steps": n, "block_size": n}),
        "llada thr 0.9": ("llada", {"steps": n, "block_size": n, "threshold": 0.9}),
        "scdd": ("scdd", {"steps": n}),
        "llada2": ("llada2", {"block_size": min(32, n)}),
        "nemotron (kv cache)": ("nemotron", {"steps": n}),
        "nemotron (no cache)": ("nemotron", {"steps": n, "cache": "none"}),
        "idlm": ("idlm", {"steps": n}),
        "gemma (random tiny)": ("gemma", {"steps": 8}),
    }
    out = {}
    for label, (name, over) in runs.items():
        try:
            m = gemma_model(tok) if name == "gemma" else model
            out[label] = run_sampler(m, tok, name, {"max_new_tokens": n, **over}, prompts)
        except Exception as e:  # a sampler that cannot run here is reported, not fatal
            out[label] = {"error": f"{type(e).__name__}: {e}"}
    return out


def kv_cache_runs(model, tok, prompts, n: int, eos: bool) -> dict[str, dict]:
    common = {"max_new_tokens": n, "steps": n, "temperature": 0.0, "causal_context": True}
    if not eos:
        common["eos_token_id"] = None
    return {
        "no cache (base)": run_sampler(model, tok, "nemotron", {**common, "cache": "none"}, prompts),
        "kv cache": run_sampler(model, tok, "nemotron", {**common, "cache": "exact"}, prompts),
    }


def random_qwen3(tok, hidden: int, layers: int, mask_id: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(hidden // 64, 1)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=hidden // heads, intermediate_size=3 * hidden,
                      mask_token_id=mask_id)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def cache_runs(model, tok, prompts, n: int, block: int, threshold: float) -> dict[str, dict]:
    """Table 4: the samplers' caches at n new tokens in blocks of `block`, greedy, no EOS stop."""
    common = {"max_new_tokens": n, "block_size": block, "temperature": 0.0, "eos_token_id": None}
    llada = {**common, "steps": n}  # one token per step
    runs = {
        "llada none (base)": ("llada", {**llada, "cache": "none"}),
        "llada prefix": ("llada", {**llada, "cache": "prefix"}),
        "llada dual": ("llada", {**llada, "cache": "dual"}),
        f"llada dual thr {threshold}": ("llada", {**llada, "cache": "dual", "threshold": threshold}),
        f"llada none thr {threshold}": ("llada", {**llada, "threshold": threshold}),
        "llada2 no cache": ("llada2", {**common, "cache": "none"}),
        "llada2 kv cache": ("llada2", {**common, "cache": "exact"}),
        "idlm no cache": ("idlm", {**common, "steps": n, "cache": "none"}),
        "idlm kv cache": ("idlm", {**common, "steps": n, "cache": "exact"}),
    }
    return {label: run_sampler(model, tok, name, over, prompts) for label, (name, over) in runs.items()}


def print_cache_tables(res: dict[str, dict], title: str) -> None:
    print_table(f"llada caches, {title} (base: no cache, one token per step)",
                {k: v for k, v in res.items() if k.startswith("llada ")}, "llada none (base)")  # fmt: skip
    for name in ("llada2", "idlm"):
        pair = {k: res[k] for k in (f"{name} no cache", f"{name} kv cache")}
        same = pair[f"{name} kv cache"]["sequences"] == pair[f"{name} no cache"]["sequences"]
        assert same, f"{name}: the exact KV cache changed the tokens"
        print_table(f"{name} exact KV cache, {title} -- outputs identical: {same}", pair, f"{name} no cache")


def cache_only(args) -> None:
    """Table 4 alone, on a random Qwen3 over a small in-process tokenizer (no checkpoint, no training).
    `--cache_sharpen` scales its LM head: a random model is never confident, so without it a threshold
    would commit one token per step."""
    import torch

    from dllmflow.data.tokenizer import train_bpe_tokenizer

    texts = [
        "Natalia sold 48 clips in April and half as many in May. #### 72",
        "What is 2 + 3? The answer is 5.",
    ]
    tok = train_bpe_tokenizer(texts * 5, 300, "<mask>", "<pad>", "<eos>")
    prompts = [tok.encode(t) for t in (texts * 4)[: args.kv_limit]]
    big = random_qwen3(tok, args.kv_hidden, args.kv_layers, tok.mask_token_id)
    with torch.no_grad():
        big.lm_head.weight.mul_(args.cache_sharpen)
    res = cache_runs(big, tok, prompts, args.kv_new_tokens, args.cache_block, args.threshold)
    print_cache_tables(res, f"random Qwen3 {args.kv_hidden}x{args.kv_layers} (lm_head x{args.cache_sharpen}), "
                            f"{len(prompts)} prompts, {args.kv_new_tokens} new tokens, blocks of {args.cache_block}")  # fmt: skip


def print_em_table(ckpt, split: str, results: dict[str, dict], args, block: int) -> None:
    """Table 1: each llada point's exact match and speed, and its ratios to one token per step."""
    examples = results["one_per_step"]["num_examples"]
    title = (
        f"llada on {ckpt} ({split}, {examples} prompts, {args.max_new_tokens} new tokens, blocks of {block})"
    )
    print_table(title, results, "one_per_step", KEYS)


EOS_KEYS = ("positions_per_answer", "effective_token_ratio", "s_per_answer", "nfe", "exact_match_flexible")


def eos_runs(ckpt, split: str, limit: int, n: int, block: int) -> tuple[dict, dict]:
    """Table 5: llada with and without the EOS stop and EoTP truncation at n new tokens, in blocks of
    `block` and in one block. -> (metrics by label, answers by label)."""
    from dllmflow.evaluation.accuracy import evaluate

    stop, cut = {"eos_token_id": "tokenizer"}, {"eos_token_id": "tokenizer", "eos_truncate": True}
    runs = {}
    for b in dict.fromkeys((block, n)):
        base = {"max_new_tokens": n, "steps": n, "block_size": b, "cache": "none"}  # one token per step
        runs |= {f"blocks {b}: no stop (base)": base, f"blocks {b}: EOS stop": {**base, **stop},
                 f"blocks {b}: EOS stop + eos_truncate": {**base, **cut}}  # fmt: skip
    runs |= {f"blocks {block}: thr 0.9 + stop + truncate": {**runs[f"blocks {block}: no stop (base)"],
                                                            **cut, "threshold": 0.9}}  # fmt: skip
    evaluate(ckpt, split=split, limit=2, overrides=runs[f"blocks {block}: EOS stop"])  # warm-up
    metrics, answers = {}, {}
    for label, over in runs.items():
        res = evaluate(ckpt, split=split, limit=limit, overrides=over)
        m, preds = res["metrics"], res["predictions"]
        elapsed = sum(p["num_tokens"] for p in preds) / max(m["tokens_per_s"], 1e-9)
        metrics[label] = {**m, "s_per_answer": elapsed / len(preds)}
        answers[label] = [p["prediction"] for p in preds]
    return metrics, answers


def print_eos_table(metrics: dict, answers: dict, title: str) -> None:
    """Table 5, one part per block size: ratios to its no-stop base, and each run's agreement with the
    exact (stopped, untruncated) answers."""
    for prefix in dict.fromkeys(label.split(":")[0] for label in metrics):
        part = {k: v for k, v in metrics.items() if k.startswith(prefix + ":")}
        base = f"{prefix}: no stop (base)"
        exact = answers[f"{prefix}: EOS stop"]
        assert exact == answers[base], f"{prefix}: the EOS stop changed an answer"
        print_table(f"{title}, {prefix} (base: no EOS stop)", part, base, EOS_KEYS)
        for label in part:
            same = sum(a == b for a, b in zip(answers[label], exact)) / len(exact)
            print(f"    {label:<44} answers identical to the exact run: {same:.3f}")


def main() -> None:
    from dllmflow.evaluation.accuracy import evaluate

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="default: train a tiny overfit checkpoint first")
    p.add_argument("--split", help="default: train for the built checkpoint, eval otherwise")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--train_steps", type=int, default=300)
    p.add_argument("--kv_new_tokens", type=int, default=256)
    p.add_argument("--kv_limit", type=int, default=4, help="prompts for the KV-cache table")
    p.add_argument("--kv_hidden", type=int, default=256)
    p.add_argument("--kv_layers", type=int, default=4)
    p.add_argument("--cache_block", type=int, default=32, help="block size of the cache table")
    p.add_argument("--cache_sharpen", type=float, default=100.0, help="LM-head scale of the cache-only model")
    p.add_argument("--cache_only", action="store_true", help="only table 4, on a random Qwen3")
    p.add_argument("--em_only", action="store_true", help="only table 1 (exact match and speed per point)")
    p.add_argument("--eos_only", action="store_true", help="only table 5 (stopping at EOS, EoTP truncation)")
    p.add_argument(
        "--long_demo", action="store_true",
        help="instead of --checkpoint: the demo trained, then continued on --max_new_tokens canvases",
    )  # fmt: skip
    p.add_argument("--long_demo_steps", type=int, default=600, help="--long_demo: steps on the long canvases")
    p.add_argument(
        "--long_demo_from", help="--long_demo: continue this trained demo run dir (skips its 1,200 steps)"
    )
    args = p.parse_args()
    if args.cache_only:
        return cache_only(args)

    with tempfile.TemporaryDirectory() as tmp:
        if args.long_demo:
            ckpt = train_long_canvas_demo(
                Path(tmp), args.max_new_tokens, 1200, args.long_demo_steps, args.long_demo_from
            )
        else:
            ckpt = args.checkpoint or train_overfit_checkpoint(Path(tmp), args.train_steps)
        split = args.split or ("eval" if args.checkpoint or args.long_demo else "train")
        n, thr = args.max_new_tokens, args.threshold
        block = args.cache_block if n % args.cache_block == 0 else n
        if args.eos_only:
            metrics, answers = eos_runs(ckpt, split, args.limit, n, block)
            return print_eos_table(
                metrics, answers, f"llada on {ckpt} ({split}, {args.limit} prompts, {n} new tokens)"
            )
        base = {"max_new_tokens": n, "steps": n, "block_size": block}  # one token per step, no cache
        runs = {"one_per_step": base, "prefix": {**base, "cache": "prefix"}, "dual": {**base, "cache": "dual"},
                f"threshold_{thr}": {**base, "threshold": thr},
                f"dual+threshold_{thr}": {**base, "cache": "dual", "threshold": thr}}  # fmt: skip
        evaluate(ckpt, split=split, limit=2, overrides=base)  # warm-up (allocator, first forwards)
        results = {
            name: evaluate(ckpt, split=split, limit=args.limit, overrides=o)["metrics"]
            for name, o in runs.items()
        }
        if args.em_only:
            return print_em_table(ckpt, split, results, args, block)
        model, tok, prompts = bench_prompts(ckpt, split, args.limit)
        samplers = every_sampler(model, tok, prompts, args.max_new_tokens)
        kv_prompts = prompts[: args.kv_limit]
        kv_ckpt = kv_cache_runs(model, tok, kv_prompts, args.kv_new_tokens, eos=True)
        big = random_qwen3(tok, args.kv_hidden, args.kv_layers, model.config.mask_token_id)
        kv_big = kv_cache_runs(big, tok, kv_prompts, args.kv_new_tokens, eos=False)
        caches = cache_runs(big, tok, kv_prompts, args.kv_new_tokens, args.cache_block, args.threshold)

    print_em_table(ckpt, split, results, args, block)
    print_table(f"every sampler, {len(prompts)} prompts, {args.max_new_tokens} new tokens (base: llada one token/step)",
                samplers, "llada one/step (base)")  # fmt: skip
    for label, kv in (
        (f"checkpoint {ckpt}", kv_ckpt),
        (f"random Qwen3 {args.kv_hidden}x{args.kv_layers}", kv_big),
    ):
        same = kv["kv cache"]["sequences"] == kv["no cache (base)"]["sequences"]
        print_table(f"nemotron KV cache, {label}, {len(kv_prompts)} prompts, {args.kv_new_tokens} new tokens "
                    f"-- outputs identical: {same}", kv, "no cache (base)")  # fmt: skip
    print_cache_tables(caches, f"random Qwen3 {args.kv_hidden}x{args.kv_layers}, {len(kv_prompts)} prompts, "
                               f"{args.kv_new_tokens} new tokens, blocks of {args.cache_block}")  # fmt: skip


if __name__ == "__main__":
    main()
