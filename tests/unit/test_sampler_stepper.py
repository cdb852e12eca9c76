"""Decoding block by block (`Sampler.stepper`, the server's unit of a turn): the stepped tokens are
`generate`'s, each yielded block is final, and rows dropped between blocks leave the others' tokens as
they are alone. Every step-able loop: llada (no cache, Fast-dLLM dual), llada2 (cached, uncached), idlm."""

from __future__ import annotations

import pytest
from test_sampler_caches import PHRASES, TEXTS, make, qwen3, raw

CASES = [
    ("llada", {"cache": "none"}),
    ("llada", {"cache": "dual", "threshold": 0.05}),
    ("llada2", {"cache": "exact"}),
    ("llada2", {"cache": "none"}),
    ("idlm", {"cache": "exact"}),
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


# With a threshold, rows of one batch need different numbers of forwards for the same block (1 to 4 here).
SETTLING = [
    ("llada", {"cache": "none", "threshold": 0.7}),
    ("llada", {"cache": "dual", "threshold": 0.7}),
    ("llada2", {"cache": "exact", "threshold": 0.7}),
    ("llada2", {"cache": "none", "threshold": 0.7}),
    ("idlm", {"cache": "exact", "threshold": 0.7}),
]


@pytest.fixture(scope="module")
def sharp(tok):
    """The tiny model with its head scaled up: confident enough for a threshold to commit several tokens
    a step, by how much depending on the row (a fresh head's softmax is near uniform over 300 tokens)."""
    import torch

    model = qwen3(tok, 2)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    return model


@pytest.mark.parametrize("name, over", SETTLING, ids=str)
def test_a_row_whose_block_is_final_is_announced_before_the_slower_rows_end_it(sharp, tok, name, over):
    """`step(on_settled=...)` hears, inside the block, of exactly the rows that needed fewer forwards for
    it than the batch's slowest row (counted from `row_nfe`), with that row's final ids through the block."""
    ps = [tok.encode(p) for p in PHRASES[:6]]
    sampler = make(name, sharp, tok, **over)
    whole = raw(sampler, ps)[0]
    stepper = sampler.stepper(ps)
    heard, before = [], [0] * len(ps)
    for j in range(3):  # 12 new tokens in blocks of 4
        calls = []
        progress = stepper.step(on_settled=lambda rows, ids, calls=calls: calls.append(dict(zip(rows, ids))))
        after = progress.row_nfe if progress is not None else stepper.result.row_nfe
        forwards = [a - b for a, b in zip(after, before)]  # [B] this block's forwards per row
        slower = {r for r, f in enumerate(forwards) if 0 < f < max(forwards)}
        announced = {r: ids for call in calls for r, ids in call.items()}
        assert set(announced) == slower
        for r, ids in announced.items():
            assert ids == whole[r][: 4 * (j + 1)]  # final: what the row holds once decoded
        heard += list(announced)
        before = after
    assert progress is None
    assert heard  # the case really has rows that finish a block early


def test_a_listener_does_not_change_the_tokens(sharp, tok):
    ps = [tok.encode(p) for p in PHRASES[:6]]
    sampler = make("llada", sharp, tok, threshold=0.7)
    heard = []
    with_listener = sampler.stepper(ps)
    while with_listener.step(on_settled=lambda rows, ids: heard.append(rows)) is not None:
        pass
    assert heard and with_listener.result.sequences == sampler.generate(ps).sequences
