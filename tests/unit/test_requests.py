"""`inference/requests.py`: the causal and dLLM servers refuse a bad body with the same words (one
`parse_body` for every schema), and each schema keeps only what its engine means (`dllmflow` overrides
and `top_p` 1 for a dLLM, `prompt` for a text completion)."""

from __future__ import annotations

import json

import pytest

from dllmflow.inference.requests import (
    ChatBody,
    CompletionBody,
    DllmChatBody,
    DllmCompletionBody,
    RequestError,
    RequestLimits,
    parse_request,
)

LIMITS = RequestLimits(max_tokens_cap=64, max_messages=2)
HI = [{"role": "user", "content": "hi"}]


def refusal(body: dict, schema) -> tuple[str, str | None]:
    with pytest.raises(RequestError) as e:
        parse_request(json.dumps(body).encode(), LIMITS, schema)
    return str(e.value), e.value.param


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"max_tokens": 65},
            "max_tokens",
            "'max_tokens' is 65, above this server's cap of 64 (--max-tokens-cap)",
        ),
        ({"max_completion_tokens": 65}, "max_completion_tokens", "'max_completion_tokens' is 65, above"),
        ({"max_tokens": 8, "max_completion_tokens": 9}, "max_tokens", "not two different values"),
        ({"messages": HI * 3}, "messages", "'messages' holds 3 messages, above this server's limit of 2"),
        ({"stream_options": {"include_usage": True}}, "stream_options", 'only allowed with "stream": true'),
        ({"n": 2}, "n", "'n' must be 1 (got 2): this server returns one choice"),
        ({"messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages[0].x", "a message may hold"),
    ],
)
def test_the_causal_and_dllm_chat_bodies_are_refused_in_the_same_words(extra, param, words):
    body = {"model": "m", "messages": HI, **extra}
    causal, dllm = refusal(body, ChatBody), refusal(body, DllmChatBody)
    assert causal == dllm and causal[1] == param and words in causal[0], (causal, dllm)


def test_each_schema_takes_what_its_engine_means():
    assert parse_request(b'{"model": "m", "prompt": "2 + 3 ="}', LIMITS, CompletionBody).max_tokens is None
    dllm = {"model": "m", "prompt": "2 + 3 =", "dllmflow": {"threshold": 0.9}, "temperature": 0.5}
    assert parse_request(json.dumps(dllm).encode(), LIMITS, DllmCompletionBody).sampler_overrides() == {
        "threshold": 0.9,
        "temperature": 0.5,
    }
    message, param = refusal(dllm, CompletionBody)  # a causal LM has no sampler to override
    assert param == "dllmflow" and "is not supported: this server honours model" in message
    assert refusal({"model": "m", "prompt": "x", "top_p": 0.5}, DllmCompletionBody) == (
        "'top_p' must be 1 (got 0.5): dLLM samplers have no nucleus",
        "top_p",
    )
    assert parse_request(b'{"model": "m", "prompt": "x", "top_p": 0.5}', LIMITS, CompletionBody).top_p == 0.5
    assert refusal({"model": "m", "prompt": "x", "dllmflow": {"max_new_tokens": 4}}, DllmCompletionBody)[
        1
    ] == ("dllmflow.max_new_tokens")
