"""`dllmflow serve` under oversized and hostile bodies: a body past `--max-body-bytes` is 413, read as a
stream and refused at the cap (a chunked body with no Content-Length is answered before it ends), JSON
nested too deep and chats with too many messages are 400 naming the limit, and the CPU work of a large
request (decode, validation, chat template) runs off the event loop, so `/health` answers within a
second meanwhile. The server keeps serving afterwards. A real server in a subprocess over a tiny Llama."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from _serving import build_tiny_chat_lm
from dllmflow.inference.serve_cli import local_server

pytestmark = pytest.mark.slow  # a server in a subprocess

MODEL = "tiny-target"
HI = [{"role": "user", "content": "Natalia sold 48 clips"}]
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_lm(tmp_path_factory.mktemp("target"), max_positions=2048)


@pytest.fixture(scope="module")
def server(model_dir):
    with local_server(model_dir, served_model_name=MODEL) as url:  # default limits: 1 MiB, 256 messages
        yield url


def post(url: str, content: bytes | str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/chat/completions", content=content, headers=headers, timeout=120)


def chat(content: str, **extra) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})


def health_while(url: str, send) -> tuple[dict, list[float]]:
    """Run `send()` in a thread; probe /health every 50 ms until it returns: (its result, latencies)."""
    base = url.removesuffix("/v1")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(send()))
    latencies: list[float] = []
    thread.start()
    while thread.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{base}/health", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    thread.join()
    return result, latencies


def assert_still_serving(url: str) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_a_10_mb_request_is_413_and_health_stays_answered(server):
    big = chat("Natalia sold 48 clips. " * (10 * MIB // 23))

    def send() -> dict:
        t0 = time.perf_counter()
        r = post(server, big)
        return {"status": r.status_code, "error": r.json()["error"], "s": time.perf_counter() - t0}

    result, latencies = health_while(server, send)
    assert result["status"] == 413, result
    assert "--max-body-bytes" in result["error"]["message"] and result["error"]["code"] == 413
    assert result["s"] < 5.0  # refused from its size, not after decoding and tokenising 10 MB
    assert latencies and max(latencies) < 1.0, latencies
    assert_still_serving(server)


def test_a_large_request_under_the_cap_is_tokenised_off_the_event_loop(server):
    """~0.9 MiB of text: under the body cap, so it is decoded, validated and run through the chat template
    (seconds on a busy CPU) before the prompt-length check refuses it; /health answers meanwhile."""
    large = chat("Natalia sold 48 clips. " * (9 * MIB // 10 // 23))

    def send() -> dict:
        r = post(server, large)
        return {"status": r.status_code, "error": r.json()["error"]}

    result, latencies = health_while(server, send)
    assert result["status"] == 400 and "max_model_len (2048)" in result["error"]["message"], result
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    assert_still_serving(server)


def test_a_chunked_body_is_refused_at_the_cap_not_at_its_end(server):
    """No Content-Length: the server counts what arrives and answers 413 once past 1 MiB, while the
    client has not ended the body (a server that buffers first would wait for the end)."""
    host, port = httpx.URL(server).host, httpx.URL(server).port
    with socket.create_connection((host, port), timeout=30) as s:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        piece = b" " * 65536
        for _ in range(MIB // len(piece) + 4):  # 1.25 MiB of a body that never ends
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        s.settimeout(20)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert_still_serving(server)


def test_a_declared_oversize_body_is_413(server):
    r = post(server, b" " * (MIB + 1))
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_400(server, depth):
    nested = "[" * depth + "]" * depth
    r = post(server, chat("hi", chat_template_kwargs={"x": "NESTED"}).replace('"NESTED"', nested))
    assert r.status_code == 400, r.text
    assert "nests JSON deeper than 32 levels" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_a_1000_message_chat_is_400_naming_the_limit(server):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(999)]
    r = post(server, json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == "messages" and "999 messages" in err["message"] and "--max-messages" in err["message"]
    )
    assert_still_serving(server)


def test_limits_follow_the_flags(model_dir):
    """--max-body-bytes and --max-messages set the limits (the app in-process, the real engine)."""
    from starlette.testclient import TestClient

    from dllmflow.inference.engine import ChatEngine
    from dllmflow.inference.serve import build_app

    app = build_app(ChatEngine(model_dir), MODEL, max_body_bytes=400, max_messages=2)
    with TestClient(app) as c:
        ok = {"model": MODEL, "messages": HI * 2, "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=ok).status_code == 200
        three = c.post("/v1/chat/completions", json={**ok, "messages": HI * 3})
        assert three.status_code == 400 and "limit of 2 (--max-messages)" in three.json()["error"]["message"]
        long = c.post(
            "/v1/chat/completions", json={**ok, "messages": [{"role": "user", "content": "x" * 400}]}
        )
        assert long.status_code == 413 and "limit of 400 bytes" in long.json()["error"]["message"]
