"""Rollouts: G completions of one prompt decoded with the project's sampler, as tensors for the estimators.

    sampler = build_rollout_sampler(model, tokenizer, settings)         # once; its config reseeded per group
    group = decode_group(sampler, prompt, G, seed)                       # Group: ids, mask, texts, nfe, ...
    h_sum, n = masked_entropy(model, draws)                               # policy entropy where draws mask

One prompt's G rollouts are one batch of G identical prompts (no padding), decoded by the sampler with
its own seed `rollout_seed(train.seed, position)` from the prompt's global stream position
(diffusion/seeding.py: the corruption stream's scheme, on a stream of its own). A group's tokens
therefore do not depend on the world size or on a restart, and a resumed run redraws them exactly.
The sampler is the recipe's (`rl.sampler`, default the mode's default sampler) with its options: the
preset with the sampler's `rollout_defaults` over it (llada's rollouts decode the full canvas, no EOS
stop), then the `eval:` section's generation knobs but its threshold (a rollout commits by a threshold
only when `rl.sampler_overrides` sets one), then `rl.sampler_overrides` and `rl.temperature`
(`build_sampler_config`, the path generate and the registered model use; the sampler must fit the
mode: `check_sampler`). A completion is the response up to its stop token, plus that token (the
chat template closes an assistant turn with EOS): what SFT supervised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dllmflow.diffusion.seeding import sample_seed
from dllmflow.errors import UserError
from dllmflow.settings.rl import UNEVEN_ROLLOUT_OPTIONS

NOT_FROM_EVAL = ("threshold",)  # eval knobs rollouts do not inherit (rl.sampler_overrides may set them)
ROLLOUT_STREAM = 2**44  # distinct from the corruption stream (2**43) at the same index
DRAW_STREAM = 2**45  # the estimator's noise of a group


@dataclass
class Group:
    completion_ids: Tensor  # [G, C] right-padded with the fill id
    completion_mask: Tensor  # [G, C] 1 = a completion token (response + its stop token)
    texts: list[str]  # decoded responses (what rewards read)
    nfe: int  # forwards the group's decoding took
    num_tokens: int  # generated tokens (trimmed)
    elapsed_s: float


def rollout_seed(base_seed: int, position: int) -> int:
    return sample_seed(base_seed, 0, position, stream=ROLLOUT_STREAM)


def draw_seed(base_seed: int, position: int) -> int:
    return sample_seed(base_seed, 0, position, stream=DRAW_STREAM)


def sampler_name(settings: Any) -> str:
    from dllmflow.diffusion.modes import MODES

    return settings.rl.sampler or MODES[settings.dllm.mode].default_sampler


def rollout_sampler_config(settings: Any, tokenizer: Any = None, *, greedy: bool = False):
    """The rollout sampler's config (seed 0; `decode_group` reseeds it). `greedy`: the held-out
    evaluation's (temperature 0). UserError naming the option when the sampler does not take it."""
    from dllmflow.diffusion.modes import check_sampler
    from dllmflow.diffusion.samplers import SAMPLER_CONFIGS
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.diffusion.samplers.eval_knobs import eval_defaults

    name = sampler_name(settings)
    check_sampler(settings.dllm.mode, name)
    explicit = {**settings.rl.sampler_overrides, "temperature": 0.0 if greedy else settings.rl.temperature}
    # the eval section's length knobs, not its threshold: a rollout commits by a threshold only when
    # `rl.sampler_overrides` says so (it changes the policy sampled, and under FSDP2 the forwards per rank)
    defaults = {k: v for k, v in eval_defaults(settings.eval, name).items() if k not in NOT_FROM_EVAL}
    # below those, what the sampler's rollouts take in place of its preset (llada: no EOS stop)
    defaults = {**SAMPLER_CONFIGS[name].rollout_defaults, **defaults}
    config = build_sampler_config(name, explicit, tokenizer, defaults=defaults)
    if settings.distributed.strategy == "fsdp2" and settings.world_size > 1:  # the preset's, past the parse
        uneven = [k for k in UNEVEN_ROLLOUT_OPTIONS if getattr(config, k, None) is not None]
        if uneven:
            raise UserError(
                f"rl.sampler={name}: its rollouts would decode with {', '.join(uneven)} set, which under FSDP2 "
                f"with {settings.world_size} ranks gives ranks different numbers of forwards; pick llada or scdd"
            )
    return config


def build_rollout_sampler(
    model: nn.Module, tokenizer: Any, settings: Any, mask_id: int, *, greedy: bool = False
):
    from dllmflow.diffusion.samplers import SAMPLERS

    config = rollout_sampler_config(settings, tokenizer, greedy=greedy)
    sampler = SAMPLERS[sampler_name(settings)](
        model, tokenizer, config, mask_id=mask_id, training_settings=settings
    )
    sampler.grad_mode = torch.no_grad  # the policy trains right after: no inference tensors (FSDP2's buffers)
    return sampler


def decode_group(sampler: Any, prompt_ids: list[int], num: int, seed: int) -> Group:
    """`num` completions of one prompt (one batch), seeded by `seed`."""
    from dllmflow.inference.generate import decode_response

    sampler.config = sampler.config.model_copy(update={"seed": int(seed)})
    t0 = time.perf_counter()
    result = sampler.generate([prompt_ids] * num)
    elapsed = time.perf_counter() - t0
    limit = sampler.config.max_new_tokens
    eos = sampler.tokenizer.eos_token_id
    # a response cut by a stop token gets it back (SFT supervised the closing EOS); a full-length one has none
    seqs = [s + [eos] if len(s) < limit and eos is not None else s for s in result.sequences]
    width = max(1, max(map(len, seqs)))
    ids = torch.full((num, width), sampler.fill_id, dtype=torch.long)  # [G, C]
    mask = torch.zeros((num, width), dtype=torch.long)  # [G, C]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    texts = [decode_response(sampler.tokenizer, s) for s in result.sequences]
    return Group(ids, mask, texts, result.nfe, result.num_generated_tokens, elapsed)


@torch.no_grad()
def masked_entropy(model: nn.Module, draws: Any) -> tuple[float, float]:
    """(Σ entropy of the policy's prediction, count) over the completion positions the draws mask
    (weight > 0): how sure the policy is where it must fill in. One no-grad forward of the K copies."""
    K, B, C = draws.weights.shape
    logp = draws.policy_log_probs(model)  # [K*B, C, V]
    entropy = -(logp.exp() * logp).sum(-1).view(K, B, C)  # [K, B, C]
    scored = draws.weights > 0  # [K, B, C]
    return float(entropy[scored].sum()), float(scored.sum())
