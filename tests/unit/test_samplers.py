"""Sampler machinery (docs/strategies.md §3.0/§3.1) against direct reference formulas, and the llada sampler's
properties on a tiny random Qwen3 (bidirectional forward) and on a scripted "model" whose logits the
test controls."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import (
    SamplerConfig,
    build_sampler_config,
    sampler_supports,
    trim_at_stop,
)
from dllmflow.diffusion.samplers.llada import LLaDASampler
from dllmflow.diffusion.samplers.loop import (
    FullForward,
    block_geometry,
    build_canvas,
    drain,
    get_num_transfer_tokens,
    get_transfer_index,
    gumbel_argmax,
    iter_block_loop,
    shift_right_zero_fill,
)
from dllmflow.errors import UserError

TEXTS = ["Natalia sold 48 clips in April and half as many in May. #### 72", "What is 2 + 3? The answer is 5."]


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    # float64 so batch-vs-single comparisons are not at the mercy of near-ties of a random model
    return Qwen3ForCausalLM(cfg).double().eval()


def prompts(tok):
    a = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                return_dict=False)  # fmt: skip
    b = tok.encode("Natalia sold 48 clips")
    return [list(a), list(b)]


class Recorder:
    """Wraps a forward and keeps the canvas it was called on."""

    def __init__(self, forward):
        self.forward, self.calls = forward, []

    def __call__(self, x, attn):
        self.calls.append(x.clone())
        return self.forward(x, attn)


def scripted_forward(table, prompts=None):
    """A fake model: logits[b, p] = table[b][p] (a dict pos -> (token, logit)) on a flat background.
    With `prompts` (row b's prompt), a forward's row is told by its prompt (the longest that matches):
    a forward computes only the rows still decoding."""

    def row_of(ids: list[int], b: int) -> int:
        if prompts is None:
            return b
        order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
        return next(k for k in order if ids[: len(prompts[k])] == prompts[k])

    def forward(x, attn):
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        logits[..., 30] = 0.5  # background favourite: a plain token (not mask/eos/pad)
        for b in range(x.shape[0]):
            for p, (tok_id, value) in table[row_of(x[b].tolist(), b)].items():
                if p < x.shape[1]:
                    logits[b, p, tok_id] = value
        return logits

    return forward


# ---- schedule and selection vs reference formulas ------------------------------------------------


@pytest.mark.parametrize("n,steps", [(0, 4), (3, 8), (8, 8), (13, 4), (128, 128), (7, 3)])
def test_transfer_schedule(n, steps):
    mask = torch.zeros(2, 150, dtype=torch.bool)
    mask[0, :n] = True
    mask[1, 5 : 5 + n // 2] = True
    sched = get_num_transfer_tokens(mask, steps)
    for row, count in enumerate((n, n // 2)):
        ref = [count // steps + (1 if i < count % steps else 0) for i in range(steps)]
        assert sched[row].tolist() == ref
        assert int(sched[row].sum()) == count


def test_gumbel_temperature_zero_is_argmax_and_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 30, generator=g, dtype=torch.float64)
    assert torch.equal(gumbel_argmax(logits, 0.0), logits.argmax(-1))
    u = torch.rand(logits.shape, generator=g, dtype=torch.float64)
    for temp in (0.5, 1.0, 2.0):
        ref = (logits.exp() / (-torch.log(u)) ** temp).argmax(-1)  # LLaDA's formula, verbatim
        assert torch.equal(gumbel_argmax(logits, temp, uniform=u), ref)


def test_gumbel_samples_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64).expand(20000, 3)
    g = torch.Generator().manual_seed(1)
    freq = torch.bincount(gumbel_argmax(logits, 1.0, generator=g), minlength=3).double() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)


def _reference_transfer(logits, mask, x, k, threshold):
    """Direct per-row loop of docs/strategies.md §3.0 token selection at temperature 0, low_confidence."""
    probs = torch.softmax(logits.double(), -1)
    x0 = logits.argmax(-1)
    out = torch.zeros_like(mask)
    for b in range(x.shape[0]):
        conf = [(float(probs[b, p, x0[b, p]]), p) for p in range(x.shape[1]) if mask[b, p]]
        conf.sort(key=lambda c: -c[0])
        kk = len(conf) if threshold is not None else int(k[b])
        for rank, (c, p) in enumerate(conf[:kk]):
            if threshold is None or rank == 0 or c >= threshold:
                out[b, p] = True
    return torch.where(mask, x0, x), out


@pytest.mark.parametrize("threshold", [None, 0.3, 0.99])
def test_transfer_index_matches_reference(threshold):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 12, 9, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(3, 12, generator=g) < 0.6
    mask[2] = False
    x = torch.randint(0, 9, (3, 12), generator=g)
    k = torch.tensor([2, 1, 3])
    x0, transfer = get_transfer_index(logits, 0.0, "low_confidence", mask, x, k, threshold)
    ref_x0, ref_transfer = _reference_transfer(logits, mask, x, k, threshold)
    assert torch.equal(transfer, ref_transfer)
    assert torch.equal(x0[transfer], ref_x0[transfer])
    rows_with_masks = mask.any(1)
    assert (transfer.sum(1)[rows_with_masks] >= 1).all()  # top-1 always committed
    assert not transfer[~mask].any()


def test_random_remasking_commits_k_masked_positions():
    logits = torch.randn(2, 10, 6, dtype=torch.float64)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 2:8] = True
    x0, transfer = get_transfer_index(logits, 0.0, "random", mask, torch.zeros(2, 10, dtype=torch.long),
                                      torch.tensor([3, 6]), None, torch.Generator().manual_seed(0))  # fmt: skip
    assert transfer.sum(1).tolist() == [3, 6]
    assert not transfer[~mask].any()


def test_shift_right_zero_fill():
    logits = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    out = shift_right_zero_fill(logits, 1)
    assert torch.equal(out[:, 0], torch.zeros(2, 3))
    assert torch.equal(out[:, 1:], logits[:, :-1])
    assert shift_right_zero_fill(logits, 0) is logits


def test_geometry():
    assert block_geometry(128, 128, 128, False) == block_geometry(128, None, 128, False)
    g = block_geometry(100, 32, 10, whole_blocks=False)
    assert (g.gen_length, g.num_blocks, g.steps_per_block) == (100, 4, 3)
    g = block_geometry(100, 32, 10, whole_blocks=True)
    assert (g.gen_length, g.num_blocks, g.steps_per_block) == (96, 3, 3)
    g = block_geometry(20, 32, 1, whole_blocks=True)
    assert (g.gen_length, g.num_blocks, g.steps_per_block) == (32, 1, 1)


def test_trim_and_presets():
    assert trim_at_stop([5, 6, 1, 7], {1}) == [5, 6]
    assert trim_at_stop([5, 6], {1}) == [5, 6]
    cfg = build_sampler_config("llada", {"threshold": 0.9, "steps": None})
    assert (cfg.steps, cfg.block_size, cfg.threshold) == (128, 128, 0.9)
    # every sampler owns its config class (its preset as defaults)
    assert all(
        SAMPLERS[n].config_cls not in (SamplerConfig, SAMPLERS["llada"].config_cls)
        for n in SAMPLERS
        if n != "llada"
    )
    with pytest.raises(UserError, match="choose one of"):
        build_sampler_config("nope")
    # what is read before a model loads agrees with the class
    for feature in ("infill", "batching"):
        assert sampler_supports("llada", feature) == getattr(LLaDASampler, f"supports_{feature}")


# ---- llada on a tiny real model --------------------------------------------------------------------


def _llada(model, tok, **over):
    return SAMPLERS["llada"](model, tok, build_sampler_config("llada", over))


def test_no_mask_left_prompt_unchanged_and_blocks_in_order(model, tok):
    sampler = _llada(model, tok, steps=12, max_new_tokens=12, block_size=4)
    rec = Recorder(sampler._forward)
    ps = prompts(tok)
    geo = block_geometry(12, 4, 12, False)
    canvas = build_canvas(ps, geo.gen_length, sampler.mask_id, sampler.fill_id, "cpu")
    nfe, row_nfe, positions = drain(
        iter_block_loop(
            FullForward(rec, canvas), canvas, sampler.config, geo, sampler.mask_id, sampler.fill_id
        )
    )
    x = canvas.x
    m = sampler.mask_id
    assert nfe == 12 and row_nfe.tolist() == [12, 12]
    assert positions.tolist() == [12 * (len(p) + 12) for p in ps]  # each forward: its prompt and window
    for b, p in enumerate(ps):
        assert x[b, : len(p)].tolist() == p
        assert not (x[b, : len(p) + 12] == m).any()
        assert (x[b, len(p) + 12 :] == sampler.fill_id).all()  # filler untouched
    for i, seen in enumerate(rec.calls):  # one token per step, blocks strictly left to right
        block = i // 4  # spb = ceil(12 / 3) = 4 = block size: one token per step
        for b, p in enumerate(ps):
            gen = seen[b, len(p) : len(p) + 12]
            assert int((gen == m).sum()) == 12 - i
            assert not (gen[: block * 4] == m).any() and (gen[(block + 1) * 4 :] == m).all()


def test_threshold_commits_at_least_one_and_never_strands(model, tok):
    # 2 steps for 8-token blocks: a random model is never 0.95-confident, so step 1 commits the top-1
    # only and the block's last step must commit the remaining 7 instead of leaving them masked.
    sampler = _llada(model, tok, steps=4, max_new_tokens=16, block_size=8, threshold=0.95)
    rec = Recorder(sampler._forward)
    sampler._forward = rec
    out = sampler.generate(prompts(tok))
    m = sampler.mask_id
    counts = [int((c == m).sum()) for c in rec.calls] + [0]
    assert all(a - b >= 1 for a, b in zip(counts, counts[1:]))
    assert out.nfe == 4
    ps = prompts(tok)
    second_block = rec.calls[2]  # its first call: the first block is fully committed in every row
    for b, p in enumerate(ps):
        assert not (second_block[b, len(p) : len(p) + 8] == m).any()
    assert all(m not in s for s in out.sequences)


def test_threshold_parallel_commit_with_scripted_model():
    # row 0: positions 3..6 confident (logit 20), row 1: only the top-1 -> NFE drops for row 0 only.
    table = [{p: (7, 20.0) for p in range(3, 7)}, {5: (9, 1.0)}]
    cfg = build_sampler_config("llada", dict(steps=4, max_new_tokens=4, block_size=4, threshold=0.9))
    tok = _FakeTok()
    s = LLaDASampler(None, tok, cfg, forward=scripted_forward(table, [[11, 12, 13], [11, 12]]))
    out = s.generate([[11, 12, 13], [11, 12]])
    assert out.sequences[0] == [7, 7, 7, 7] and out.nfe == 4
    # row 0 committed everything in one forward; the batch continued for row 1
    assert out.sequences[1][3] == 9 and out.row_nfe == [1, 4]


class _FakeTok:
    mask_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def get_vocab(self):
        return {}


def test_eos_per_row_on_ragged_batch():
    # row 0 (short prompt) says EOS at its 2nd new token, confidently, and text before it;
    # row 1 never says EOS. Row 0 stops; row 1 keeps decoding its full window.
    p0, p1 = [11, 12], [11, 12, 13, 14, 15]
    table = [
        {2: (20, 9.0), 3: (1, 12.0), **{q: (21, 3.0) for q in range(4, 8)}},
        {q: (22 + q % 3, 5.0) for q in range(5, 11)},
    ]
    cfg = build_sampler_config("llada", dict(steps=6, max_new_tokens=6, block_size=6, eos_token_id=1))
    s = LLaDASampler(None, _FakeTok(), cfg, forward=scripted_forward(table, [p0, p1]))
    out = s.generate([p0, p1])
    assert out.sequences[0] == [20]
    assert out.sequences[1] == [22 + q % 3 for q in range(5, 11)]
    assert out.row_nfe[0] == 2 and out.row_nfe[1] == 6
    # same as decoding row 1 alone
    alone = LLaDASampler(None, _FakeTok(), cfg, forward=scripted_forward(table[1:])).generate([p1])
    assert alone.sequences == out.sequences[1:]


def test_batched_ragged_equals_one_by_one(model, tok):
    sampler = _llada(model, tok, steps=8, max_new_tokens=8, block_size=4)
    ps = prompts(tok)
    batched = sampler.generate(ps).sequences
    single = [sampler.generate([p]).sequences[0] for p in ps]
    assert batched == single


def test_determinism_with_seed(model, tok):
    ps = prompts(tok)
    a = _llada(model, tok, steps=8, max_new_tokens=8, temperature=1.0, seed=3).generate(ps).sequences
    b = _llada(model, tok, steps=8, max_new_tokens=8, temperature=1.0, seed=3).generate(ps).sequences
    c = _llada(model, tok, steps=8, max_new_tokens=8, temperature=1.0, seed=4).generate(ps).sequences
    assert a == b and a != c


def test_infill_fills_exactly_the_masked_positions(model, tok):
    sampler = _llada(model, tok, steps=8, block_size=8)
    m = sampler.mask_id
    seqs = [[5, 6, m, m, 7, m, 8], [9, m, m, m, m, m, 10, 11, 12, 13, m]]
    out = sampler.infill(seqs)
    for s, o in zip(seqs, out.sequences):
        assert len(o) == len(s) and m not in o
        assert [t for t, q in zip(o, s) if q != m] == [q for q in s if q != m]
    assert out.num_generated_tokens == 9
    assert out.row_positions == [out.nfe * len(s) for s in seqs]  # whole sequences every forward


def test_mask_never_committed_even_if_model_prefers_it():
    table = [{p: (0, 50.0) for p in range(2, 6)}]  # the "model" loves [MASK] (id 0)
    cfg = build_sampler_config("llada", dict(steps=4, max_new_tokens=4))
    out = LLaDASampler(None, _FakeTok(), cfg, forward=scripted_forward(table)).generate([[11, 12]])
    assert 0 not in out.sequences[0] and len(out.sequences[0]) == 4


def test_exact_cache_refused_and_mask_id_required(model, tok):
    with pytest.raises(UserError, match="sampler llada takes cache none or prefix or dual, not 'exact'"):
        _llada(model, tok, cache="exact")

    class NoMask(_FakeTok):
        mask_token_id = None

    with pytest.raises(UserError, match="--mask-id"):
        LLaDASampler(None, NoMask(), build_sampler_config("llada"))
    assert LLaDASampler(None, NoMask(), build_sampler_config("llada"), mask_id=5).mask_id == 5


def test_schedule_steps_commit_counts_without_threshold():
    # 10 masks over 4 steps in one block commit 3, 3, 2, 2 (reference schedule), whatever the logits
    cfg = build_sampler_config("llada", dict(steps=4, max_new_tokens=10, block_size=10))
    rec = Recorder(scripted_forward([{}]))
    s = LLaDASampler(None, _FakeTok(), cfg, forward=rec)
    out = s.generate([[11]])
    masks = [int((c == 0).sum()) for c in rec.calls] + [0]
    committed = [a - b for a, b in zip(masks, masks[1:])]
    # reference (LLaDA): n // steps per step, the remainder spread over the first steps
    want = [10 // 4 + (i < 10 % 4) for i in range(4)]
    assert committed == want == [3, 3, 2, 2]
    assert len(rec.calls) == 4 and masks[0] == 10  # one forward per step, starting from 10 masks
    assert len(out.sequences[0]) == 10 and 0 not in out.sequences[0]
