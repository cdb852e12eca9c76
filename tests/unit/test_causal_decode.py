"""The one causal decoder (diffusion/samplers/causal_decode.py): the `ar` sampler and serving's
`ChatEngine` both decode through `CausalDecoder`, and both give transformers' greedy `generate` ids on a
tiny random chat LM, batched with other prompt lengths, per-row limits and a per-row stop id.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_causal_decode.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from _serving import build_tiny_chat_lm
from dllmflow.diffusion.samplers import SAMPLERS
from dllmflow.diffusion.samplers.causal_decode import CausalDecoder
from dllmflow.diffusion.samplers.configs import build_sampler_config
from dllmflow.inference.engine import ChatEngine, ChatRequest

N = 9  # new tokens per row


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ChatEngine:
    return ChatEngine(build_tiny_chat_lm(tmp_path_factory.mktemp("target"), never_stop=True))


@pytest.fixture
def forwards(monkeypatch) -> list[int]:
    """The live rows of every `CausalDecoder.forward` call (empty when a caller decodes elsewhere)."""
    seen: list[int] = []
    real = CausalDecoder.forward

    def spy(self):
        seen.append(len(self.live))
        return real(self)

    monkeypatch.setattr(CausalDecoder, "forward", spy)
    return seen


def _prompts(engine: ChatEngine) -> list[list[int]]:
    texts = ("hi", "Natalia sold 48 clips to her friends", "clips")
    return [engine.encode([{"role": "user", "content": t}], {}) for t in texts]


def _hf_greedy(model, prompt: list[int], n: int, stop: list[int], pad: int) -> list[int]:
    """`generate`'s greedy ids of `prompt` alone, up to and with the first stop id."""
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    with torch.inference_mode():
        new = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
    return next((new[: i + 1] for i, t in enumerate(new) if t in stop), new)


def _serve(engine: ChatEngine, prompts: list[list[int]], limits: list[int]) -> list[ChatRequest]:
    reqs = [ChatRequest(p, n, 0.0, 1.0) for p, n in zip(prompts, limits)]
    decode = engine.prefill(reqs)
    while decode.reqs:
        engine.step(decode, 3)
    return reqs


def test_the_chat_engine_decodes_through_the_shared_decoder_as_generate(engine, forwards):
    prompts, limits = _prompts(engine), [N, N - 4, N]
    pad = engine.tokenizer.pad_token_id
    reqs = _serve(engine, prompts, limits)
    assert [r.tokens for r in reqs] == [
        _hf_greedy(engine.model, p, n, engine.eos_ids, pad) for p, n in zip(prompts, limits)
    ]
    assert [r.finish_reason for r in reqs] == ["length"] * 3
    assert forwards == [3] * (N - 4) + [2] * 4  # a forward per token; row 1 left at its own limit


def test_the_chat_engine_stops_a_row_at_its_stop_id(engine, forwards, monkeypatch):
    prompts = _prompts(engine)
    free = [r.tokens for r in _serve(engine, prompts, [N] * 3)]
    eos = free[1][2]  # row 1's third token becomes the stop id
    assert eos not in free[1][:2]
    monkeypatch.setattr(engine, "eos_ids", [eos])
    forwards.clear()
    reqs = _serve(engine, prompts, [N] * 3)
    pad = engine.tokenizer.pad_token_id
    assert [r.tokens for r in reqs] == [_hf_greedy(engine.model, p, N, [eos], pad) for p in prompts]
    assert reqs[1].tokens == free[1][:3] and reqs[1].finish_reason == "stop"
    assert forwards[3] == sum(eos not in t[:3] for t in free)  # the stopped rows left before forward 4


def test_the_ar_sampler_decodes_through_the_shared_decoder_as_generate(engine, forwards):
    prompts = _prompts(engine)
    for cache in ("exact", "none"):
        cfg = build_sampler_config("ar", {"max_new_tokens": N, "cache": cache})
        sampler = SAMPLERS["ar"](engine.model, engine.tokenizer, cfg)
        stop, pad = sorted(sampler.stop_ids), engine.tokenizer.pad_token_id
        expected = [_hf_greedy(engine.model, p, N, stop, pad) for p in prompts]
        forwards.clear()
        out = sampler.generate(prompts)
        assert out.sequences == [e[:-1] if e[-1] in stop else e for e in expected]  # trimmed at the stop id
        assert len(forwards) == out.nfe == max(len(e) for e in expected) and forwards[0] == 3
        assert out.row_nfe == [len(e) for e in expected]
