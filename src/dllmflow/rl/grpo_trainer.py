"""GRPO on the supervised Trainer: rollouts with the project's samplers, rewards, group advantages, clipped
policy updates with a KL penalty to the frozen starting model. Checkpoints, resume, logging and the
export are the Trainer's and the Checkpointer's, unchanged.

    from dllmflow.rl.grpo_trainer import run_grpo
    result = run_grpo(settings, "runs/tiny_addition_grpo")     # in-process: one rank
    result = GRPOTrainer(settings, "runs/x", rewards=[my_reward, "format"]).run()   # rewards in code
    # one process per rank:  torchrun --nproc_per_node 2 -m dllmflow.rl --run-dir RUN   # settings: $DLLMFLOW_SETTINGS

`settings.model.pretrained_model_name_or_path` is the starting model (`dllmflow rl` resolves
`rl.init_from` to its export); `build` loads it as the policy (LoRA or full, DDP/FSDP2, as training
does); the KL reference is, with LoRA, the policy with its adapters disabled (peft's switch: no second
model in memory), and for a full fine-tune the starting model loaded once more, frozen. Per step (`train_step`):

  1) this rank's prompts: global stream positions step*N .. step*N+N-1, round robin over ranks;
  2) per prompt, G rollouts decoded as one batch, seeded by the prompt's position (rollout.py);
  3) rewards (`rl.rewards`); a reward that failed on any rank skips the step (no update, counted in
     `reward_failures`); past `rl.max_reward_failures` the run stops naming the prompt and the error,
     before any checkpoint or export of that step;
  4) group-normalised advantages (`group_advantages`; an all-equal group gives 0);
  5) the estimator's noise per group, seeded by its position (the same draws score the policy, the
     policy that sampled (old) and the reference), then `rl.num_iterations` AdamW updates of
     Σ grpo_loss / (global scored-token count) over ranks, as the SFT step normalises (design
     principle 4); the LR scheduler steps once per GRPO step.

Logged per step (metrics.jsonl, console, live MLflow as `train/<key>`): loss, reward_mean, reward_std,
kl (of the rollout policy to the reference, before this step's updates: 0 at step 1), clip_frac,
ratio_mean, entropy (policy entropy at the positions the estimator masks), rollout_tok_s, nfe (forwards
per group), advantage_abs_mean, advantage_group_mean_max (~0: groups are centred), grad_norm, lr; every `rl.eval_every` steps heldout_em (greedy, `rl.eval_limit` prompts of
the eval split, the evaluation's answer parser).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dllmflow.errors import UserError
from dllmflow.models.lora import adapters_disabled, has_lora
from dllmflow.models.wrappers import unwrap
from dllmflow.rl.prompts import PromptSet
from dllmflow.rl.rollout import (
    build_rollout_sampler,
    decode_group,
    draw_seed,
    masked_entropy,
    rollout_seed,
)
from dllmflow.training.step import backward_each, reduce_sums
from dllmflow.training.trainer import Trainer, TrainerHook, TrainResult

if TYPE_CHECKING:
    from dllmflow.rl.rewards import RewardFn


class RewardFailureError(UserError):
    """Rewards failed on more steps than `rl.max_reward_failures` allows (the message names the prompt)."""


def run_grpo(
    settings,
    run_dir: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    hooks: Sequence[TrainerHook] = (),
    import_user: bool = True,
    rewards: Sequence[str | RewardFn] | None = None,
) -> TrainResult:
    return GRPOTrainer(
        settings, run_dir, resume=resume, overwrite=overwrite, hooks=hooks, import_user=import_user,
        rewards=rewards,
    ).run()  # fmt: skip


class GRPOTrainer(Trainer):
    """A Trainer whose step is a GRPO step. `import_user`: import the user rewards the settings name
    (the caller's own recipe; never a recorded settings.json of someone else). `rewards`: in place of
    `rl.rewards`, names and/or callables `fn(prompt, completion, answer) -> float` passed in code
    (weighted by `rl.reward_weights`; settings.json still records `rl.rewards`, so a resume passes
    them again)."""

    def __init__(
        self,
        settings,
        run_dir=None,
        *,
        import_user: bool = True,
        rewards: Sequence[str | RewardFn] | None = None,
        **kwargs: Any,
    ) -> None:
        if settings.rl is None:
            raise UserError(
                "GRPO needs an `rl:` section in the settings (see params/tiny_addition_grpo.yaml)"
            )
        if settings.model.pretrained_model_name_or_path is None:
            raise UserError(
                "rl.init_from: no starting model; run `dllmflow rl --init-from <run dir | export | models:/...>`"
            )
        super().__init__(settings, run_dir, **kwargs)
        self.import_user = import_user
        self.reward_choice = list(rewards) if rewards is not None else settings.rl.rewards

    # ---- build / resume -------------------------------------------------------------------------

    def build(self) -> None:
        from dllmflow.data.tokenizer import load_tokenizer
        from dllmflow.rl.estimators import build_rl_estimator
        from dllmflow.rl.rewards import build_rewards

        s, rl = self.settings, self.settings.rl
        self.tokenizer = load_tokenizer(s.dataset.prepared_dir)
        self.dataset = PromptSet(s.dataset.prepared_dir, "train", self.tokenizer, limit=rl.prompt_limit)
        self.build_model()  # the starting weights (+ fresh LoRA), optimizer, checkpointer, as SFT builds them
        self.mask_id = int(self.strategy.mask_token_id)
        # The KL reference: with LoRA the policy itself with its adapters off (its base is frozen), so
        # no second model is held; a full fine-tune needs the starting weights kept apart.
        self.reference = None if has_lora(unwrap(self.model)) else self._build_reference()
        self.estimator = build_rl_estimator(s, self.tokenizer)  # fitted to the rollout sampler
        self.rewards = build_rewards(self.reward_choice, rl.reward_weights, import_user=self.import_user)
        self.sampler = build_rollout_sampler(unwrap(self.model), self.tokenizer, s, self.mask_id)
        self.samples_per_step = rl.prompts_per_step
        self.counters["reward_failures"] = 0  # steps skipped for a failed reward, over the whole run

    def _build_reference(self) -> torch.nn.Module:
        """The frozen starting model of a full fine-tune, on every rank (sharded like the policy under
        FSDP2)."""
        from dllmflow.diffusion.modes import build_mode_model
        from dllmflow.training.parallelize import apply_fsdp

        base = self.settings.model_copy(update={"peft": None})
        reference = build_mode_model(base, self.tokenizer).to(self.info.device).eval()
        reference.requires_grad_(False)
        if self.info.distributed and self.settings.distributed.strategy == "fsdp2":
            apply_fsdp(reference)
        return reference

    # ---- one GRPO step --------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        from dllmflow.rl.rewards import score

        s, rl, info = self.settings, self.settings.rl, self.info
        G = rl.num_generations
        # 1) this rank's prompts, 2) G rollouts each (eval mode: no dropout while sampling)
        positions = PromptSet.step_positions(step, rl.prompts_per_step, info.rank, info.world_size)
        prompts = [self.dataset.at(p, s.train.seed) for p in positions]
        self.model.eval()
        groups = [decode_group(self.sampler, pr.ids, G, rollout_seed(s.train.seed, pos))
                  for pr, pos in zip(prompts, positions)]  # fmt: skip
        self.model.train()

        # 3) rewards; a failure on any rank skips the step on every rank
        scored = [score(self.rewards, [pr.question] * G, g.texts, [pr.answer] * G)
                  for pr, g in zip(prompts, groups)]  # fmt: skip
        failures = [f for b in scored for f in b.failures]
        rollout, record = self._rollout_record(groups, scored, failures)
        if rollout["failed"]:
            return self._skip_reward_step(step, failures, record)

        # 4) advantages, 5) draws scored by old policy and reference (no grad)
        batches, adv_stats, h_sum, h_n = self._prepare_updates(prompts, positions, groups, scored)

        # 6) mu policy updates over the same rollouts
        total_tokens = max(rollout["tokens"], 1.0)
        sums = {"loss": 0.0, "kl0": 0.0, "clipped": 0.0, "ratio": 0.0, "h_sum": h_sum, "h_n": h_n,
                "adv_abs": adv_stats["adv_abs"], "adv_n": adv_stats["adv_n"]}  # fmt: skip

        def loss_of(batch):
            draws, adv, ref, old, mask = batch
            logp = self.estimator.token_logp(self.model, draws)  # [G, C]
            out = self._loss(logp, old if old is not None else logp.detach(), ref, adv, mask)
            return out.loss_sum / total_tokens, out

        for it in range(rl.num_iterations):
            it_loss = 0.0
            for loss, out in backward_each(self.model, batches, loss_of, info, self.autocast):
                it_loss += float(loss)
                sums["loss"] += float(loss) / rl.num_iterations
                sums["clipped"] += float(out.clipped_tokens) / rl.num_iterations
                sums["ratio"] += float(out.ratio_mean) * float(out.num_tokens) / rl.num_iterations
                if it == 0:
                    sums["kl0"] += float(out.kl_sum)
            label = f" update {it + 1}"
            record.update(self.update(reduce_sums({"loss": it_loss}, info)["loss"], step, label))
        g = reduce_sums(sums, info)
        record.update(
            loss=g["loss"],
            kl=g["kl0"] / total_tokens,
            clip_frac=g["clipped"] / total_tokens,
            ratio_mean=g["ratio"] / total_tokens,
            entropy=g["h_sum"] / max(g["h_n"], 1.0),
            advantage_abs_mean=g["adv_abs"] / max(g["adv_n"], 1.0),
            # group normalisation: every group's advantages average to 0 (max over groups; this rank's)
            advantage_group_mean_max=adv_stats["adv_group_mean_max"],
        )
        self.scheduler.step()
        if rl.eval_every and (step + 1) % rl.eval_every == 0:
            record["heldout_em"] = self.heldout_accuracy()
        return record

    def _rollout_record(self, groups, scored, failures) -> tuple[dict[str, float], dict[str, Any]]:
        """The step's rollout figures summed over ranks (a reward failure on any rank counts) and the
        start of its metrics record: reward mean/std, NFE, rollout tok/s, tokens, lr."""
        G, info = self.settings.rl.num_generations, self.info
        rollout = reduce_sums(
            {
                "failed": float(bool(failures)),
                "r_sum": sum(float(b.values.sum()) for b in scored),
                "r_sq": sum(float((b.values.double() ** 2).sum()) for b in scored),
                "n": float(G * len(groups)),
                "nfe": float(sum(g.nfe for g in groups)),
                "groups": float(len(groups)),
                "gen_tokens": float(sum(g.num_tokens for g in groups)),
                "gen_s": sum(g.elapsed_s for g in groups),
                "tokens": float(sum(int(g.completion_mask.sum()) for g in groups)),
            },
            info,
        )
        mean = rollout["r_sum"] / rollout["n"]
        record: dict[str, Any] = {
            "stage": "grpo",
            "reward_mean": mean,
            "reward_std": math.sqrt(max(rollout["r_sq"] / rollout["n"] - mean * mean, 0.0)),
            "nfe": rollout["nfe"] / rollout["groups"],
            "rollout_tok_s": rollout["gen_tokens"] / max(rollout["gen_s"], 1e-9) * info.world_size,
            "tokens_per_step": int(rollout["tokens"]),
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        return rollout, record

    def _prepare_updates(self, prompts, positions, groups, scored):
        """Per group: advantages [G], the estimator's draws, the reference's (and with mu > 1 the old
        policy's) token log-probs, without grad; and the policy's masked entropy. -> (batches, advantage
        stats, entropy sum, entropy count)."""
        from dllmflow.rl.objective import group_advantages

        s, rl, info = self.settings, self.settings.rl, self.info
        G = rl.num_generations
        device = info.device
        batches, adv_stats = [], {"adv_abs": 0.0, "adv_n": 0.0, "adv_group_mean_max": 0.0}
        for pr, pos, g, b in zip(prompts, positions, groups, scored):
            adv = group_advantages(b.values, G, scale=rl.advantage_scale).to(device)  # [G]
            adv_stats["adv_abs"] += float(adv.abs().sum())
            adv_stats["adv_n"] += G
            adv_stats["adv_group_mean_max"] = max(adv_stats["adv_group_mean_max"], abs(float(adv.mean())))
            gen = torch.Generator().manual_seed(draw_seed(s.train.seed, pos))
            prompt_ids = torch.tensor([pr.ids] * G, dtype=torch.long)  # [G, P]: one prompt, no padding
            draws = self.estimator.draw(prompt_ids, g.completion_ids, g.completion_mask, self.mask_id, gen)
            draws = draws.to(device)
            with torch.no_grad(), self.autocast:
                ref = self._reference_logp(draws)  # [G, C]
                old = self.estimator.token_logp(unwrap(self.model), draws) if rl.num_iterations > 1 else None
            batches.append((draws, adv, ref, old, g.completion_mask.to(device)))
        h_sum = h_n = 0.0
        with self.autocast:
            for draws, *_ in batches:
                h, n = masked_entropy(unwrap(self.model), draws)
                h_sum, h_n = h_sum + h, h_n + n
        return batches, adv_stats, h_sum, h_n

    def _reference_logp(self, draws):
        """The reference's token log-probs (no grad): the kept starting model, or with LoRA the policy
        with its adapters disabled (in eval mode, as the kept model is)."""
        if self.reference is not None:
            return self.estimator.token_logp(self.reference, draws)
        policy = unwrap(self.model)
        policy.eval()
        try:
            with adapters_disabled(policy):
                return self.estimator.token_logp(policy, draws)
        finally:
            policy.train()

    def _loss(self, logp, old, ref, adv, mask):
        from dllmflow.rl.objective import grpo_loss

        rl = self.settings.rl
        return grpo_loss(logp, old, ref, adv, mask, rl.clip_eps, rl.kl_beta, rl.kl_log_ratio_clip)

    def _skip_reward_step(self, step: int, failures: list, record: dict[str, Any]) -> dict[str, Any]:
        """No update this step; stop (every rank, naming the first failure of any rank) past the limit."""
        rl = self.settings.rl
        self.counters["reward_failures"] = failed = self.counters["reward_failures"] + 1
        first = _first_failure(failures, self.info)
        if failed > rl.max_reward_failures:
            raise RewardFailureError(
                f"step {step + 1}: reward {first.reward!r} failed on prompt {first.prompt!r}: {first.error} "
                f"({failed} step(s) with failed rewards, rl.max_reward_failures="
                f"{rl.max_reward_failures}); nothing was exported. Fix the reward or raise rl.max_reward_failures"
            )
        self._print(
            f"step {step + 1}: reward {first.reward!r} failed on prompt {first.prompt!r} ({first.error}); "
            f"step skipped ({failed}/{rl.max_reward_failures})"
        )
        self.scheduler.step()
        return {**record, "skipped": True, "reward_failures": failed, "loss": float("nan")}

    # ---- held-out accuracy ----------------------------------------------------------------------

    def heldout_accuracy(self) -> float:
        """Greedy exact match (flexible) on the first `rl.eval_limit` eval-split prompts, sharded over
        ranks (one batch each) and summed: the evaluation's parser, the policy as it is now."""
        from dllmflow.data.task import gold_answer, gsm8k_extract_flexible
        from dllmflow.inference.generate import decode_response

        if not hasattr(self, "_heldout"):
            s = self.settings
            self._heldout = PromptSet(s.dataset.prepared_dir, "eval", self.tokenizer, limit=s.rl.eval_limit)
            self._greedy = build_rollout_sampler(
                unwrap(self.model), self.tokenizer, s, self.mask_id, greedy=True
            )
        info = self.info
        mine = [self._heldout[i] for i in range(info.rank, len(self._heldout), info.world_size)]
        self.model.eval()
        result = self._greedy.generate([p.ids for p in mine]) if mine else None
        self.model.train()
        correct = 0.0
        for p, seq in zip(mine, result.sequences if result else []):
            pred = gsm8k_extract_flexible(decode_response(self.tokenizer, seq))
            correct += float(pred is not None and pred == gold_answer(p.answer))
        return reduce_sums({"c": correct}, info)["c"] / len(self._heldout)


def _first_failure(failures: list, info) -> Any:
    """The first reward failure of the lowest rank that had one (every rank gets the same)."""
    import torch.distributed as dist

    if not info.distributed:
        return failures[0]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, failures[0] if failures else None)
    return next(f for f in gathered if f is not None)
