"""Sequence log-likelihood estimators (docs/strategies.md §8.1) against exact values: a context-free
model's log-likelihood (= its ELBO) and, for a tiny Qwen3, the ELBO enumerated over all 2^C masks."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.errors import UserError
from dllmflow.rl.estimators import ESTIMATORS, build_estimator

V, MASK = 11, 10


class ContextFree(nn.Module):
    """Logits depend only on the column, never on the tokens: log p(x) = Σ_i log softmax(table_i)[x_i]."""

    def __init__(self, length: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(length, V, generator=g) * 2)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        N, T = input_ids.shape
        return SimpleNamespace(logits=self.table[:T].expand(N, T, V))


def exact_context_free(model: ContextFree, P: int, completion: list[int]) -> list[float]:
    """Per-token log p, one position at a time with the log-sum-exp written out."""
    out = []
    for i, x in enumerate(completion):
        row = model.table[P + i].detach().double().tolist()
        out.append(row[x] - math.log(sum(math.exp(v) for v in row)))
    return out


def tiny_qwen3() -> nn.Module:
    torch.manual_seed(0)
    # large initial weights: the context visibly matters (one_step is then far from the ELBO)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, initializer_range=0.3)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def interval_integral(k: int, n: int, lo: float, hi: float) -> float:
    """∫_lo^hi t^(k-1) (1-t)^(n-k) dt by the binomial expansion of (1-t)^(n-k)."""
    total = 0.0
    for j in range(n - k + 1):
        c = math.comb(n - k, j) * (-1) ** j
        total += c * (hi ** (k + j) - lo ** (k + j)) / (k + j)
    return total


def exact_elbo(model, prompt: list[int], completion: list[int], lo: float, hi: float) -> float:
    """Σ_S Σ_{i∈S} log p(x_i | x with S masked) · ∫_lo^hi t^{|S|-1}(1-t)^{C-|S|} dt / (hi - lo), every
    non-empty S ⊆ completion enumerated (lo=0, hi=1: the weight is Beta(|S|, C-|S|+1), the MDLM ELBO)."""
    C = len(completion)
    total = 0.0
    for k in range(1, C + 1):
        for S in itertools.combinations(range(C), k):
            ids = list(prompt) + [MASK if i in S else x for i, x in enumerate(completion)]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]),
                               attention_mask=torch.zeros(1, 1, len(ids), len(ids))).logits[0]  # fmt: skip
            logp = torch.log_softmax(logits.double(), dim=-1)
            total += (
                sum(logp[len(prompt) + i, completion[i]].item() for i in S)
                * interval_integral(k, C, lo, hi)
                / (hi - lo)
            )
    return total


def repeated(prompt: list[int], completion: list[int], n: int):
    """One row repeated n times: n independent draws of the estimator in one call."""
    return torch.tensor([prompt] * n), torch.tensor([completion] * n), torch.ones(n, len(completion))


def estimates(est, model, prompt, completion, n, seed) -> torch.Tensor:
    p, c, m = repeated(prompt, completion, n)
    draws = est.draw(p, c, m, MASK, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return est.token_logp(model, draws).sum(dim=-1).double()  # [n]


def assert_mean_within(samples: torch.Tensor, expected: float, sigmas: float = 4.5):
    se = samples.std().item() / math.sqrt(samples.numel())
    assert abs(samples.mean().item() - expected) < sigmas * se + 1e-6, (samples.mean().item(), expected, se)


PROMPT, COMPLETION = [1, 2, 3], [4, 5, 6, 7]


def test_one_step_is_exact_for_a_context_free_model():
    model = ContextFree(len(PROMPT) + len(COMPLETION))
    got = estimates(build_estimator("one_step"), model, PROMPT, COMPLETION, 3, seed=0)
    want = sum(exact_context_free(model, len(PROMPT), COMPLETION))
    torch.testing.assert_close(got, torch.full((3,), want, dtype=torch.float64), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "params"), [("mc_elbo", {"num_masks": 1}), ("mc_elbo", {"num_masks": 3}),
                                              ("coupled", {"num_pairs": 1})])  # fmt: skip
def test_elbo_estimators_are_unbiased_for_a_context_free_model(name, params):
    """A context-free model's ELBO is its exact log-likelihood; the estimators match it in expectation."""
    model = ContextFree(len(PROMPT) + len(COMPLETION))
    samples = estimates(build_estimator(name, **params), model, PROMPT, COMPLETION, 4000, seed=1)
    assert_mean_within(samples, sum(exact_context_free(model, len(PROMPT), COMPLETION)))
    assert samples.std() > 0.1  # a real Monte-Carlo estimate, not the exact value by construction


def test_coupled_scores_every_token_exactly_once_per_pair():
    est = build_estimator("coupled", num_pairs=3)
    p, c, m = repeated(PROMPT, COMPLETION, 5)
    m[1, 3:] = 0  # a padded row
    d = est.draw(p, c, m, MASK, torch.Generator().manual_seed(2))
    masked = d.noisy_ids[:, :, len(PROMPT) :] == MASK  # [2N, B, C]
    scored = d.weights > 0
    assert torch.equal(scored, masked & m.bool())
    per_pair = scored.view(2, 3, 5, 4).sum(dim=0)  # mask + its complement: [N, B, C]
    assert torch.equal(per_pair, m.long().expand(3, 5, 4))


def test_mc_elbo_and_coupled_match_the_enumerated_elbo_and_coupled_varies_less():
    model = tiny_qwen3()
    eps = 0.05  # bounded 1/t weights keep the sample variance itself well estimated
    mc = estimates(build_estimator("mc_elbo", num_masks=2, eps=eps), model, PROMPT, COMPLETION, 4000, seed=3)
    cp = estimates(build_estimator("coupled", num_pairs=1, eps=eps), model, PROMPT, COMPLETION, 4000, seed=4)
    elbo = exact_elbo(model, PROMPT, COMPLETION, eps, 1.0)
    assert_mean_within(mc, elbo)
    assert_mean_within(cp, exact_elbo(model, PROMPT, COMPLETION, eps, 1.0 - eps))
    # the truncated levels change the ELBO by O(eps) only: both are close to the eps -> 0 value
    full = exact_elbo(model, PROMPT, COMPLETION, 0.0, 1.0)
    assert abs(elbo - full) < 0.05 * abs(full)
    # the check discriminates: d1's one-step estimate (biased) is many standard errors away
    one_step = estimates(build_estimator("one_step", prompt_mask_prob=0.0), model, PROMPT, COMPLETION, 1, 0)
    assert abs(one_step.item() - elbo) > 10 * mc.std().item() / math.sqrt(mc.numel())
    assert cp.var() < 0.8 * mc.var()  # same number of forwards (2 per estimate)


def test_same_draws_give_the_same_logp_and_the_global_rng_is_untouched():
    model = tiny_qwen3()
    twin = copy.deepcopy(model)
    p, c, m = repeated(PROMPT, COMPLETION, 4)
    for name in ESTIMATORS:
        est = build_estimator(name)
        state = torch.get_rng_state()
        a = est.draw(p, c, m, MASK, torch.Generator().manual_seed(5))
        b = est.draw(p, c, m, MASK, torch.Generator().manual_seed(5))
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(a.noisy_ids, b.noisy_ids) and torch.equal(a.weights, b.weights)
        with torch.no_grad():
            whole = est.token_logp(model, a)
            assert torch.equal(whole, est.token_logp(twin, b))
            torch.testing.assert_close(est.token_logp(model, a.select(slice(1, 3))), whole[1:3])


def test_padding_is_not_scored_and_a_left_padded_prompt_reads_as_alone():
    model = tiny_qwen3()
    est = build_estimator("one_step", prompt_mask_prob=0.0)
    alone = est.draw(torch.tensor([PROMPT]), torch.tensor([COMPLETION]), torch.ones(1, 4), MASK,
                     torch.Generator().manual_seed(0))  # fmt: skip
    prompts = torch.tensor([[0, 0] + PROMPT, [9, 8, 7, 6, 5]])
    pmask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    d = est.draw(prompts, torch.tensor([COMPLETION] * 2), cmask, MASK, torch.Generator().manual_seed(0),
                 prompt_mask=pmask)  # fmt: skip
    with torch.no_grad():
        got, want = est.token_logp(model, d), est.token_logp(model, alone)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    assert torch.equal(got[1, 2:], torch.zeros(2)) and (got[1, :2] != 0).all()


def test_token_logp_is_differentiable():
    model = tiny_qwen3()
    p, c, m = repeated(PROMPT, COMPLETION, 2)
    est = build_estimator("coupled")
    est.token_logp(model, est.draw(p, c, m, MASK, torch.Generator().manual_seed(0))).sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_unknown_estimator_names_the_field_and_the_choices():
    with pytest.raises(UserError, match=r"rl\.estimator.*one_step, mc_elbo, coupled, ar_order"):
        build_estimator("two_step")
    with pytest.raises(UserError, match="rl.estimator"):
        build_estimator("mc_elbo", prompt_mask_prob=0.1)


def direct_logp(model, ids: list[int]) -> torch.Tensor:
    """log softmax of the model's logits on one unpadded row read bidirectionally: [T, V] float64."""
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids]), attention_mask=torch.zeros(1, 1, len(ids), len(ids))
        ).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_one_step_is_exact_for_a_context_dependent_model_given_its_prompt_mask():
    """d1's one-step value is deterministic once its prompt mask is drawn: Σ_i log p(o_i | the prompt
    with those tokens masked, the whole completion masked), one forward of the row alone, here for a
    model whose predictions depend on the context, a left-padded prompt and a padded completion."""
    model = tiny_qwen3()
    est = build_estimator("one_step", prompt_mask_prob=0.5)
    prompts = torch.tensor([[0, 0, 1, 2, 3], [9, 8, 7, 6, 5], [4, 3, 2, 1, 9]])
    pmask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    completions = torch.tensor([[4, 5, 6, 7], [1, 2, 3, 4], [7, 7, 2, 0]])
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    values, masks = [], []
    for seed in (0, 1):
        d = est.draw(
            prompts, completions, cmask, MASK, torch.Generator().manual_seed(seed), prompt_mask=pmask
        )
        with torch.no_grad():
            got = est.token_logp(model, d).double()  # [B, C]
        for b in range(3):
            real = pmask[b].bool()
            noisy_prompt = d.noisy_ids[0, b, :5][real].tolist()  # the drawn prompt mask, padding dropped
            n = int(cmask[b].sum())
            logp = direct_logp(model, noisy_prompt + [MASK] * n)
            want = [logp[len(noisy_prompt) + i, completions[b, i]].item() for i in range(n)]
            torch.testing.assert_close(got[b, :n], torch.tensor(want, dtype=torch.float64), rtol=0, atol=2e-5)
            assert torch.equal(got[b, n:], torch.zeros(4 - n, dtype=torch.float64))
        values.append(got.sum(-1))
        masks.append(d.noisy_ids[0, :, :5] == MASK)
    assert not torch.equal(masks[0], masks[1])  # two prompt masks ...
    assert (values[0] - values[1]).abs().max() > 1e-3  # ... two values: the model reads the prompt


def exact_left_to_right(model, prompt: list[int], completion: list[int], canvas: int, temperature=1.0):
    """Σ_i log p(o_i | prompt, o_<i, [MASK] at positions i..canvas-1), [MASK] never emitted: one
    forward per position, the definition written out."""
    total = 0.0
    for i, x in enumerate(completion):
        ids = list(prompt) + list(completion[:i]) + [MASK] * (canvas - i)
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([ids]), attention_mask=torch.zeros(1, 1, len(ids), len(ids))
            ).logits[0]
        row = logits[len(prompt) + i].double() / temperature
        row[MASK] = -math.inf
        total += torch.log_softmax(row, dim=-1)[x].item()
    return total


def test_ar_order_is_the_exact_left_to_right_likelihood_on_the_rollouts_canvas():
    model = tiny_qwen3()
    est = build_estimator("ar_order", canvas=6, temperature=0.7)
    completions = torch.tensor([[4, 5, 6, 7], [1, 2, 0, 0]])
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    d = est.draw(torch.tensor([PROMPT] * 2), completions, cmask, MASK, torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = est.token_logp(model, d).sum(-1).double()
    want = [
        exact_left_to_right(model, PROMPT, [4, 5, 6, 7], 6, 0.7),
        exact_left_to_right(model, PROMPT, [1, 2], 6, 0.7),
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=5e-5)
    # the canvas matters (the pitfall): masks only to the row's own end is another, length-told policy
    own = build_estimator("ar_order", temperature=0.7)
    with torch.no_grad():
        short = own.token_logp(
            model, own.draw(torch.tensor([PROMPT]), completions[:1], cmask[:1], MASK, None)
        )
    torch.testing.assert_close(short.sum().double().item(), exact_left_to_right(model, PROMPT, [4, 5, 6, 7], 4, 0.7),
                               rtol=0, atol=5e-5)  # fmt: skip
    assert abs(short.sum().item() - got[0].item()) > 1e-3


def test_ar_order_is_a_distribution_over_every_answer_prefix():
    """With the canvas fixed, exp of the value summed over every 2-token answer (the 10 tokens but
    [MASK], each position) is 1, on a canvas of 2 and as a prefix of a canvas of 3: a proper policy."""
    model = tiny_qwen3()
    answers = torch.tensor([[a, b] for a in range(V) for b in range(V) if MASK not in (a, b)])  # [100, 2]
    for canvas in (2, 3):
        est = build_estimator("ar_order", canvas=canvas)
        d = est.draw(torch.tensor([PROMPT] * len(answers)), answers, torch.ones_like(answers), MASK, None)
        with torch.no_grad():
            total = est.token_logp(model, d).sum(-1).double().exp().sum()
        torch.testing.assert_close(total.item(), 1.0, rtol=0, atol=1e-5)


def test_ar_order_fits_only_left_to_right_rollouts_and_the_settings_refuse_it_elsewhere():
    from dllmflow.diffusion.samplers.configs import build_sampler_config
    from dllmflow.settings import SettingsError, load_settings
    from dllmflow.workflow.grpo import check_rl_settings

    est = build_estimator("ar_order")
    est.fit_rollouts(
        "llada",
        build_sampler_config("llada", {"block_size": 1, "steps": 8, "max_new_tokens": 8, "temperature": 0.5}),
    )
    assert (est.canvas, est.temperature) == (8, 0.5)
    with pytest.raises(UserError, match=r"rl.sampler_overrides.steps=4 \(needs 8\)"):
        est.fit_rollouts(
            "llada",
            build_sampler_config(
                "llada", {"block_size": 1, "steps": 4, "max_new_tokens": 8, "temperature": 1.0}
            ),
        )
    with pytest.raises(UserError, match=r"rl.sampler=scdd"):
        est.fit_rollouts("scdd", build_sampler_config("scdd", {"steps": 8, "max_new_tokens": 8}))

    grpo = Path(__file__).resolve().parents[2] / "params" / "tiny_addition_grpo.yaml"
    ar = {"estimator": {"name": "ar_order"}, "sampler": "llada", "sampler_overrides": {"block_size": 1}}
    check_rl_settings(load_settings(grpo, rl=ar))  # eval: 8 steps for 8 new tokens
    with pytest.raises(UserError, match=r"steps=4 \(needs 8\)"):
        check_rl_settings(load_settings(grpo, rl={**ar, "sampler_overrides": {"block_size": 1, "steps": 4}}))
    for rl, named in [({**ar, "sampler": None}, "rl.sampler=None"),
                      ({**ar, "sampler_overrides": {}}, "rl.sampler_overrides.block_size=None"),
                      ({**ar, "temperature": 0.0}, "rl.temperature=0")]:  # fmt: skip
        with pytest.raises(
            SettingsError, match=r"rl.estimator.name=ar_order needs rollouts decoded left to right"
        ) as e:
            load_settings(grpo, rl=rl)
        assert named in str(e.value)
    with pytest.raises(SettingsError, match="rl: dllm.mode=hybrid has no sequence log-likelihood"):
        load_settings(grpo.parent / "tiny_hybrid.yaml", rl=ar)
