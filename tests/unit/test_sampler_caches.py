"""The samplers' KV caches (docs/strategies.md §3.0 "Caches"): the exact ones (llada2, idlm) give the
uncached tokens; Fast-dLLM's approximate ones (llada prefix/dual, scdd prefix) are exact on a one-layer
model (whose keys depend on their own tokens only) and forward only what they should; every sampler in
every cache mode decodes a prompt in a left-padded batch of 8 as it does alone; faults are one line.
Tiny random Qwen3s in float64, as in test_samplers*.py (equalities not at the mercy of near-ties)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.data.tokenizer import train_bpe_tokenizer
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.base import build_sampler_config
from dllmflow.errors import UserError

TEXTS = ["Natalia sold 48 clips in April and half as many in May. #### 72", "What is 2 + 3? The answer is 5."]
PHRASES = ["What is 2 + 3?", "Natalia sold 48 clips in April", "Hi", "half as many in May", "The answer",
           "What is 2 + 3? The answer is 5. Natalia sold", "48", "clips in April and half as many"]  # fmt: skip
SMALL = {  # 12 new tokens, blocks of 4
    "llada": dict(steps=12, max_new_tokens=12, block_size=4),
    "scdd": dict(steps=6, max_new_tokens=12),
    "llada2": dict(steps=4, max_new_tokens=12, block_size=4),
    "nemotron": dict(steps=12, max_new_tokens=12, block_size=4),
    "idlm": dict(steps=12, max_new_tokens=12, block_size=4),
}
# every cache mode of every sampler
MODES = [("llada", {"cache": c}) for c in ("none", "prefix", "dual")]
MODES += [("llada", {"cache": "dual", "threshold": 0.05})]
MODES += [("scdd", {"cache": c}) for c in ("none", "prefix")] + [
    ("scdd", {"cache": "prefix", "temperature": 0.0})
]
MODES += [(n, {"cache": c}) for n in ("llada2", "nemotron", "idlm") for c in ("exact", "none")]


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(TEXTS * 5, 300, "<mask>", "<pad>", "<eos>")


def qwen3(tok, layers: int, max_positions: int = 4096):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64,
                      max_position_embeddings=max_positions)  # fmt: skip
    return Qwen3ForCausalLM(cfg).double().eval()


@pytest.fixture(scope="module")
def model(tok):
    return qwen3(tok, 2)


def make(name, model, tok, **over):
    cfg = build_sampler_config(name, {**SMALL[name], **over}, tok)
    if "eos_token_id" not in over:
        cfg = cfg.model_copy(update={"eos_token_id": None})  # decode the whole window
    return SAMPLERS[name](model, tok, cfg)


def raw(sampler, ps):
    """(untrimmed generated windows, nfe, row nfe)."""
    with torch.inference_mode():
        return sampler._generate(ps)[:3]


def widths(model, run):
    """Run `run()` and return it with the widths of the canvases the model was called on."""
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)  # fmt: skip
    try:
        return run(), seen
    finally:
        handle.remove()


# ---- exact caches: the uncached tokens, forwards of one block ----------------------------------------


_EXACT_CASES = [
    (name, over, f"{name}-{label}")
    for name in ("llada2", "idlm")
    for label, over in [
        ("greedy", {}),
        ("threshold", {"threshold": 0.3}),
        ("sampled", {"temperature": 0.7}),
        ("editing", {"editing_threshold": 0.02, "max_post_steps": 3}),  # llada2's post-steps only
    ]
    if label != "editing" or name == "llada2"
]


@pytest.mark.parametrize(("name", "over"), [c[:2] for c in _EXACT_CASES], ids=[c[2] for c in _EXACT_CASES])
def test_exact_cache_gives_the_uncached_tokens(model, tok, name, over):
    ps = [tok.encode(p) for p in PHRASES[:3]]
    for batch in (ps, ps[:1], ps[2:]):
        (cached, c_seen), (plain, p_seen) = (
            widths(model, lambda c=c, b=batch: raw(make(name, model, tok, cache=c, **over), b))
            for c in ("exact", "none")
        )
        assert cached == plain  # tokens, nfe, per-row nfe
        assert cached[1] == len(c_seen) == len(p_seen)  # no forward added
        S, shift = max(map(len, batch)), int(name == "idlm")
        # the first forward holds the prompt and block 0; the others one block (+ the previous, once)
        assert c_seen[0] == S + 4 - shift and set(c_seen[1:]) <= {4, 8} and 4 in c_seen
        assert min(p_seen) > S  # the uncached path runs over the canvas


def test_idlm_cache_with_per_row_eos_equals_uncached(model, tok):
    ps = [tok.encode(p) for p in PHRASES[:4]]
    eos = raw(make("idlm", model, tok, cache="none"), ps[:1])[0][0][5]  # a token row 0 produces
    runs = [raw(make("idlm", model, tok, cache=c, eos_token_id=eos), ps) for c in ("exact", "none")]
    assert runs[0] == runs[1] and min(runs[0][2]) < max(runs[0][2])  # a row stopped early


# ---- approximate caches -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, over", [m for m in MODES if m[0] in ("llada", "scdd")], ids=str)
def test_approximate_cache_is_exact_on_one_layer(tok, name, over):
    # one layer: a key depends on its own token only, and cached tokens do not change within a block
    one = qwen3(tok, 1)
    ps = [tok.encode(p) for p in PHRASES[:3]]
    got = raw(make(name, one, tok, **over), ps)
    want = raw(make(name, one, tok, **{**over, "cache": "none"}), ps)
    assert got == want


@pytest.mark.parametrize("cache, step_width", [("prefix", None), ("dual", 4)])
def test_fast_dllm_forwards_refresh_then_the_block(model, tok, cache, step_width):
    ps = [tok.encode(p) for p in PHRASES[:3]]
    (out, nfe, _), seen = widths(model, lambda: raw(make("llada", model, tok, cache=cache), ps))
    T, S = max(map(len, ps)) + 12, max(map(len, ps))
    assert nfe == len(seen) == 12  # one token a step: no forward added by the refreshes
    for j in range(3):  # per block: a full forward (the refresh), then 3 cached steps
        lo = S + 4 * j
        assert seen[4 * j] == T
        assert seen[4 * j + 1 : 4 * j + 4] == [step_width or T - lo] * 3
    assert all(tok.mask_token_id not in s for s in out)


class NoKeepArg(torch.nn.Module):
    """`model` behind a forward without `logits_to_keep` (as remote code may be): full logits, sliced."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          cache=cache, use_cache=use_cache)  # fmt: skip


@pytest.mark.parametrize("name, over", [m for m in MODES if m[1].get("cache") in ("prefix", "dual")], ids=str)
def test_cached_forwards_head_only_the_block_same_tokens(model, tok, name, over):
    # The LM head of a refresh (a full forward) and of a prefix step (the block and the suffix) runs on
    # the block's positions alone; a model that cannot be told gives full logits, sliced: same tokens.
    ps = [tok.encode(p) for p in PHRASES[:3]]
    rows = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1]))
    try:
        got = raw(make(name, model, tok, **over), ps)
    finally:
        handle.remove()
    assert got == raw(make(name, NoKeepArg(model), tok, **over), ps)
    block = 4 if name == "llada" else 12  # scdd's "block" is its whole window of 12 new tokens
    assert rows and set(rows) == {block}  # whole blocks: every call heads one block


def test_scdd_prefix_cache_refreshes_every_cache_refresh_steps(model, tok):
    ps = [tok.encode(p) for p in PHRASES[:2]]
    _, seen = widths(model, lambda: raw(make("scdd", model, tok, cache="prefix", cache_refresh=4), ps))
    T = max(map(len, ps)) + 12
    assert seen == [T if i % 4 == 0 else 12 for i in range(7)]  # 6 steps + the final argmax


# ---- a batch never changes a row's answer -----------------------------------------------------------


@pytest.mark.parametrize("name, over", MODES, ids=str)
def test_batch_of_eight_equals_each_alone(model, tok, name, over):
    ps = [tok.encode(p) for p in PHRASES]
    assert len(ps) == 8 and len(set(map(len, ps))) > 4
    sampler = make(name, model, tok, **over)
    batched = raw(sampler, ps)[0]
    assert batched == [raw(sampler, [p])[0][0] for p in ps]


def test_gemma_batch_equals_each_alone(tok):
    from dllmflow.models.diffusion_gemma import build_tiny_diffusion_gemma
    from dllmflow.settings import load_settings

    settings = load_settings("params/tiny_block_diffusion.yaml", model={"canvas_length": 8},
                             dllm={"vocab_size": len(tok), "block_size": 8})  # fmt: skip
    torch.manual_seed(0)
    gemma = build_tiny_diffusion_gemma(settings, tok).eval()
    sampler = SAMPLERS["gemma"](gemma, tok, build_sampler_config("gemma", {"steps": 3, "max_new_tokens": 8}))
    ps = [tok.encode(p) for p in PHRASES]
    batched = sampler.generate(ps).sequences
    assert batched == [sampler.generate([p]).sequences[0] for p in ps]


# ---- faults -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma", "nemotron", "llada2", "idlm"])
def test_fast_dllm_cache_refused_by_samplers_without_it(name):
    takes = "takes no cache but 'none'" if name == "gemma" else "takes cache exact or none, not 'prefix'"
    with pytest.raises(UserError, match=rf"sampler {name} {takes}"):
        build_sampler_config(name, {"cache": "prefix"})
    # `defaults` is the eval section shared by every sampler of a mode: a sampler without a cache runs
    # without it; the section is refused at parse time only when no sampler of the mode takes the value
    # (evaluation.protocol.check_eval_settings, tests/unit/test_sweep.py).
    runs = "none" if name == "gemma" else "exact"  # a mode it does not take: its preset
    for value, want in (("dual", runs), ("none", "none")):
        assert getattr(build_sampler_config(name, defaults={"cache": value}), "cache", "none") == want


def test_cache_modes_validated_and_turned_off_by_cache_none():
    with pytest.raises(
        UserError,
        match="invalid scdd sampler settings: --cache: .*sampler scdd takes cache none or prefix, not 'dual'",
    ):
        build_sampler_config("scdd", {"cache": "dual"})
    with pytest.raises(UserError, match="--cache"):
        build_sampler_config("llada", {"cache": "triple"})
    assert build_sampler_config("llada", {"cache": "none"}).cache == "none"
    assert build_sampler_config("idlm", {"cache": "none"}).cache == "none"
    assert build_sampler_config("llada2", {"cache": "none"}).cache == "none"


@pytest.mark.parametrize("name, over", [("llada", {"cache": "prefix"}), ("llada", {"cache": "dual"}),
                                        ("scdd", {"cache": "prefix"}), ("llada2", {}), ("idlm", {})])  # fmt: skip
def test_cache_beyond_the_model_positions_fails_before_decoding(tok, name, over):
    short = qwen3(tok, 1, max_positions=16)
    p = tok.encode(PHRASES[5])  # longer than 4 tokens: prompt + 12 > 16
    calls, handle = [], short.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(UserError, match=r"max_position_embeddings \(16\)"):
            make(name, short, tok, **over).generate([p])
    finally:
        handle.remove()
    assert calls == []


def test_llada_cache_refuses_infill_and_a_canvas_forward(model, tok):
    sampler = make("llada", model, tok, cache="dual")
    with pytest.raises(UserError, match="sampler llada does not infill with cache 'dual'"):
        sampler.infill([[5, sampler.mask_id, 6]])
    cfg = build_sampler_config("llada", {**SMALL["llada"], "cache": "prefix"})
    fwd = SAMPLERS["llada"](model, tok, cfg, forward=lambda ids, mask: model(input_ids=ids).logits)
    with pytest.raises(UserError, match="sampler llada with cache 'prefix' needs the model itself"):
        fwd.generate([tok.encode("Hi")])
