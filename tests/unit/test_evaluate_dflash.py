"""DFlash speculative decoding: identical to the target's greedy decoding (lossless), with the
forward and acceptance bookkeeping that tau and the speed-up are computed from."""

from __future__ import annotations

import copy

import pytest
import torch
from _dflash_common import NUM_WORDS, make_strategy

from dllmflow.evaluation.acceptance import acceptance_metrics, speculative_generate, target_greedy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    strategy, draft = make_strategy(tmp_path_factory.mktemp("spec") / "target", block_size=4)
    return strategy, draft.eval()


@torch.no_grad()
def reference_greedy(target, prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
    """Greedy decoding written directly: a full (uncached) forward per token, argmax of the last logits."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        nxt = int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos_id:
            break
    return ids[len(prompt) :]


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, NUM_WORDS, (n,), generator=g).tolist() for n in (5, 9, 14)]


def test_speculative_output_equals_target_greedy(pair):
    strategy, draft = pair
    spec, greedy = [], []
    for prompt in _prompts():
        s = speculative_generate(
            draft, strategy.target, prompt, 20, 4, strategy.layer_ids, strategy.mask_token_id
        )
        g = target_greedy(strategy.target, prompt, 20)
        want = reference_greedy(strategy.target, prompt, 20)
        assert s.tokens == want and g.tokens == want and len(want) == 20
        assert s.target_forwards == 1 + len(s.accepted) and g.target_forwards == 20
        assert all(0 <= n <= 3 for n in s.accepted)
        # the rounds account for the tokens: prefill 1, then accepted + bonus per round, the last one
        # cut by the budget
        assert 1 + sum(n + 1 for n in s.accepted[:-1]) < len(s.tokens) <= 1 + sum(n + 1 for n in s.accepted)
        spec.append(s)
        greedy.append(g)
    m = acceptance_metrics(spec, greedy, 4)
    rounds = [n for s in spec for n in s.accepted]
    assert m["lossless"] == 1.0
    assert m["tau"] == pytest.approx(sum(n + 1 for n in rounds) / len(rounds))
    assert 1.0 <= m["tau"] < 4.0  # an untrained draft does not agree with the target every time
    rates = [m[f"acceptance_k{k}"] for k in (1, 2, 3)]
    assert rates == pytest.approx([sum(n >= k for n in rounds) / len(rounds) for k in (1, 2, 3)])
    assert all(0.0 <= r <= 1.0 for r in rates) and rates == sorted(rates, reverse=True)
    assert m["speedup_target_forwards"] == pytest.approx(60 / sum(s.target_forwards for s in spec))
    assert m["tokens_per_target_forward"] == pytest.approx(60 / sum(s.target_forwards for s in spec))


def test_full_acceptance_when_the_draft_agrees(pair):
    """A target whose greedy output is constant (final norm zeroed: all logits 0 -> token 0) and a
    draft that always proposes that token accept every proposal: tau = bs, ~bs x fewer forwards."""
    strategy, draft = pair
    target, draft = copy.deepcopy(strategy.target), copy.deepcopy(draft)
    target.model.norm.weight.data.zero_()
    draft.norm.weight.data.zero_()
    prompt = _prompts()[1]
    s = speculative_generate(draft, target, prompt, 21, 4, strategy.layer_ids, strategy.mask_token_id)
    g = target_greedy(target, prompt, 21)
    assert s.tokens == g.tokens == reference_greedy(target, prompt, 21) == [0] * 21
    assert s.accepted == [3] * 5  # 1 (prefill) + 5 rounds x 4 tokens = 21
    m = acceptance_metrics([s], [g], 4)
    assert m["tau"] == 4.0 and m["acceptance_k3"] == 1.0
    assert m["speedup_target_forwards"] == pytest.approx(21 / 6)


def test_eos_stops_both_decoders_at_the_same_token(pair):
    strategy, draft = pair
    prompt = _prompts()[0]
    full = reference_greedy(strategy.target, prompt, 20)
    eos = full[7]
    s = speculative_generate(
        draft, strategy.target, prompt, 20, 4, strategy.layer_ids, strategy.mask_token_id, eos_id=eos
    )
    g = target_greedy(strategy.target, prompt, 20, eos_id=eos)
    assert (
        s.tokens
        == g.tokens
        == full[: full.index(eos) + 1]
        == reference_greedy(strategy.target, prompt, 20, eos_id=eos)
    )
