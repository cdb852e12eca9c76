"""`dllmflow serve` against the official `openai` client and hostile input: streaming, strict validation
(every unhonoured field refused by name), the max_tokens cap, the API key on every route but /health,
per-request timeouts (504, the row leaves its batch) and round-robin scheduling (a short request is not
starved by a long one). Real servers in subprocesses over a tiny random Llama; no mocks. The slow engine
is the real app with its decoding steps slowed from outside (tests/_serving.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from _serving import build_tiny_chat_lm, fault_server
from dllmflow.inference.serve_cli import local_server

pytestmark = pytest.mark.slow  # two servers in subprocesses, ~a minute on a busy CPU

MODEL = "tiny-target"
API_KEY = "sk-test-faults-7777"
CAP = 1000
HI = [{"role": "user", "content": "Natalia sold 48 clips"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Greedy decoding never stops early (`never_stop`): a long request really is long."""
    return build_tiny_chat_lm(tmp_path_factory.mktemp("target"), max_positions=2048, never_stop=True)


@pytest.fixture(scope="module")
def server(model_dir):
    with local_server(model_dir, served_model_name=MODEL, max_tokens_cap=CAP) as url:
        yield url


@pytest.fixture(scope="module")
def guarded_server(model_dir):
    """An API key, a 2 s request timeout and a slow engine (50 ms per turn): a 900-token request times out."""
    with fault_server(
        model_dir, served_model_name=MODEL, api_key=API_KEY, request_timeout_s=2, turn_delay_s=0.05
    ) as url:
        yield url


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def post(url: str, body: dict | str, key: str | None = None) -> httpx.Response:
    """Raw JSON (the openai client would refuse NaN or reshape some bodies)."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{url}/chat/completions", content=content, headers=headers, timeout=60)


def stats(url: str, key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url.removesuffix("/v1") + "/stats", headers=headers).json()


# ---- streaming ----------------------------------------------------------------------------------


def test_stream_yields_the_greedy_text(server):
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=30, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 30

    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=30, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert {ch.object for ch in chunks} == {"chat.completion.chunk"}
    deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(deltas) == text
    assert sum(bool(d) for d in deltas) > 1  # text arrives in pieces, one per scheduling turn
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices


def test_text_completions_of_a_causal_lm_are_its_greedy_continuation(server, model_dir):
    """`/v1/completions` on the causal server: the prompt encoded as is (no chat template), decoded
    greedily; the reference is transformers' own greedy `generate` of the same model in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "Natalia sold 48 clips to her"
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(prompt, add_special_tokens=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
        )
    expected = tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    c = client(server)
    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 12)
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert {ch.object for ch in chunks} == {"text_completion"}
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---- validation ---------------------------------------------------------------------------------


def test_n_2_is_refused_by_name(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=3, n=2)
    assert e.value.body["param"] == "n" and "'n' must be 1" in e.value.body["message"]


def test_bool_max_tokens_is_refused(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=True)
    assert e.value.body["param"] == "max_tokens" and "valid integer" in e.value.body["message"]


BAD = {
    "temperature NaN": ('"temperature": NaN', "temperature", "finite"),
    "temperature inf": ('"temperature": Infinity', "temperature", "finite"),
    "temperature > 2": ('"temperature": 2.5', "temperature", "less than or equal to 2"),
    "temperature as string": ('"temperature": "0.5"', "temperature", "valid number"),
    "top_p 0": ('"top_p": 0', "top_p", "greater than 0"),
    "max_tokens 0": ('"max_tokens": 0', "max_tokens", "greater than or equal to 1"),
    "max_tokens float": ('"max_tokens": 4.0', "max_tokens", "valid integer"),
    "max_tokens above the cap": (f'"max_tokens": {CAP + 1}', "max_tokens", f"cap of {CAP} (--max-tokens-cap)"),
    "max_completion_tokens above the cap": (f'"max_completion_tokens": {CAP + 1}', "max_completion_tokens", "cap"),
    "logprobs": ('"logprobs": true', "logprobs", "not supported"),
    "tools": ('"tools": [{"type": "function", "function": {"name": "f"}}]', "tools", "not supported"),
    "seed as bool": ('"seed": true', "seed", "valid integer"),  # seed is honoured; a bad one is refused
    "seed above int64": ('"seed": 9223372036854775808', "seed", "less than or equal"),
    "unknown key": ('"frobnicate": 1', "frobnicate", "not supported"),
    "stream_options without stream": ('"stream_options": {"include_usage": true}', "stream_options", "stream"),
    "stream as string": ('"stream": "yes"', "stream", "valid boolean"),
    "template swap": ('"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}', "chat_template_kwargs.chat_template", "not allowed"),
}  # fmt: skip


@pytest.mark.parametrize("extra,param,says", BAD.values(), ids=BAD.keys())
def test_bad_field_is_refused_by_name(server, extra, param, says):
    r = post(server, f'{{"model": "{MODEL}", "messages": {json.dumps(HI)}, {extra}}}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param}'" in err["message"] and says in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "messages[0].content"),
        ([{"role": "user", "content": "hi", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": 1, "content": "hi"}], "messages[0].role"),
    ],
)
def test_bad_messages_are_refused_by_name(server, messages, param):
    r = post(server, {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_not_an_object_and_not_json_are_400(server):
    assert post(server, "[1, 2]").status_code == 400
    assert "not valid JSON" in post(server, "{nope").json()["error"]["message"]


def test_null_fields_count_as_absent_and_n_1_is_fine(server):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "stop": None, "n": 1, "temperature": 0}
    r = post(server, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- scheduling ---------------------------------------------------------------------------------


def test_a_short_request_finishes_while_a_long_one_runs(server):
    """The long request is generating (its text is streaming) when the short one arrives; with one worker
    running each request to the end, the short one would wait for the long one."""

    async def race() -> tuple[list[str], str | None]:
        c = openai.AsyncOpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)
        order: list[str] = []
        long_started = asyncio.Event()
        finish: list[str | None] = [None]

        async def long() -> None:
            stream = await c.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=600, temperature=0, stream=True
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    long_started.set()
                if ch.choices and ch.choices[0].finish_reason:
                    finish[0] = ch.choices[0].finish_reason
            order.append("long")

        async def short() -> None:
            await long_started.wait()
            await c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0.7)
            order.append("short")

        await asyncio.wait_for(asyncio.gather(long(), short()), 300)
        return order, finish[0]

    order, finish = asyncio.run(race())
    assert finish == "length"  # the long request ran its 600 tokens
    assert order == ["short", "long"]


# ---- API key and timeouts -----------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(guarded_server):
    base = guarded_server.removesuffix("/v1")
    assert httpx.get(f"{base}/health").status_code == 200
    for path in ("/stats", "/v1/models"):
        assert httpx.get(f"{base}{path}").status_code == 401
        assert httpx.get(f"{base}{path}", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert post(guarded_server, {"model": MODEL, "messages": HI}).status_code == 401
    assert "requests" in stats(guarded_server, API_KEY)
    with pytest.raises(openai.AuthenticationError):
        client(guarded_server, "wrong").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)


def test_request_timeout_is_504_and_frees_its_row(guarded_server):
    c = client(guarded_server, API_KEY)
    before = stats(guarded_server, API_KEY)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=MODEL, messages=HI, max_tokens=900, temperature=0)
    assert e.value.status_code == 504 and "--request-timeout-s 2" in e.value.body["message"]

    # streamed: an error event after the 200. Greedy, as above: sampled, the model draws its stop token now
    # and then (`never_stop` only keeps it from winning an argmax), and a stream that stops within 2 s
    # has nothing to time out.
    with pytest.raises(openai.APIError, match="request-timeout-s"):
        stream = c.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=900, temperature=0, stream=True
        )
        for _ in stream:
            pass

    deadline = time.monotonic() + 30
    while (now := stats(guarded_server, API_KEY))["active_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now["active_rows"] == 0 and now["in_flight"] == 0  # both rows left their batches early
    assert now["dropped"] - before["dropped"] == 2 and now["timed_out"] - before["timed_out"] == 2
    reply = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)  # it serves on
    assert reply.usage.completion_tokens == 3


# ---- engine and CLI -----------------------------------------------------------------------------


def test_chunked_decode_matches_hf_generate(model_dir):
    """Rows of different prompt lengths, left-padded in one batch, stepped a few tokens per turn, give
    the same greedy tokens as `generate` on each prompt alone."""
    import torch

    from dllmflow.inference.engine import ChatEngine, ChatRequest

    engine = ChatEngine(model_dir)
    prompts = [engine.encode([{"role": "user", "content": t}], {}) for t in ("hi", "Natalia sold 48 clips")]
    reqs = [ChatRequest(p, n, 0.0, 1.0) for p, n in zip(prompts, (12, 7))]
    decode = engine.prefill(reqs)
    while decode.reqs:
        engine.step(decode, 3)
    for req in reqs:
        ref = engine.model.generate(
            torch.tensor([req.prompt_ids]), max_new_tokens=req.max_tokens, do_sample=False,
            pad_token_id=engine.tokenizer.pad_token_id,
        )  # fmt: skip
        assert req.tokens == ref[0, len(req.prompt_ids) :].tolist() and req.finish_reason == "length"


def test_the_cli_has_no_fault_injection_flags(capsys):
    """Failures and delays are injected by tests/_serving.py around the app, never by the product."""
    from dllmflow.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-tokens-cap" in out and "--request-timeout-s" in out and "--max-body-bytes" in out
    for flag in ("--fail-first", "--fail-status", "--delay-s", "--turn-delay-s"):
        with pytest.raises(SystemExit):
            main(["serve", "--model-path", "m", flag, "1"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
