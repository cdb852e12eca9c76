"""The scdd, llada2, nemotron and idlm samplers (docs/strategies.md §3.2-3.6): math against direct reference formulas,
properties on a tiny random Qwen3 (float64, so equalities are not at the mercy of near-ties), and
scripted stand-in models whose logits the test controls."""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.diffusion.masks.block_causal import block_causal_keep, block_causal_mask
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config, sampler_supports
from dllmflow.diffusion.samplers.idlm import IDLMSampler
from dllmflow.diffusion.samplers.llada2 import LLaDA2Sampler
from dllmflow.diffusion.samplers.loop import build_left_padded_canvas
from dllmflow.diffusion.samplers.nemotron import NemotronSampler
from dllmflow.diffusion.samplers.scdd import SCDDSampler, scdd_step_probs
from dllmflow.diffusion.schedules import scdd_schedule
from dllmflow.errors import UserError
from dllmflow.inference.generate import add_cli_args, check_sampler_fits, cli_main, validate_sampler_request
from dllmflow.settings import load_settings

TEXTS = ["Natalia sold 48 clips in April and half as many in May. #### 72", "What is 2 + 3? The answer is 5."]
SMALL = {  # tiny settings per sampler: 8 new tokens, blocks of 4
    "scdd": dict(steps=6, max_new_tokens=8),
    "llada2": dict(steps=4, max_new_tokens=8, block_size=4),
    "nemotron": dict(steps=8, max_new_tokens=8, block_size=4),
    "idlm": dict(steps=8, max_new_tokens=8),
}


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip
    return Qwen3ForCausalLM(cfg).double().eval()


def prompts(tok):
    return [tok.encode("What is 2 + 3?"), tok.encode("Natalia sold 48 clips in April")]  # lengths differ


def make(name, model, tok, **over):
    cfg = build_sampler_config(name, {**SMALL[name], **over}, tok)
    if "eos_token_id" in over and over["eos_token_id"] is None:
        cfg = cfg.model_copy(update={"eos_token_id": None})
    return SAMPLERS[name](model, tok, cfg)


def raw_generate(sampler, ps):
    """Untrimmed generated windows (the stop-id trim would hide what the sampler wrote)."""
    with torch.inference_mode():
        return sampler._generate(ps)[0]


class _FakeTok:
    mask_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def get_vocab(self):
        return {}


def record_inputs(model):
    """Keep the input_ids of every model call (a forward pre-hook)."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True
    )
    return seen, handle


# ---- the block-causal mask vs the rules written out ------------------------------------------------


@pytest.mark.parametrize("causal_prefix", [True, False])
def test_block_causal_mask_matches_rules(causal_prefix):
    S, bs, T = 3, 2, 8
    valid = torch.ones(2, T, dtype=torch.long)
    valid[1, 0] = 0  # a left pad
    mask = block_causal_mask(valid, S, bs, causal_prefix, torch.float64)
    for b, q, k in itertools.product(range(2), range(T), range(T)):
        if q < S:
            rule = k < S and (k <= q or not causal_prefix)
        else:
            rule = k < S or (q - S) // bs >= (k - S) // bs
        expected = (rule and bool(valid[b, k])) or q == k
        assert (mask[b, 0, q, k] == 0) == expected, (b, q, k)
    assert mask.min() == torch.finfo(torch.float64).min
    # the rows of one block against the keys up to its end are a slice of the full mask
    part = block_causal_mask(valid[:, :7], S, bs, causal_prefix, torch.float64, q_start=5, q_len=2)
    assert torch.equal(part, mask[:, :, 5:7, :7])
    assert block_causal_keep(torch.tensor(4), torch.tensor(3), S, bs, causal_prefix)  # block sees its own


# ---- scdd ------------------------------------------------------------------------------------------


def _bayes_posterior(p, c, mask_id, t, s, r):
    """q(z_s | z_t = c) by Bayes over an explicit transition matrix s -> t and the marginals at s."""
    V = p.shape[0]
    K = V - 1
    at_t, at_s = (
        scdd_schedule(torch.tensor(t, dtype=torch.float64), r),
        scdd_schedule(torch.tensor(s, dtype=torch.float64), r),
    )
    alpha = float(at_t.clean / at_s.clean)
    beta = float(at_t.gamma / at_s.gamma) - alpha
    eta = 1 - alpha - beta
    Q = torch.zeros(V, V, dtype=torch.float64)  # Q[v, c] = P(z_t = c | z_s = v)
    for v in range(V):
        if v == mask_id:
            Q[v, mask_id] = 1.0
            continue
        for w in range(V):
            if w != mask_id:
                Q[v, w] = beta / K + (alpha if w == v else 0.0)
        Q[v, mask_id] = eta
    joint = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        if x == mask_id:
            continue
        marg_s = torch.full((V,), float(at_s.uniform) / K, dtype=torch.float64)
        marg_s[x] += float(at_s.clean)
        marg_s[mask_id] = float(at_s.absorbed)
        joint += p[x] * marg_s * Q[:, c]
    total = joint.sum()  # 0: z_t = c is impossible (a visible token at t = 1); the sampler keeps it
    return joint / total if total > 0 else joint


@pytest.mark.parametrize("r,t,s", [(0.1, 0.7, 0.6), (0.2, 0.35, 0.3), (0.1, 1.0, 0.9), (0.0, 0.5, 0.4)])
def test_scdd_posterior_matches_bayes(r, t, s):
    V, M = 7, 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
    logits[M] = -math.inf
    log_p = torch.log_softmax(logits, -1)
    current = torch.tensor([M, 0, 5, 6])  # one masked row, three visible
    cfg = build_sampler_config("scdd", {"uniform_ratio": r})
    probs = scdd_step_probs(log_p.expand(4, V), current, M, t, s, cfg)
    for row, c in enumerate(current.tolist()):
        ref = _bayes_posterior(log_p.exp(), c, M, t, s, r)
        assert torch.allclose(probs[row], ref, atol=1e-10), (row, probs[row], ref)
        if c != M and t < 1:
            assert probs[row, M] == 0  # never re-masked
            assert math.isclose(float(probs[row].sum()), 1.0, abs_tol=1e-10)  # the closed-form normaliser


def test_scdd_overwrites_a_token_it_changes_its_mind_about():
    calls = []

    def fickle(x, attn):  # prefers 7 for the first 16 forwards, then 9 (vocab 40, mask 0)
        calls.append(x.clone())
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        logits[..., 7 if len(calls) <= 16 else 9] = 20.0
        return logits

    cfg = build_sampler_config("scdd", dict(steps=32, max_new_tokens=8))
    out = SCDDSampler(None, _FakeTok(), cfg, forward=fickle).generate([[11, 12]])
    assert out.sequences == [[9] * 8] and out.nfe == 33
    window = torch.stack([c[0, 2:10] for c in calls])  # [33, 8] the canvas each forward saw
    assert ((window[:-1] == 7) & (window[1:] == 9)).any()  # a visible 7 rewritten to 9 during the walk
    assert not ((window[:-1] != 0) & (window[1:] == 0)).any()  # and never re-masked


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scdd_uniform_ratio_zero_terminates_and_never_rewrites(model, tok, temperature):
    sampler = make("scdd", model, tok, uniform_ratio=0.0, temperature=temperature, steps=8)
    seen, handle = record_inputs(model)
    try:
        out = raw_generate(sampler, prompts(tok))
    finally:
        handle.remove()
    assert all(len(s) == 8 and sampler.mask_id not in s for s in out)
    m = sampler.mask_id
    for a, b in zip(seen[:-1], seen[1:]):  # r = 0 is MDLM: a visible token stays as it is
        assert torch.equal(a[a != m], b[a != m])


def test_scdd_schedule_comes_from_training_and_mismatch_warns(model, tok):
    trained = load_settings("params/tiny_scdd.yaml", dllm={"mode": "scdd", "vocab_size": 512, "uniform_ratio": 0.2,
                                                          "schedule_peak": 0.4})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = SCDDSampler(model, tok, build_sampler_config("scdd"), training_settings=trained)
    assert (s.config.uniform_ratio, s.config.schedule_shape, s.config.schedule_peak) == (0.2, 1.0, 0.4)
    with pytest.warns(UserWarning, match="--uniform_ratio 0.3 but the checkpoint was trained with 0.2"):
        s = SCDDSampler(
            model, tok, build_sampler_config("scdd", {"uniform_ratio": 0.3}), training_settings=trained
        )
    assert s.config.uniform_ratio == 0.3  # the explicit flag still wins
    # nothing is read from the model: without training settings the sampler's own preset stays
    assert SCDDSampler(model, tok, build_sampler_config("scdd")).config.uniform_ratio != 0.2
    # other modes carry no SCDD schedule: the sampler's own defaults stay
    hybrid = load_settings("params/tiny_hybrid.yaml")
    assert (
        SCDDSampler(model, tok, build_sampler_config("scdd"), training_settings=hybrid).config.uniform_ratio
        == 0.1
    )


# ---- every sampler: the common properties ----------------------------------------------------------


@pytest.mark.parametrize("name", list(SMALL))
def test_no_mask_left_full_window_and_prompt_unchanged(model, tok, name):
    # the uncached path shows the whole canvas (nemotron, llada2 and idlm cache by default)
    over = {"cache": "none"} if name in ("nemotron", "llada2", "idlm") else {}
    sampler = make(name, model, tok, eos_token_id=None, **over)
    ps = prompts(tok)
    batches = [ps] if sampler.supports_batching else [[p] for p in ps]
    for batch in batches:
        seen, handle = record_inputs(model)
        try:
            out = raw_generate(sampler, batch)
        finally:
            handle.remove()
        assert [len(s) for s in out] == [8] * len(batch)
        assert all(sampler.mask_id not in s for s in out)
        S = max(map(len, batch))
        for canvas in seen:
            for b, p in enumerate(batch):
                # nemotron and llada2 left-pad the prompts to S; the others left-align them
                where = slice(S - len(p), S) if name in ("nemotron", "llada2") else slice(0, len(p))
                assert canvas[b, where].tolist() == p


@pytest.mark.parametrize("name", list(SMALL))
def test_determinism_with_seed(model, tok, name):
    ps = prompts(tok)
    a = make(name, model, tok, temperature=1.0, seed=3).generate(ps).sequences
    b = make(name, model, tok, temperature=1.0, seed=3).generate(ps).sequences
    c = make(name, model, tok, temperature=1.0, seed=4).generate(ps).sequences
    assert a == b and a != c


@pytest.mark.parametrize("name", ["llada2", "nemotron", "idlm"])
def test_threshold_commits_at_least_one_per_forward(model, tok, name):
    # a random model is never 0.99-confident: each step commits its top-1 (at least), never nothing
    over = {"cache": "none"}  # the uncached path shows the whole canvas
    sampler = make(name, model, tok, threshold=0.99, eos_token_id=None, **over)
    (p,) = prompts(tok)[:1]
    seen, handle = record_inputs(model)
    try:
        (out,) = raw_generate(sampler, [p])
    finally:
        handle.remove()
    T, m = len(p) + 8, sampler.mask_id
    # masks left in the window each call saw (llada2 cuts the canvas after the current block)
    left = [T - c.shape[1] + int((c[0, len(p) :] == m).sum()) for c in seen] + [0]
    assert all(a - b >= 1 for a, b in zip(left, left[1:])), left
    assert m not in out


@pytest.mark.parametrize("name", ["scdd", "llada2", "nemotron", "idlm"])
def test_batched_ragged_prompts_decode_in_one_batch(model, tok, name):
    sampler = make(name, model, tok, eos_token_id=None)
    assert sampler.supports_batching
    ps = prompts(tok)
    seen, handle = record_inputs(model)
    try:
        batched = raw_generate(sampler, ps)
    finally:
        handle.remove()
    assert all(c.shape[0] == 2 for c in seen)  # one batch, not a loop
    assert all(len(s) == 8 and sampler.mask_id not in s for s in batched)
    if name != "scdd":  # greedy: each row as if alone (scdd draws from one RNG stream for the batch)
        assert batched == [raw_generate(sampler, [p])[0] for p in ps]


@pytest.mark.parametrize("name", ["llada", "idlm"])
@pytest.mark.parametrize(
    "over",
    [{}, {"temperature": 0.7}, {"remasking": "random", "temperature": 0.5}, {"threshold": 0.3}],
    ids=["greedy", "sampled", "random-remasking", "threshold"],
)
def test_block_sampler_heads_only_the_generation_windows_same_tokens(model, tok, name, over):
    # llada and idlm take logits for the suffix that holds every row's current block (idlm: one position
    # more, its logit shift); a forward that cannot (the plain two-argument one the harness hands in)
    # gives full logits. Both must commit the same tokens at the same forwards, whatever the RNG draws.
    ps = [
        tok.encode("What is 2 + 3?"),
        tok.encode("Natalia sold 48 clips in April and May"),
        tok.encode("Hi"),
    ]
    small = dict(steps=8, max_new_tokens=8, block_size=4)  # two blocks of 4
    uncached = {"cache": "none"} if name == "idlm" else {}  # the canvas path is the one under test
    kept = SAMPLERS[name](model, tok, build_sampler_config(name, {**small, **over, **uncached}, tok))
    full = SAMPLERS[name](model, tok, kept.config, forward=lambda ids, mask: kept.model_forward(ids, mask))
    head_rows = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, a: head_rows.append(a[0].shape[1]))
    try:
        with torch.inference_mode():
            out_kept = kept._generate(ps)
            rows_kept, head_rows[:] = list(head_rows), []
            out_full = full._generate(ps)
    finally:
        handle.remove()
    assert out_kept == out_full  # sequences, nfe, per-row nfe
    total = max(map(len, ps)) + 8
    shift = 1 if name == "idlm" else 0
    assert set(head_rows) == {total}  # the full path heads every position
    # the kept path: from the earliest row's block start on, block j starting j * 4 after its prompt
    assert set(rows_kept) == {total - (min(map(len, ps)) + 4 * j) + shift for j in (0, 1)}


def test_llada2_batch_with_editing_and_eos_decodes_each_row_as_alone(model, tok):
    # editing (per-row post-steps) and an EOS stop per row: the batch still equals each row alone
    sharp = copy.deepcopy(model)  # confident enough (lm_head x30) for edits above the threshold
    with torch.no_grad():
        sharp.lm_head.weight.mul_(30)
    ps = prompts(tok) + [tok.encode("How many?")]
    editing = dict(editing_threshold=0.3, max_post_steps=3)
    eos = raw_generate(make("llada2", sharp, tok, eos_token_id=None, **editing), ps[:1])[0][0]
    sampler = make("llada2", sharp, tok, eos_token_id=eos, **editing)
    seen, handle = record_inputs(sharp)
    try:
        out = sampler.generate(ps)
    finally:
        handle.remove()
    alone = [sampler.generate([p]) for p in ps]
    batch = [c.shape[0] for c in seen[: out.nfe]]  # a row stopped at its EOS leaves the forwards
    assert batch[0] == 3 and batch[-1] < 3 and batch == sorted(batch, reverse=True)
    assert out.sequences == [a.sequences[0] for a in alone]
    assert out.row_nfe == [a.nfe for a in alone] and out.nfe == max(out.row_nfe)
    assert len(set(out.row_nfe)) == 3  # the rows really leave at different forwards
    unedited = make("llada2", sharp, tok, eos_token_id=eos).generate(ps)
    assert unedited.sequences != out.sequences  # and edits really happened


def test_llada2_checkpoint_generate_runs_one_prompt_at_a_time(model):
    calls = []

    class Recording(NativeLLaDA2):
        def generate(self, inputs, temperature, block_length, steps, gen_length, eos_early_stop, threshold,
                     eos_id, mask_id):  # fmt: skip
            calls.append(inputs.tolist())
            return super().generate(inputs, temperature, block_length, steps, gen_length, eos_early_stop,
                                    threshold, eos_id, mask_id)  # fmt: skip

    out = LLaDA2Sampler(Recording(model.config), _FakeTok(), build_sampler_config("llada2")).generate(
        [[11, 12], [13]]
    )
    assert calls == [[[11, 12]], [[13]]] and out.nfe == 2 and out.sequences == [[5, 6, 7], [5, 6, 7]]


# ---- nemotron: cache == no cache, per-row EOS ------------------------------------------------------


@pytest.mark.parametrize("causal_context", [True, False])
def test_nemotron_kv_cache_equals_no_cache(model, tok, causal_context):
    ps = prompts(tok)
    runs = {}
    for cache in (True, False):
        s = make("nemotron", model, tok, max_new_tokens=24, steps=24, block_size=8, threshold=0.3,
                 cache="exact" if cache else "none", causal_context=causal_context, eos_token_id=None)  # fmt: skip
        seen, handle = record_inputs(model)
        try:
            runs[cache] = (raw_generate(s, ps), seen)
        finally:
            handle.remove()
    assert runs[True][0] == runs[False][0]
    assert all(sum(map(len, r)) == 48 for r in (runs[True][0],))
    # the cached steps see one block; the uncached ones the whole canvas
    S = max(map(len, ps))
    widths = {c.shape[1] for c in runs[True][1]}
    assert widths == {S, 8} and {c.shape[1] for c in runs[False][1]} == {S + 24}


@pytest.mark.parametrize("use_cache", [True, False])
def test_nemotron_ar_seed_is_the_causal_next_token(model, tok, use_cache):
    # the prompt is prefilled causally: block 0's first token is the plain causal LM's greedy next token
    ps = prompts(tok)
    out = raw_generate(make("nemotron", model, tok, cache="exact" if use_cache else "none", causal_context=True,
                            eos_token_id=None), ps)  # fmt: skip
    for p, gen in zip(ps, out):
        logits = model(input_ids=torch.tensor([p])).logits[0, -1]
        logits[tok.mask_token_id] = -math.inf
        assert gen[0] == int(logits.argmax())


class ScriptedLM(torch.nn.Module):
    """A stand-in decoder: logits at (row, position id) come from a table, on a flat background."""

    def __init__(self, table, vocab=40):
        super().__init__()
        self.config = Qwen3Config(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=8)  # fmt: skip
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.table, self.vocab = table, vocab

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, logits_to_keep=0
    ):
        logits = torch.zeros(*input_ids.shape, self.vocab, dtype=torch.float64)
        logits[..., 30] = 0.5
        for b, row in enumerate(self.table):
            for pos, (tok_id, value) in row.items():
                logits[b, position_ids[b] == pos, tok_id] = value
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("use_cache", [True, False])
def test_nemotron_per_row_eos_and_ar_seed(use_cache):
    # row 0: the AR seed (logit of position 1) says 20, then an EOS at position 3 -> row 0 stops;
    # row 1 never says EOS and decodes both blocks.
    table = [{1: (20, 9.0), 3: (1, 12.0)}, {}]
    cfg = build_sampler_config("nemotron", dict(max_new_tokens=8, steps=8, block_size=4, eos_token_id=1,
                                                cache="exact" if use_cache else "none", causal_context=True))  # fmt: skip
    s = NemotronSampler(ScriptedLM(table), _FakeTok(), cfg)
    out = s.generate([[11, 12], [11, 12, 13, 14]])
    assert out.sequences == [[20], [30] * 8]
    # row 0: prompt pass + 1 step; row 1: prompt pass, 3 steps, block commit, 3 steps
    assert out.row_nfe == [2, 8] and out.nfe == 8
    alone = NemotronSampler(ScriptedLM(table[1:]), _FakeTok(), cfg).generate([[11, 12, 13, 14]])
    assert alone.sequences == out.sequences[1:]


def test_left_padded_canvas():
    c = build_left_padded_canvas([[5, 6], [7, 8, 9]], 2, 0, 1, "cpu")
    assert c.x.tolist() == [[1, 5, 6, 0, 0], [7, 8, 9, 0, 0]]
    assert c.valid.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert c.position_ids.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]] and c.prefix_len == 3


# ---- idlm: the logit at p-1 fills p ----------------------------------------------------------------


def test_idlm_reads_the_preceding_position():
    def position_coded(x, attn):  # logits at q favour token 3 + q (vocab 40)
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        for q in range(x.shape[1]):
            logits[:, q, 3 + q] = 5.0
        return logits

    cfg = build_sampler_config("idlm", dict(max_new_tokens=8, steps=8), _FakeTok())
    out = IDLMSampler(None, _FakeTok(), cfg, forward=position_coded).generate([[11, 12, 13], [11]])
    assert out.sequences[0] == [3 + p - 1 for p in range(3, 11)]
    assert out.sequences[1] == [3 + p - 1 for p in range(1, 9)]


def test_idlm_forward_is_causal(model, tok):
    # the default forward is the model's causal one: a later token changes no earlier logit
    s = make("idlm", model, tok)
    x = torch.tensor([prompts(tok)[1]])
    a = s._forward(x, torch.ones_like(x))
    y = x.clone()
    y[0, -1] = s.mask_id
    b = s._forward(y, torch.ones_like(y))
    assert torch.allclose(a[0, :-1], b[0, :-1]) and not torch.allclose(a[0, -1], b[0, -1])


def test_idlm_per_row_eos():
    def fwd(x, attn):  # row 0 (prompt 11 12 13) says EOS (1) for position 3 (logit at 2); row 1 never
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        logits[..., 30] = 0.5
        logits[x[:, 2] == 13, 2, 1] = 9.0  # a forward holds only the rows still decoding
        return logits

    cfg = build_sampler_config("idlm", dict(max_new_tokens=8, steps=8, block_size=4), _FakeTok())
    out = IDLMSampler(None, _FakeTok(), cfg, forward=fwd).generate([[11, 12, 13], [11, 12]])
    assert out.sequences == [[], [30] * 8]
    assert out.row_nfe[0] < out.row_nfe[1]


# ---- llada2: refinement with a threshold, editing, the model's own generate -------------------------


def test_llada2_editing_rewrites_committed_tokens():
    calls = []

    def fickle(x, attn, *_):  # 7 everywhere while filling, then 9 confidently
        calls.append(x.shape[1])
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        masks_left = bool((x[0, 2:] == 0).any())
        logits[..., 7 if masks_left else 9] = 20.0
        return logits

    def run(**over):
        calls.clear()
        cfg = build_sampler_config("llada2", dict(max_new_tokens=8, block_size=4, steps=4, **over))
        return LLaDA2Sampler(None, _FakeTok(), cfg, forward=fickle).generate([[11, 12]])

    plain = run()
    assert plain.sequences == [[7] * 8] and plain.nfe == 2  # threshold 0.5: each block in one forward
    edited = run(editing_threshold=0.9)
    # block 0: fill (7s), post-step 1 edits to 9s, post-step 2 edits nothing -> stop; block 1 the same
    assert edited.sequences == [[9] * 8] and edited.nfe == 6


def test_llada2_post_steps_are_bounded():
    def flipper(x, attn, *_):  # changes its mind on every forward
        flipper.n += 1
        logits = torch.zeros(*x.shape, 40, dtype=torch.float64)
        logits[..., 7 + flipper.n % 2] = 20.0
        return logits

    flipper.n = 0
    cfg = build_sampler_config("llada2", dict(max_new_tokens=4, block_size=4, steps=4, editing_threshold=0.5,
                                              max_post_steps=3))  # fmt: skip
    out = LLaDA2Sampler(None, _FakeTok(), cfg, forward=flipper).generate([[11]])
    assert out.nfe == 1 + 3


class NativeLLaDA2(Qwen3ForCausalLM):
    """Stand-in for LLaDA2.0 remote code: its own generate (no editing arguments), generated ids only."""

    def generate(self, inputs, temperature, block_length, steps, gen_length, eos_early_stop, threshold, eos_id,
                 mask_id):  # fmt: skip
        self.got = dict(block_length=block_length, steps=steps, gen_length=gen_length, threshold=threshold,
                        eos_id=eos_id, mask_id=mask_id, prompt=inputs.tolist())  # fmt: skip
        self.lm_head(
            torch.zeros(1, self.config.hidden_size, dtype=self.lm_head.weight.dtype)
        )  # one "forward"
        return torch.tensor([[5, 6, 7]])


class NativeNemotron(Qwen3ForCausalLM):
    """Stand-in for Nemotron-Labs-Diffusion remote code: generate -> (prompt + ids, nfe)."""

    def generate(
        self, prompt, max_new_tokens, block_length, threshold, temperature, causal_context, eos_token_id
    ):
        self.got = dict(
            max_new_tokens=max_new_tokens, block_length=block_length, causal_context=causal_context
        )
        return torch.cat([prompt, torch.tensor([[8, 9]])], dim=1), 3


def test_native_generate_is_used_when_the_checkpoint_has_one(model, tok):
    m = NativeLLaDA2(model.config)
    out = LLaDA2Sampler(m, tok, build_sampler_config("llada2")).generate([[11, 12]])
    assert out.sequences == [[5, 6, 7]] and out.nfe == 1
    assert m.got["steps"] == 32 and m.got["block_length"] == 32 and m.got["gen_length"] == 128
    assert (
        m.got["threshold"] == 0.5 and m.got["prompt"] == [[11, 12]] and m.got["mask_id"] == tok.mask_token_id
    )
    n = NativeNemotron(model.config)
    out = NemotronSampler(n, tok, build_sampler_config("nemotron", {"max_new_tokens": 40}, tok)).generate(
        [[11, 12]]
    )
    assert out.sequences == [[8, 9]] and out.nfe == 3
    assert n.got == dict(max_new_tokens=32, block_length=32, causal_context=True)


# ---- bad input -------------------------------------------------------------------------------------


CAPABILITIES = {  # docs/strategies.md §3.1-3.6
    "llada": dict(infill=True, batching=True, cache=("none", "prefix", "dual")),
    "scdd": dict(infill=False, batching=True, cache=("none", "prefix")),
    "llada2": dict(infill=False, batching=True, cache=("exact", "none")),
    "nemotron": dict(infill=False, batching=True, cache=("exact", "none")),
    "gemma": dict(infill=False, batching=False, cache=("none",)),
    "idlm": dict(infill=False, batching=True, cache=("exact", "none")),
    "ar": dict(infill=False, batching=True, cache=("exact", "none")),  # §3.9
    "selfspec": dict(infill=False, batching=True, cache=("exact",)),  # §3.10: drafts checked on the cache
}


def test_capability_table_agrees_with_every_sampler_class():
    assert set(CAPABILITIES) == set(SAMPLERS)
    for name in SAMPLERS:
        for feature in ("infill", "batching"):
            assert CAPABILITIES[name][feature] == getattr(SAMPLERS[name], f"supports_{feature}")
            assert sampler_supports(name, feature) == CAPABILITIES[name][feature]
        assert SAMPLERS[name].config_cls.cache_modes == CAPABILITIES[name]["cache"]


def test_unknown_sampler_and_infill_refused_before_loading(tmp_path):
    with pytest.raises(UserError, match="unknown sampler 'nope'"):
        validate_sampler_request("nope")
    for name in ("scdd", "llada2", "nemotron", "idlm"):
        with pytest.raises(UserError, match="--infill works with: llada"):
            validate_sampler_request(name, infill=True)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--checkpoint", str(tmp_path / "missing"), "--prompt", "a [MASK]", "--infill",
                              "--sampler", "scdd"])  # fmt: skip
    with pytest.raises(UserError, match="cannot infill"):  # not "does not exist": no load was tried
        cli_main(args)


@pytest.mark.parametrize("name", ["scdd", "llada"])  # bidirectional: no exact cache
def test_exact_cache_refused(name):
    with pytest.raises(UserError, match=f"--cache: .*sampler {name} takes cache none or prefix.*not 'exact'"):
        build_sampler_config(name, {"cache": "exact"})


@pytest.mark.parametrize("name", list(SMALL))
def test_use_kv_cache_refused_naming_cache(model, tok, name):
    with pytest.raises(UserError, match=r"^use_kv_cache was replaced by cache: exact"):
        make(name, model, tok, use_kv_cache=True)


@pytest.mark.parametrize("name", list(SMALL))
def test_missing_mask_id(name):
    class NoMask(_FakeTok):
        mask_token_id = None

    with pytest.raises(UserError, match="--mask-id"):
        SAMPLERS[name](None, NoMask(), build_sampler_config(name, SMALL[name]))


def test_incompatible_sampler_warns_with_the_fitting_ones():
    hybrid = load_settings("params/tiny_hybrid.yaml")
    with pytest.warns(UserWarning, match="Samplers that fit: nemotron, llada"):
        check_sampler_fits("scdd", hybrid)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_sampler_fits("nemotron", hybrid) is None


def test_cli_reads_the_training_schedule_from_the_checkpoint(model, tok, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    load_settings(
        "params/tiny_scdd.yaml", dllm={"mode": "scdd", "vocab_size": 512, "uniform_ratio": 0.2}
    ).write_json(ckpt / "settings.json")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    base = [
        "--checkpoint",
        str(ckpt),
        "--prompt",
        "What is 2 + 3?",
        "--raw",
        "--steps",
        "2",
        "--max_new_tokens",
        "4",
    ]
    with pytest.warns(UserWarning) as record:
        assert cli_main(parser.parse_args(base + ["--sampler", "scdd", "--uniform_ratio", "0.3"])) == 0
    assert any("trained with 0.2" in str(w.message) for w in record)
    with pytest.warns(UserWarning, match="Samplers that fit: scdd, llada"):
        cli_main(parser.parse_args(base + ["--sampler", "idlm"]))
    assert ">>> What is 2 + 3?" in capsys.readouterr().out


def test_llada2_editing_flags_reach_the_config():
    from dllmflow.inference.generate import sampler_overrides

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--checkpoint", "x", "--prompt", "a", "--sampler", "llada2", "--editing_threshold", "0.7",
                              "--max_post_steps", "4"])  # fmt: skip
    cfg = build_sampler_config("llada2", sampler_overrides(args))
    assert (cfg.editing_threshold, cfg.max_post_steps, cfg.steps, cfg.threshold) == (0.7, 4, 32, 0.5)
