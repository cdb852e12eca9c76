"""`dllmflow serve` honours OpenAI's `seed`: a seeded sampled request draws from its own generator, so the
same request and seed give the same text alone or batched with other requests (seeded or not, other
prompts, other lengths), two seeds give different text, greedy is unchanged, and a bad seed is a 400
naming `seed`. The real app (`build_app` over a tiny random Llama) in process via Starlette's
TestClient, which runs its scheduler; the batch composition is also pinned at the engine."""

from __future__ import annotations

import threading

import pytest

from _serving import build_tiny_chat_lm
from dllmflow.inference.engine import ChatEngine, ChatRequest, sample
from dllmflow.inference.serve import build_app

MODEL = "tiny-target"
HI = [{"role": "user", "content": "Natalia sold 48 clips"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ChatEngine:
    # never_stop: the stop token's logit is 0 among random ones, so sampled answers are rarely cut short
    return ChatEngine(build_tiny_chat_lm(tmp_path_factory.mktemp("target"), never_stop=True))


@pytest.fixture(scope="module")
def client(engine):
    from starlette.testclient import TestClient

    with TestClient(build_app(engine, MODEL, max_batch_size=16, chunk_tokens=4)) as c:
        yield c


def body(seed: int | None = None, content: str = HI[0]["content"], max_tokens: int = 24, **kw) -> dict:
    out = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return {**out, "temperature": 0.8, **({} if seed is None else {"seed": seed}), **kw}


def text(client, payload: dict) -> str:
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def concurrently(client, payloads: list[dict]) -> list[str]:
    """All `payloads` sent at once from threads (they queue together and share batches)."""
    out: list[str | None] = [None] * len(payloads)

    def send(i: int) -> None:
        out[i] = text(client, payloads[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def test_same_seed_same_text_alone_and_in_a_concurrent_batch(client):
    alone = text(client, body(seed=1234))
    assert alone == text(client, body(seed=1234))  # repeated alone
    others = [
        body(seed=s, content=f"question {s}: Natalia sold {s} clips", max_tokens=8 + s) for s in range(6)
    ]
    others += [body(content=f"unseeded {i}") for i in range(6)]  # these share the global RNG
    before = client.get("/stats").json()["batches"]
    mixed = concurrently(client, [*others[:6], body(seed=1234), *others[6:]])
    stats = client.get("/stats").json()
    assert stats["batches"] - before < 13  # 13 requests in fewer batches: some were batched together
    assert mixed[6] == alone
    assert text(client, body(seed=1235)) != alone  # another seed samples another answer


def test_greedy_ignores_the_seed_and_unseeded_requests_still_sample(client):
    greedy = text(client, body(seed=1, temperature=0))
    assert greedy == text(client, body(seed=2, temperature=0)) == text(client, body(temperature=0))
    assert len({text(client, body()) for _ in range(3)}) > 1  # no seed: today's unseeded sampling


@pytest.mark.parametrize("seed", [True, "7", 1.5, 2**63])
def test_a_bad_seed_is_a_400_naming_it(client, seed):
    r = client.post("/v1/chat/completions", json=body(seed=seed))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_extreme_seeds_are_accepted(client):
    for seed in (-(2**63), 2**63 - 1, 0):
        assert text(client, body(seed=seed, max_tokens=2)) is not None


def test_engine_rows_draw_independently_of_their_batch(engine):
    """Pinned batch composition: the seeded row's tokens are the same alone, first or last in a batch."""
    prompt = engine.encode(HI, {})

    def run(reqs: list[ChatRequest]) -> None:
        decode = engine.prefill(reqs)
        while decode.reqs:
            engine.step(decode, 4)

    def seeded() -> ChatRequest:
        return ChatRequest(prompt, max_tokens=20, temperature=0.8, top_p=0.9, seed=99)

    def other(i: int) -> ChatRequest:
        ids = engine.encode([{"role": "user", "content": f"other question {i} " * (i + 1)}], {})
        return ChatRequest(ids, max_tokens=5 + i, temperature=0.8, top_p=0.9, seed=i if i % 2 else None)

    run([a := seeded()])
    run([b := seeded(), *[other(i) for i in range(4)]])
    run([*[other(i) for i in range(3)], c := seeded()])
    assert a.tokens == b.tokens == c.tokens and len(a.tokens) > 1


def test_sample_without_generators_is_unchanged():
    import torch

    logits = torch.randn(3, 50)  # [B, V]
    torch.manual_seed(5)
    old = torch.multinomial(torch.softmax(logits / 0.7, -1), 1).squeeze(-1)  # the pre-seed code path
    torch.manual_seed(5)
    assert torch.equal(sample(logits, 0.7, 1.0), old)
    assert torch.equal(sample(logits, 0.0, 0.5, [torch.Generator()] * 3), logits.argmax(-1))
