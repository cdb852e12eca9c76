"""Decoding block by block (`Sampler.stepper`, the server's unit of a turn): the stepped tokens are
`generate`'s, each yielded block is final, and rows dropped between blocks leave the others' tokens as
they are alone. Every step-able loop: llada (no cache, Fast-dLLM dual), llada2 (cached, uncached), idlm."""

from __future__ import annotations

import pytest
from test_sampler_caches import PHRASES, TEXTS, make, qwen3, raw

CASES = [
    ("llada", {"cache": "none"}),
    ("llada", {"cache": "dual", "threshold": 0.05}),
    ("llada2", {"use_kv_cache": True}),
    ("llada2", {"use_kv_cache": False}),
    ("idlm", {"use_kv_cache": True}),
]


@pytest.fixture(scope="module")
def tok():
    from dllmflow.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")


@pytest.fixture(scope="module")
def model(tok):
    return qwen3(tok, 2)


def stepped(sampler, ps, drop_after_first=None):
    """(progress per step, result); `drop_after_first`: the row indices to keep after the first block."""
    stepper = sampler.stepper(ps)
    seen = []
    while (progress := stepper.step()) is not None:
        seen.append(progress)
        if drop_after_first is not None and len(seen) == 1:
            stepper.keep(drop_after_first)
    return seen, stepper.result


@pytest.mark.parametrize("name, over", CASES, ids=str)
def test_stepping_gives_the_tokens_of_generate_and_blocks_are_final(model, tok, name, over):
    ps = [tok.encode(p) for p in PHRASES[:4]]
    sampler = make(name, model, tok, **over)
    whole = raw(sampler, ps)[0]  # untrimmed windows of one uninterrupted decode
    seen, result = stepped(sampler, ps)
    assert len(seen) == 2  # 12 new tokens in blocks of 4: yields after blocks 1 and 2, returns after 3
    for j, progress in enumerate(seen, start=1):
        assert progress.tokens == [w[: 4 * j] for w in whole]  # a yielded block never changes again
    assert result.sequences == sampler.generate(ps).sequences


@pytest.mark.parametrize("name, over", CASES, ids=str)
def test_rows_dropped_between_blocks_leave_the_others_as_alone(model, tok, name, over):
    ps = [tok.encode(p) for p in PHRASES[:4]]
    sampler = make(name, model, tok, **over)
    _, result = stepped(sampler, ps, drop_after_first=[3, 1])
    assert result.sequences == [sampler.generate([ps[i]]).sequences[0] for i in (3, 1)]
    assert len(result.row_nfe) == 2


def test_keep_before_the_first_step_is_refused(model, tok):
    stepper = make("llada", model, tok).stepper([tok.encode("Hi")])
    with pytest.raises(ValueError):
        stepper.keep([0])
