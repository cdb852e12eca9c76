"""Scratch probe for issue #25's proof goal: does GRPO (dllmflow.rl, docs/strategies.md §8) raise held-out
exact match on the bundled addition task by >= 0.15 within a wall budget, beside an SFT-only
continuation of the same wall time from the same start?

    OMP_NUM_THREADS=2 python bench/grpo_probe.py                              # defaults below
    python bench/grpo_probe.py --sft-steps 200 --rl-minutes 8 --group 8 --prompts 8 --lr 3e-4 \
        --kl-beta 0.01 --estimator coupled --temperature 1.0 --eval-limit 512
    python bench/grpo_probe.py --start RUN/checkpoints/step_000400/model/consolidated --prepared DATA  # a kept start

Single process, everything in-process, written only under a temp dir it creates (removed at the end
unless --keep): 1) prepare params/tiny_addition.yaml and train it for --sft-steps (the "briefly
supervised" start, its own cosine schedule), 2) held-out EM with the llada sampler (greedy, as
`dllmflow evaluate`), 3) a plain GRPO loop: per step --prompts train prompts x --group rollouts from the
llada sampler at --temperature, exact-match (+ --format-weight x format) rewards, group advantages, the
clipped loss with a k3 KL to the frozen start, --inner updates per batch on fresh estimator draws, until
--rl-minutes of wall time, 4) an SFT-only continuation from the same start (the recipe's lr, constant
after warmup) for the same wall time as 3), 5) held-out EM of both. Prints one JSON line per phase and a
summary; not a test (times depend on the machine's load: the 2 cores here are shared, so they are
pessimistic).

Measured 2026-12-02 (2 CPU cores shared with other jobs, load 4-9; held-out EM = llada greedy, flexible,
512 eval rows; start = step 600 of the recipe's own 1,200-step run, EM 0.334; G 8 x 8 prompts, T 1.0,
kl_beta 0.01, full fine-tuning). Brief runs with their own cosine schedule stay near 0 (150 steps: 0.010,
300 steps: 0.006): the task has a sharp transition (recipe run, 256 rows: step 500 0.023, 600 0.328,
700 0.723, 800 0.855), so a start in [0.2, 0.6] is a mid-run checkpoint.
    coupled eps 1e-3, lr 3e-4, 5 min (60 steps):   0.334 -> 0.508 (+0.174); SFT-only 5 min: 0.621
    coupled eps 1e-3, lr 1e-3:                     reward 0.19 -> 0.05, KL 1.07 at 3 min: stopped
    coupled eps 1e-3, lr 3e-4, T 0.7, 5 min:       0.334 -> 0.430 (+0.096)
    one_step, lr 3e-4, 5 min (112 steps):          0.334 -> 0.492 (+0.158)
    coupled eps 1e-3, lr 3e-4, 10 min (704 steps): 0.334 -> 0.000: KL spikes 6-12 (grad norm 52) from the
                                                   1/t weights, then every group all-zero; SFT-only
                                                   10 min (machine quiet, 14,318 steps): 1.000
  then, the machine quiet, two runs side by side (1 thread each), 5 min:
    one_step, lr 3e-4 (885 steps):                 0.334 -> 0.631 (+0.297), max step KL 17
    coupled eps 0.2, lr 3e-4 (700 steps):          0.334 -> 0.496 (+0.162), max step KL 342 (grad norm 1126)
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "params" / "tiny_addition.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--rl-minutes", type=float, default=8.0)
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt (G)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--kl-beta", type=float, default=0.01)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--estimator", default="coupled")
    p.add_argument("--estimator-params", default="{}", help='JSON, e.g. {"num_masks": 2}')
    p.add_argument("--inner", type=int, default=1, help="updates per rollout batch (fresh draws each)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--format-weight", type=float, default=0.0)
    p.add_argument("--eval-limit", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-sft-baseline", action="store_true", help="skip the SFT-only continuation")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--start", help="start from this consolidated export instead of a brief SFT run")
    p.add_argument("--prepared", help="with --start: the prepared tiny_addition data dir")
    return p.parse_args()


def log(phase: str, **fields) -> None:
    print(json.dumps({"phase": phase, **fields}), flush=True)


# ---- 1) the briefly supervised start ------------------------------------------------------------


def brief_sft(tmp: Path, steps: int, seed: int):
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import run_training

    prepared = tmp / "prepared"
    settings = load_settings(
        RECIPE,
        dataset={"prepared_dir": str(prepared)},
        train={"max_steps": steps, "seed": seed, "log_every": max(steps // 4, 1)},
        checkpoint={"every_steps": steps, "save_consolidated": "final"},
    )
    prepare(settings)
    t0 = time.perf_counter()
    result = run_training(settings, run_dir=tmp / "sft")
    log("sft", steps=steps, seconds=round(time.perf_counter() - t0, 1), final_loss=result.losses[-1])
    return settings, Path(result.consolidated_dir)


# ---- 2) held-out exact match --------------------------------------------------------------------


def held_out_em(model, tokenizer, settings, limit: int) -> dict:
    from dllmflow.evaluation.accuracy import evaluate_loaded
    from dllmflow.evaluation.protocol import EvalRunner, build_runner

    model.eval()
    loaded = EvalRunner(
        model, tokenizer, build_runner(model, tokenizer, settings, "llada", None), settings, "llada"
    )
    t0 = time.perf_counter()
    m = evaluate_loaded(loaded, "in-memory", limit=limit)["metrics"]
    return {"em_flexible": m["exact_match_flexible"], "em_strict": m["exact_match_strict"],
            "n": m["num_examples"], "eval_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


# ---- 3) GRPO ------------------------------------------------------------------------------------


def completions(
    seqs: list[list[int]], gen_length: int, eos_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler returns each window cut before its first stop id: put the EOS back (it is part of
    what the policy chose) and right-pad to the window. -> ids [B, gen_length], mask [B, gen_length]."""
    ids = torch.full((len(seqs), gen_length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), gen_length)
    for b, s in enumerate(seqs):
        row = s + [eos_id] if len(s) < gen_length else s
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = 1
    return ids, mask


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    return ids, mask


def grpo(model, tokenizer, settings, args, budget_s: float) -> dict:
    from dllmflow.data.dataset import PreparedDataset
    from dllmflow.evaluation.protocol import build_runner, prompt_messages
    from dllmflow.inference.generate import decode_response
    from dllmflow.rl.estimators import build_estimator
    from dllmflow.rl.objective import group_advantages, grpo_loss
    from dllmflow.rl.rewards import build_rewards, score

    rows = PreparedDataset(settings.dataset.prepared_dir, "train").rows(None)
    rng = random.Random(args.seed)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    estimator = build_estimator(args.estimator, **json.loads(args.estimator_params))
    names, weights = ["exact_match"], [1.0]
    if args.format_weight:
        names, weights = names + ["format"], weights + [args.format_weight]
    rewards = build_rewards(names, weights, import_user=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    mask_id, eos_id = model.config.mask_token_id, tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    G, t0, step, history = args.group, time.perf_counter(), 0, []
    while time.perf_counter() - t0 < budget_s:
        # a) rollouts: G samples per prompt at temperature > 0, a fresh sampler seed per step
        batch = rng.sample(rows, args.prompts)
        chats = [prompt_messages(r["messages"]) for r in batch]
        prompt_ids = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False))
                      for c in chats]  # fmt: skip
        prompt_ids = [p for p in prompt_ids for _ in range(G)]
        model.eval()
        sampler = build_runner(
            model,
            tokenizer,
            settings,
            "llada",
            {"temperature": args.temperature, "seed": args.seed * 100003 + step},
        )
        t_roll = time.perf_counter()
        seqs = sampler.generate(prompt_ids).sequences
        t_roll = time.perf_counter() - t_roll
        texts = [decode_response(tokenizer, s) for s in seqs]
        answers = [r["messages"][-1]["content"] for r in batch for _ in range(G)]
        questions = [c[-1]["content"] for c in chats for _ in range(G)]
        scored = score(rewards, questions, texts, answers)
        adv = group_advantages(scored.values, G)  # [N*G]
        # b) the estimator's inputs
        p_ids, p_mask = left_pad(prompt_ids, pad_id)
        c_ids, c_mask = completions(seqs, sampler.config.max_new_tokens, eos_id, pad_id)
        keep = adv != 0  # rows of all-equal groups carry only the KL term: skip them (cheaper)
        if not keep.any():
            history.append({"step": step, "reward": scored.values.mean().item(), "skipped": True})
            if step % 10 == 0:  # a collapsed policy (every group all 0) shows up here
                log("rl_step", elapsed_s=round(time.perf_counter() - t0, 1), **history[-1])
            step += 1
            continue
        p_ids, p_mask, c_ids, c_mask, a = p_ids[keep], p_mask[keep], c_ids[keep], c_mask[keep], adv[keep]
        gens = [torch.Generator().manual_seed(args.seed * 7919 + step * 131 + k) for k in range(args.inner)]
        draws = [estimator.draw(p_ids, c_ids, c_mask, mask_id, g, prompt_mask=p_mask) for g in gens]
        with torch.no_grad():
            refs = [estimator.token_logp(ref, d) for d in draws]
            olds = [estimator.token_logp(model, d) for d in draws] if args.inner > 1 else None
        # c) updates
        model.train()
        stats = {}
        for k, d in enumerate(draws):
            logp = estimator.token_logp(model, d)
            old = olds[k] if olds is not None else logp.detach()
            out = grpo_loss(logp, old, refs[k], a, c_mask, clip_eps=args.clip_eps, kl_beta=args.kl_beta)
            loss = out.loss_sum / out.num_tokens.clamp_min(1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats = {"loss": loss.item(), "kl": (out.kl_sum / out.num_tokens).item(),
                     "clip_frac": (out.clipped_tokens / out.num_tokens).item(), "grad_norm": norm.item()}  # fmt: skip
        history.append({"step": step, "reward": scored.values.mean().item(), "rows": int(keep.sum()),
                        "rollout_s": round(t_roll, 2), **stats})  # fmt: skip
        if step % 10 == 0:
            log("rl_step", elapsed_s=round(time.perf_counter() - t0, 1), **history[-1])
        step += 1
    model.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1),
            "reward_first10": sum(h["reward"] for h in history[:10]) / max(len(history[:10]), 1),
            "reward_last10": sum(h["reward"] for h in history[-10:]) / max(len(history[-10:]), 1)}  # fmt: skip


# ---- 4) the SFT-only continuation ---------------------------------------------------------------


class _Stop(Exception):
    pass


def sft_continuation(tmp: Path, settings, start: Path, budget_s: float, seed: int):
    from dllmflow.settings import load_settings
    from dllmflow.training.trainer import TrainerHook, run_training

    out_dir = tmp / "sft_only_weights"

    class StopAt(TrainerHook):
        def __init__(self):
            self.t0, self.steps = time.perf_counter(), 0

        def after_step(self, trainer, step):
            self.steps = step
            if time.perf_counter() - self.t0 >= budget_s:
                from dllmflow.models.wrappers import unwrap

                unwrap(trainer.model).save_pretrained(out_dir)
                trainer.tokenizer.save_pretrained(out_dir)
                raise _Stop

    cont = load_settings(
        RECIPE,
        model={"pretrained_model_name_or_path": str(start), "tiny": None},
        dataset={"prepared_dir": settings.dataset.prepared_dir},
        train={"max_steps": 100_000, "seed": seed + 1, "lr_schedule": "constant", "log_every": 100},
        checkpoint={"every_steps": 100_000, "save_consolidated": "false"},
        eval={"untrained_baseline": False},
    )
    hook = StopAt()
    try:
        run_training(cont, run_dir=tmp / "sft_only", hooks=[hook])
    except _Stop:
        pass
    log("sft_only", steps=hook.steps, seconds=round(time.perf_counter() - hook.t0, 1))
    return out_dir


def main() -> int:
    from dllmflow.inference.generate import load_for_generation

    args = parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="grpo_probe_"))
    try:
        if args.start:
            from dllmflow.settings import load_settings

            settings, start = load_settings(RECIPE, dataset={"prepared_dir": args.prepared}), Path(args.start)
        else:
            settings, start = brief_sft(tmp, args.sft_steps, args.seed)
        model, tok, _ = load_for_generation(start, device="cpu")
        before = held_out_em(model, tok, settings, args.eval_limit)
        log("eval_start", **before)
        budget = args.rl_minutes * 60
        rl = grpo(model, tok, settings, args, budget)
        log("rl", **rl)
        after = held_out_em(model, tok, settings, args.eval_limit)
        log("eval_rl", **after)
        summary = {"em_start": before["em_flexible"], "em_rl": after["em_flexible"], "rl_s": rl["seconds"],
                   "rl_steps": rl["steps"], "args": vars(args)}  # fmt: skip
        if not args.skip_sft_baseline:
            weights = sft_continuation(tmp, settings, start, rl["seconds"], args.seed)
            sft_model, _, _ = load_for_generation(weights, device="cpu")
            sft = held_out_em(sft_model, tok, settings, args.eval_limit)
            log("eval_sft_only", **sft)
            summary["em_sft_only"] = sft["em_flexible"]
        log("summary", **summary)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
