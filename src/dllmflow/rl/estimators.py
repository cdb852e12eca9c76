"""Sequence log-likelihood estimators for absorbing-mask dLLMs (`mdlm`, `scdd`), docs/strategies.md §8.1.

A masked diffusion model has no tractable log p(completion | prompt); GRPO needs one per token for its
policy ratio. Each estimator splits the work in two so that the policy, the old policy and the frozen
reference are scored on the SAME noise (otherwise their ratio measures the noise, not the policy):

    est = build_estimator("coupled")                    # or "one_step" (prompt_mask_prob=0.15), "mc_elbo" (num_masks=2)
    draws = est.draw(prompt_ids, completion_ids, completion_mask, mask_id, generator)   # noise, no model
    logp = est.token_logp(model, draws)                 # [B, C]; logp.sum(-1) is the sequence estimate
    ref = est.token_logp(ref_model, draws)              # same draws -> a meaningful ratio / KL

  one_step  d1 / diffu-GRPO: the whole completion masked, each prompt token masked w.p. prompt_mask_prob,
            one forward; log p of each completion token (biased, cheap).
  mc_elbo   num_masks draws of t ~ U(eps, 1), each completion token masked w.p. t, weight 1/t on the
            masked tokens' log p, averaged: an unbiased estimate of the MDLM ELBO (§2.1).
  coupled   DiffuCoder's coupled sampling: num_pairs pairs (mask M at level t, its complement at 1-t),
            weights 1/(2t) and 1/(2(1-t)): every completion token scored exactly once per pair, unbiased
            for the same ELBO with lower variance than mc_elbo at the same number of forwards.
  ar_order  JustGRPO: the exact log-likelihood of the left-to-right policy (one copy per completion
            position: the prefix clean, [MASK] from it to the end of the rollouts' canvas); needs
            rollouts decoded by that policy (llada, block_size 1, steps = max_new_tokens), C forwards.

    est = build_rl_estimator(settings)   # the recipe's, fitted to its rollout sampler (ar_order's canvas)

Draws never touch the global RNG: only the `generator` given (the caller seeds it per step).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dllmflow.errors import UserError
from dllmflow.models.attention import forward_bidirectional, row_positions


@dataclass
class Draws:
    """The noise of one estimate: K noisy copies of each row and the weight of each scored token, and
    the policy scored: log softmax(logits / temperature) over the vocabulary but `excluded_id`."""

    noisy_ids: Tensor  # [K, B, P+C+tail] what the model reads (prompt ++ completion, [MASK] where noised)
    attention_mask: Tensor  # [B, P+C+tail] 1 = a token the model reads (prompt_mask ++ completion_mask)
    targets: Tensor  # [B, C] the clean completion ids
    weights: Tensor  # [K, B, C] float32: weight of log p(target) read from copy k (0 = not scored)
    tail: int = 0  # [MASK] positions after the completion (ar_order's canvas), read, never scored
    temperature: float = 1.0
    excluded_id: int | None = None  # a token the policy never emits (the sampler's [MASK])

    @property
    def prompt_len(self) -> int:
        return self.noisy_ids.shape[-1] - self.targets.shape[-1] - self.tail

    def select(self, rows: Tensor | slice) -> Draws:
        """The draws of some rows (a micro-batch), unchanged: scoring them equals scoring all and slicing."""
        return Draws(
            self.noisy_ids[:, rows], self.attention_mask[rows], self.targets[rows], self.weights[:, rows],
            self.tail, self.temperature, self.excluded_id,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> Draws:
        """The same draws with their tensors on `device`."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, Tensor)})

    def log_probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> the scored policy's log-probabilities, in fp32 whatever the model dtype."""
        logits = logits.float()
        if self.excluded_id is not None:
            logits = logits.index_fill(-1, torch.tensor([self.excluded_id], device=logits.device), -math.inf)
        return torch.log_softmax(logits / self.temperature, dim=-1)

    def policy_log_probs(self, model: nn.Module) -> Tensor:
        """The scored policy's log-probabilities [K*B, C, V] at the completion positions of every noisy
        copy: the K copies run as one batch of K·B rows, bidirectionally, padding keys hidden and
        positions counted from each row's first real token (a left-padded prompt reads as alone)."""
        K, B, T = self.noisy_ids.shape
        C, P = self.targets.shape[-1], self.prompt_len
        ids = self.noisy_ids.reshape(K * B, T)  # [K*B, T]
        valid = self.attention_mask.repeat(K, 1)  # [K*B, T]
        logits = forward_bidirectional(model, ids, valid, position_ids=row_positions(valid))  # [K*B, T, V]
        return self.log_probs(logits[:, P : P + C])  # [K*B, C, V]


class Estimator(abc.ABC):
    """Base: `draw` makes the noise (model-free, deterministic given the generator), `token_logp` scores it."""

    name: ClassVar[str]

    def fit_rollouts(self, sampler: str, config: Any) -> None:
        """Adapt to (or refuse, a UserError naming the field) the rollouts' sampler and its config;
        the noise estimators take any."""
        return None

    def draw(
        self,
        prompt_ids: Tensor,  # [B, P]
        completion_ids: Tensor,  # [B, C]
        completion_mask: Tensor,  # [B, C] 1 = a completion token, 0 = right padding
        mask_id: int,
        generator: torch.Generator,
        prompt_mask: Tensor | None = None,  # [B, P] 1 = a prompt token, 0 = left padding; None = no padding
    ) -> Draws:
        comp = completion_mask.to(torch.bool)  # [B, C]
        pmask = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
        noisy_prompt, noisy_comp, weights = self._noise(
            prompt_ids, completion_ids, comp, pmask, mask_id, generator
        )
        return Draws(
            noisy_ids=torch.cat([noisy_prompt, noisy_comp], dim=-1),  # [K, B, P+C]
            attention_mask=torch.cat([pmask, comp], dim=-1).long(),  # [B, P+C]
            targets=completion_ids,
            weights=weights * comp.to(torch.float32),  # padding is never scored
        )

    @abc.abstractmethod
    def _noise(
        self,
        prompt: Tensor,
        completion: Tensor,
        comp: Tensor,
        pmask: Tensor,
        mask_id: int,
        gen: torch.Generator,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> (noisy prompt [K, B, P], noisy completion [K, B, C], weights [K, B, C]); each estimator's own."""

    def token_logp(self, model: nn.Module, draws: Draws) -> Tensor:
        """Σ_k weights[k] · log p_θ(target | noisy copy k) per completion token: [B, C], differentiable
        (one forward of the K copies, `Draws.policy_log_probs`)."""
        K, B, C = draws.weights.shape
        logp = draws.policy_log_probs(model)  # [K*B, C, V]
        target = draws.targets.repeat(K, 1)  # [K*B, C]
        picked = logp.gather(-1, target[..., None]).squeeze(-1).view(K, B, C)  # [K, B, C]
        return (picked * draws.weights).sum(dim=0)  # [B, C]


def _masked(ids: Tensor, where: Tensor, mask_id: int) -> Tensor:
    return torch.where(where, torch.full_like(ids, mask_id), ids)


class OneStep(Estimator):
    """d1's one-step estimate: completion fully masked, prompt tokens masked w.p. `prompt_mask_prob`."""

    name = "one_step"

    def __init__(self, prompt_mask_prob: float = 0.15):
        if not 0.0 <= prompt_mask_prob < 1.0:
            raise UserError(f"rl.estimator.prompt_mask_prob must be in [0, 1), got {prompt_mask_prob}")
        self.prompt_mask_prob = float(prompt_mask_prob)

    def _noise(self, prompt, completion, comp, pmask, mask_id, gen):
        u = torch.rand(prompt.shape, device=prompt.device, generator=gen)  # [B, P]
        noisy_prompt = _masked(prompt, (u < self.prompt_mask_prob) & pmask, mask_id)
        noisy_comp = _masked(completion, comp, mask_id)
        return (
            noisy_prompt[None],
            noisy_comp[None],
            torch.ones(1, *completion.shape, device=completion.device),
        )


class MCElbo(Estimator):
    """Monte-Carlo MDLM ELBO: per draw t ~ U(eps, 1), mask w.p. t, weight 1/t, averaged over `num_masks`."""

    name = "mc_elbo"

    def __init__(self, num_masks: int = 2, eps: float = 1e-3):
        if num_masks < 1:
            raise UserError(f"rl.estimator.num_masks must be >= 1, got {num_masks}")
        if not 0.0 < eps < 1.0:
            raise UserError(f"rl.estimator.eps must be in (0, 1), got {eps}")
        self.num_masks, self.eps = int(num_masks), float(eps)

    def _noise(self, prompt, completion, comp, pmask, mask_id, gen):
        K, (B, C), dev = self.num_masks, completion.shape, completion.device
        # 1) one level per copy and row, 2) one uniform per token: masked where u < t
        t = self.eps + (1.0 - self.eps) * torch.rand(K, B, 1, device=dev, generator=gen)  # [K, B, 1]
        masked = torch.rand(K, B, C, device=dev, generator=gen) < t  # [K, B, C]
        noisy_comp = _masked(completion.expand(K, B, C), masked, mask_id)
        weights = masked.to(torch.float32) / t / K  # [K, B, C]
        return prompt.expand(K, *prompt.shape), noisy_comp, weights


class Coupled(Estimator):
    """DiffuCoder's coupled masks: each pair is a mask M at level t and its complement (level 1-t)."""

    name = "coupled"

    def __init__(self, num_pairs: int = 1, eps: float = 1e-3):
        if num_pairs < 1:
            raise UserError(f"rl.estimator.num_pairs must be >= 1, got {num_pairs}")
        if not 0.0 < eps < 0.5:
            raise UserError(f"rl.estimator.eps must be in (0, 0.5), got {eps}")
        self.num_pairs, self.eps = int(num_pairs), float(eps)

    def _noise(self, prompt, completion, comp, pmask, mask_id, gen):
        N, (B, C), dev = self.num_pairs, completion.shape, completion.device
        # t ~ U(eps, 1-eps) is symmetric, so 1-t has the law of t: each half alone is an unbiased ELBO
        # estimate (weight 1/level on its masked tokens) and the pair averages the two.
        t = self.eps + (1.0 - 2.0 * self.eps) * torch.rand(N, B, 1, device=dev, generator=gen)  # [N, B, 1]
        m = torch.rand(N, B, C, device=dev, generator=gen) < t  # [N, B, C] mask M; its complement is ~m
        masks = torch.cat([m, ~m], dim=0)  # [2N, B, C]
        levels = torch.cat([t, 1.0 - t], dim=0)  # [2N, B, 1]
        noisy_comp = _masked(completion.expand(2 * N, B, C), masks, mask_id)
        weights = masks.to(torch.float32) / levels / (2 * N)  # [2N, B, C]
        return prompt.expand(2 * N, *prompt.shape), noisy_comp, weights


class AROrder(Estimator):
    """JustGRPO's exact likelihood of the left-to-right policy (Ni et al., 2026, "The Flexibility Trap"):
    log p(o) = Σ_i log p_θ(o_i | prompt, o_<i, [MASK] at every canvas position from i on), one copy per
    completion position (K = C forwards), weight 1 on that position only. Exact, not an estimate, for
    the policy that decodes one token per step left to right over a canvas of `canvas` positions,
    sampling softmax(logits / temperature) without [MASK]: llada with block_size 1 and steps =
    max_new_tokens, which `fit_rollouts` requires and reads `canvas` and `temperature` from. Pitfalls it
    keeps: the masked tail runs to the canvas the rollouts were decoded on (masks only up to the row's
    own end would tell the model the answer's length, a different, length-conditioned policy), the
    sampler's temperature and its never-[MASK] rule are the policy's. `canvas` None: masks to each row's
    own end (not a rollout policy; for checks)."""

    name = "ar_order"

    def __init__(self, canvas: int | None = None, temperature: float = 1.0):
        if canvas is not None and canvas < 1:
            raise UserError(f"rl.estimator.canvas must be >= 1, got {canvas}")
        if not temperature > 0:
            raise UserError(f"rl.estimator ar_order: temperature must be > 0, got {temperature}")
        self.canvas, self.temperature = canvas, float(temperature)

    def fit_rollouts(self, sampler: str, config: Any) -> None:
        wrong = []
        if sampler != "llada":
            wrong.append(f"rl.sampler={sampler} (llada decodes left to right with block_size 1)")
        else:
            wanted = {"block_size": 1, "steps": config.max_new_tokens, "threshold": None, "cache": "none"}
            wrong += [f"rl.sampler_overrides.{k}={getattr(config, k)!r} (needs {v!r})"
                      for k, v in wanted.items() if getattr(config, k) != v]  # fmt: skip
        if config.temperature == 0:
            wrong.append("rl.temperature=0 (a greedy policy has no likelihood ratio)")
        if wrong:
            raise UserError(
                "rl.estimator ar_order scores the left-to-right policy, so the rollouts must be decoded by it "
                f"(one token per step, left to right): {'; '.join(wrong)}"
            )
        self.canvas, self.temperature = int(config.max_new_tokens), float(config.temperature)

    def draw(
        self, prompt_ids, completion_ids, completion_mask, mask_id, generator, prompt_mask=None
    ) -> Draws:
        (B, P), C = prompt_ids.shape, completion_ids.shape[-1]
        width = C if self.canvas is None else self.canvas
        if width < C:
            raise UserError(f"rl.estimator ar_order: a completion of {C} tokens exceeds the canvas ({width})")
        comp = completion_mask.to(torch.bool)  # [B, C]
        pmask = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
        pos = torch.arange(C, device=completion_ids.device)
        clean = pos[None, :] < pos[:, None]  # [K=C, C]: copy k reads the completion before position k
        body = torch.where(clean[:, None, :], completion_ids[None], mask_id)  # [C, B, C]
        tail = torch.full(
            (C, B, width - C), mask_id, dtype=completion_ids.dtype, device=completion_ids.device
        )
        # with a canvas every completion position is read (as [MASK] past the row's end), as the sampler did
        canvas = torch.ones(B, width, dtype=torch.bool, device=comp.device) if self.canvas else comp
        weights = (pos[:, None] == pos[None, :]).to(torch.float32)[:, None, :] * comp.to(
            torch.float32
        )  # [C, B, C]
        return Draws(
            noisy_ids=torch.cat([prompt_ids.expand(C, B, P), body, tail], dim=-1),  # [C, B, P+width]
            attention_mask=torch.cat([pmask, canvas], dim=-1).long(),  # [B, P+width]
            targets=completion_ids,
            weights=weights,
            tail=width - C,
            temperature=self.temperature,
            excluded_id=int(mask_id),
        )

    def _noise(self, prompt, completion, comp, pmask, mask_id, gen):  # draw is its own: no random noise
        raise NotImplementedError


ESTIMATORS: dict[str, type[Estimator]] = {
    "one_step": OneStep,
    "mc_elbo": MCElbo,
    "coupled": Coupled,
    "ar_order": AROrder,
}


def build_rl_estimator(settings: Any, tokenizer: Any = None) -> Estimator:
    """The recipe's `rl.estimator`, fitted to its rollout sampler (`Estimator.fit_rollouts`)."""
    from dllmflow.rl.rollout import rollout_sampler_config, sampler_name

    est = build_estimator(settings.rl.estimator.name, **settings.rl.estimator.params)
    est.fit_rollouts(sampler_name(settings), rollout_sampler_config(settings, tokenizer))
    return est


def build_estimator(name: str, **params: Any) -> Estimator:
    """The estimator `name` with its parameters; an unknown name is a UserError listing the choices."""
    if name not in ESTIMATORS:
        raise UserError(f"rl.estimator: unknown estimator {name!r}; choose one of: {', '.join(ESTIMATORS)}")
    try:
        return ESTIMATORS[name](**params)
    except TypeError as e:
        raise UserError(f"rl.estimator: {name} does not take {sorted(params)} ({e})") from None
