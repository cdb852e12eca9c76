"""Decoding that stops when the answer does (docs/strategies.md §3.0 "Stopping at EOS"): a row that
commits an EOS with no [MASK] before it leaves the batch's forwards at once and its tokens are those of
the run without the stop (every block sampler, every cache mode); EoTP truncation (`eos_truncate`,
llada and scdd) shortens the forwards to what is left before a committed EOS; the positions computed
and the effective-token ratio (answer tokens ÷ positions) against hand counts. Tiny random Qwen3s in
float64 (test_sampler_caches.py's), scripted forwards where the test needs to choose the tokens."""

from __future__ import annotations

import pytest
import torch
from test_sampler_caches import TEXTS, qwen3

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.diffusion.samplers.llada import LLaDASampler
from dllmflow.errors import UserError
from dllmflow.evaluation.accuracy import Decoded, score_metrics, score_predictions

SMALL = {  # 12 new tokens, blocks of 4
    "llada": dict(steps=12, max_new_tokens=12, block_size=4),
    "llada2": dict(steps=4, max_new_tokens=12, block_size=4),
    "nemotron": dict(steps=12, max_new_tokens=12, block_size=4),
    "idlm": dict(steps=12, max_new_tokens=12, block_size=4),
    "scdd": dict(steps=6, max_new_tokens=12),
}
MODES = [("llada", {"cache": c}) for c in ("none", "prefix", "dual")]
MODES += [("llada", {"threshold": 0.05})]
MODES += [(n, {"cache": c}) for n in ("llada2", "nemotron", "idlm") for c in ("exact", "none")]
MODES += [("llada2", {"temperature": 1.0})]  # sampled: the stopped row's noise is still drawn


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")


@pytest.fixture(scope="module")
def model(tok):
    model = qwen3(tok, 2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # varied argmaxes: rows that write different tokens
    return model


def make(name, model, tok, **over):
    cfg = build_sampler_config(name, {**SMALL[name], **over}, tok)
    return SAMPLERS[name](model, tok, cfg.model_copy(update={"eos_token_id": over.get("eos_token_id")}))


def run(sampler, ps):
    """(untrimmed windows, row nfe, row positions, batch size of every model forward)."""
    batches = []
    hook = sampler.model.register_forward_pre_hook(
        lambda m, a, kw: batches.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            seqs, _, row_nfe, positions = sampler._generate(ps)
    finally:
        hook.remove()
    return seqs, row_nfe, positions, batches


@pytest.mark.parametrize("name, over", MODES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in MODES])
def test_a_stopped_row_leaves_the_forwards_and_keeps_its_tokens(model, tok, name, over):
    ps = [tok.encode("What is 2 + 3?"), tok.encode("Natalia sold 48 clips in April")]
    full, _, full_positions, _ = run(make(name, model, tok, **over), ps)
    # the EOS: row 0's earliest token that row 1 never writes (so row 1 decodes its whole window)
    at, eos = next((i, t) for i, t in enumerate(full[0]) if t not in full[1])
    assert at < 8, "the tiny model should let row 0 stop before its last block"
    seqs, row_nfe, positions, batches = run(make(name, model, tok, eos_token_id=eos, **over), ps)
    assert seqs[0][: at + 1] == full[0][: at + 1] and seqs[1] == full[1]  # exact: the same tokens
    assert batches[0] == 2 and batches[-1] == 1 and batches == sorted(batches, reverse=True)
    assert positions[0] < full_positions[0] and positions[1] == full_positions[1]


def scripted(table: dict[int, tuple[int, float]], widths: list[int]):
    """A one-row fake model: logits[p] = table[p] (token, logit) on a flat background; keeps widths."""

    def forward(x, attn):
        widths.append(int(attn.sum()))
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        logits[..., 30] = 0.5
        for p, (t, v) in table.items():
            if p < x.shape[1]:
                logits[:, p, t] = v
        return logits

    return forward


class _FakeTok:
    mask_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def get_vocab(self):
        return {}


@pytest.mark.parametrize("truncate, positions", [(False, 4 * 8), (True, 8 + 3 * 6)])
def test_eos_truncation_computes_only_the_positions_before_the_eos(truncate, positions):
    # prompt of 2, window [2, 8): the EOS at 5 is the most confident, committed first; 2, 3, 4 follow
    # one a step (6 masks over 6 steps). Truncated, the forwards after the first see [0, 6) only.
    table = {5: (1, 12.0), 2: (20, 9.0), 3: (21, 8.0), 4: (22, 7.0), 6: (23, 3.0), 7: (24, 3.0)}
    cfg = build_sampler_config("llada", dict(steps=6, max_new_tokens=6, block_size=6, eos_token_id=1,
                                             eos_truncate=truncate))  # fmt: skip
    widths: list[int] = []
    out = LLaDASampler(None, _FakeTok(), cfg, forward=scripted(table, widths)).generate([[11, 12]])
    assert out.sequences == [[20, 21, 22]] and out.nfe == 4  # the same answer, stopped at its EOS
    assert out.row_positions == [positions] and sum(widths) == positions
    # the effective-token ratio, by hand: 3 answer tokens over the positions computed
    (pred,) = _scored([out.sequences[0]], [(out.row_nfe[0], out.row_positions[0])])
    assert pred["effective_token_ratio"] == 3 / positions and pred["tokens_per_forward"] == 3 / 4


class _DecodeTok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _scored(sequences, costs):
    """Predictions of `sequences` (one row each) with their (forwards, positions) costs."""
    rows = [{"id": i, "answer": "#### 0"} for i in range(len(sequences))]
    decoded = Decoded(dict(enumerate(sequences)), dict(enumerate(costs)), elapsed_s=2.0)
    return score_predictions(rows, [[{"content": "q"}]] * len(rows), decoded, _DecodeTok())


def test_score_metrics_ratio_over_all_answers():
    answers = [[7, 8, 9], [1, 2, 3, 4, 0]]  # 3 and 5 tokens; the second ends in the right answer
    m = score_metrics(_scored(answers, [(4, 26), (6, 40)]), elapsed=2.0)
    assert m["effective_token_ratio"] == 8 / 66 and m["positions_per_answer"] == 33.0
    assert m["nfe"] == 5.0 and m["tokens_per_forward"] == 8 / 10 and m["tokens_per_s"] == 8 / 2.0
    assert m["exact_match_flexible"] == 0.5 and m["exact_match_strict"] == 0.0
    assert "effective_token_ratio" not in score_metrics(_scored(answers, [(4, None), (6, None)]), 2.0)


def test_llada_eos_truncate_on_the_tiny_model_computes_less_and_strands_no_mask(model, tok):
    ps = [tok.encode("What is 2 + 3?"), tok.encode("Natalia sold 48 clips in April")]
    base = make("llada", model, tok, block_size=12)  # one block: the whole canvas every forward
    full, _, full_positions, _ = run(base, ps)
    cut = make("llada", model, tok, block_size=12, eos_truncate=True, eos_token_id=full[0][3])
    seqs, _, positions, _ = run(cut, ps)
    assert positions[0] < full_positions[0] and all(cut.mask_id not in s for s in seqs)


def test_scdd_eos_truncate_cuts_the_canvas_and_stops_the_row():
    # EOS (1) is the model's pick at window position 2 (canvas 4), a plain token (20) elsewhere
    table = {4: (1, 30.0), **{p: (20, 30.0) for p in (2, 3, 5, 6, 7, 8, 9)}}
    cfg = build_sampler_config("scdd", dict(steps=8, max_new_tokens=8, eos_truncate=True))
    widths: list[int] = []
    sampler = SAMPLERS["scdd"](None, _FakeTok(), cfg, forward=scripted(table, widths))
    out = sampler.generate([[11, 12]])
    assert out.sequences == [[20, 20]]  # the answer up to its EOS, no mask left
    assert out.nfe == len(widths) <= 9 and out.row_positions == [sum(widths)]
    assert min(widths) == 5 and sum(widths) < 9 * 10  # [0, 5) once the EOS is in; the full run: 9 x 10


@pytest.mark.parametrize("cache", ["exact", "none"])
def test_ar_positions_prefill_then_one_a_token(model, tok, cache):
    ps = [tok.encode("What is 2 + 3?"), tok.encode("Natalia sold 48 clips in April")]
    cfg = build_sampler_config("ar", {"max_new_tokens": 6, "cache": cache}, tok)
    out = SAMPLERS["ar"](model, tok, cfg).generate(ps)
    if cache == "exact":  # the prompt once, then the last token per forward: a ratio near 1 on long answers
        assert out.row_positions == [len(p) + n - 1 for p, n in zip(ps, out.row_nfe)]
    else:  # every forward recomputes the prompt and the answer so far
        assert out.row_positions == [sum(len(p) + i for i in range(n)) for p, n in zip(ps, out.row_nfe)]


def test_eos_truncate_refused_with_a_cache():
    for name in ("llada", "scdd"):
        with pytest.raises(UserError, match="eos_truncate"):
            build_sampler_config(name, {"eos_truncate": True, "cache": "prefix"})
