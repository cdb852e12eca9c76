"""The `ar` mode (diffusion/strategies/ar.py) and the `ar` sampler (diffusion/samplers/ar.py): the loss
is Hugging Face's causal-LM loss over the supervised tokens as a sum and a count; decoding equals HF's
greedy `generate`, a row's tokens do not depend on its batch, and a row stops at its stop id."""

from __future__ import annotations

import pytest
import torch
from test_sampler_stepper import stepped
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from dllmflow.diffusion.modes import MODES, SamplerMisfitError, check_sampler
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.configs import build_sampler_config
from dllmflow.settings import load_settings

V = 64


class _Tok:
    """What the sampler reads of a tokenizer: its stop ids (eos, pad) and fill id; no mask token."""

    def __init__(self, eos: int = 3):
        self.eos_token_id, self.pad_token_id, self.mask_token_id = eos, 0, None

    def get_vocab(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]


def _sampler(model, n: int = 10, eos: int = 3):
    return SAMPLERS["ar"](model, _Tok(eos), build_sampler_config("ar", {"max_new_tokens": n}))


def _hf_greedy(model, prompt: list[int], n: int, stop: list[int]) -> list[int]:
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    new = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
    return next((new[:i] for i, t in enumerate(new) if t in stop), new)


def test_the_mode_is_registered_with_its_sampler():
    assert MODES["ar"].samplers == ("ar",) and MODES["ar"].strategy.endswith("ar:ARStrategy")
    check_sampler("ar", "ar")
    with pytest.raises(SamplerMisfitError, match="Samplers that fit: ar"):
        check_sampler("ar", "llada")
    assert load_settings(dllm={"mode": "ar"}).dllm.mode == "ar"


def test_the_loss_is_hf_causal_lm_loss_as_a_sum_and_a_count(model):
    from dllmflow.diffusion.strategies import build_strategy

    strategy = build_strategy(load_settings(dllm={"mode": "ar"}))
    torch.manual_seed(1)
    ids = torch.randint(4, V, (3, 9))  # [B, L]
    attention = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 4 + [0] * 5])  # right padding
    loss_mask = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    )
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    assert strategy.corrupt(batch, [0, 1, 2]) == {}
    count = strategy.token_counts(batch)["ar"]
    out = strategy.loss(model, batch)
    # reference: HF labels (-100 where unsupervised or padded), its own shift, mean over scored labels
    labels = ids.masked_fill((loss_mask == 0) | (attention == 0), -100)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    first_unscored = int(((loss_mask[:, 0] != 0) & (attention[:, 0] != 0)).sum())  # position 0 has no logit
    assert int(count) == int((labels != -100).sum()) - first_unscored == 6 + 4 + 2
    torch.testing.assert_close(out.sums["ar"].detach() / count, ref, rtol=1e-5, atol=1e-6)
    assert out.dllm_terms == ("ar",)


def test_the_sampler_equals_hf_greedy_generate(model):
    out = _sampler(model, 10).generate(PROMPTS)
    stop = sorted(_sampler(model).stop_ids)
    assert out.sequences == [_hf_greedy(model, p, 10, stop) for p in PROMPTS]
    assert any(out.sequences)
    uncached = SAMPLERS["ar"](
        model, _Tok(), build_sampler_config("ar", {"max_new_tokens": 10, "cache": "none"})
    )
    assert uncached.config.cache == "none" and uncached.generate(PROMPTS).sequences == out.sequences


def test_a_row_decodes_as_it_would_alone(model):
    sampler = _sampler(model, 10)
    alone = [sampler.generate([p]).sequences[0] for p in PROMPTS]
    assert sampler.generate(PROMPTS).sequences == alone
    assert sampler.generate(PROMPTS[::-1]).sequences == alone[::-1]
    assert sampler.generate([PROMPTS[1], PROMPTS[0]]).sequences == [alone[1], alone[0]]


def test_a_row_stops_at_its_stop_id_and_leaves_the_batch(model):
    free = _sampler(model, 10, eos=1).generate(PROMPTS).sequences
    assert [len(f) for f in free] == [10] * 4  # no stop id (eos 1, pad 0) in the free run
    eos = free[1][2]  # row 1's third token becomes the stop id: row 1 ends after two tokens
    assert eos not in free[1][:2]
    out = _sampler(model, 10, eos=eos).generate(PROMPTS)
    assert out.sequences[1] == free[1][:2]
    assert out.row_nfe[1] == 3  # two tokens, then the forward that emitted the stop id; none after
    stopped = [next((i for i, t in enumerate(s) if t == eos), None) for s in free]
    assert out.row_nfe == [10 if i is None else i + 1 for i in stopped]
    assert out.nfe == max(out.row_nfe) and out.sequences == [s[:i] for s, i in zip(free, stopped)]


def test_stepping_streams_final_tokens_and_dropped_rows_leave_the_others_as_alone(model):
    """The server's turns (`Sampler.stepper`): a pause before every forward after the prompt's, each row's
    tokens so far final, the stepped result `generate`'s; rows dropped at a pause cost nothing after."""
    eos = _sampler(model, 10, eos=1).generate(PROMPTS).sequences[1][2]  # row 1 stops after two tokens
    sampler = _sampler(model, 10, eos=eos)
    whole = sampler.generate(PROMPTS)
    ids = [s + [eos] if len(s) < 10 else s for s in whole.sequences]  # untrimmed: the stop id too
    stepper, seen = sampler.stepper(PROMPTS), []
    while (progress := stepper.step()) is not None:
        seen.append(progress)
    assert len(seen) == 9  # 10 forwards, the first the prompts'
    for t, progress in enumerate(seen, start=1):  # t tokens committed before pause t
        assert progress.tokens == [i[:t] for i in ids]
        assert progress.done == [len(i) < 10 and len(i) <= t for i in ids]
    assert seen[-1].done[1] and not all(seen[-1].done)
    assert stepper.result.sequences == whole.sequences and stepper.result.row_nfe == whole.row_nfe
    _, kept = stepped(sampler, PROMPTS, drop_after_first=[3, 0])
    assert kept.sequences == [whole.sequences[i] for i in (3, 0)]
    assert kept.row_nfe == [whole.row_nfe[i] for i in (3, 0)]
