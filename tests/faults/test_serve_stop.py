"""A dLLM request never holds `dllmflow serve` past its timeout, and SIGTERM stops the server within
seconds mid-block. One request of one block of 2,000 steps (~2 minutes of forwards on this CPU) times
out after `--request-timeout-s 1`: its block stops at the next forward, so a short request sent after
the 504 is answered at once, and the server, SIGTERMed while a second such block decodes, exits within
a few seconds (before: the block ran to its end, the short request waited for it, and SIGTERM waited
for the open request). A real server in a subprocess over a tiny random dLLM export."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from _serving import tiny_dllm_export
from dllmflow.common.net import free_port
from dllmflow.inference.serve_cli import _wait_healthy, serve_args

pytestmark = pytest.mark.slow  # a server in a subprocess

LONG = 2000  # tokens, steps and block: one block of 2,000 forwards over a 2,000-token canvas


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_dllm_export(tmp_path_factory.mktemp("serve_stop") / "export")


def long_request(url: str, out: dict) -> None:
    body = {"model": "m", "prompt": "Hi", "max_tokens": LONG, "dllmflow": {"steps": LONG, "block_size": LONG}}
    try:
        out["status"] = httpx.post(f"{url}/completions", json=body, timeout=300).status_code
    except httpx.HTTPError as e:  # the server went away
        out["status"] = type(e).__name__


def decoding(url: str) -> bool:
    return httpx.get(f"{url.removesuffix('/v1')}/stats", timeout=30).json()["active_rows"] > 0


def test_a_timed_out_block_stops_and_sigterm_ends_the_server_mid_block(export, tmp_path):
    port = free_port("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    argv = serve_args(export, "127.0.0.1", port, served_model_name="m", max_tokens_cap=LONG,
                      request_timeout_s=1, threads=1)  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllmflow.cli", "serve", *argv], stdout=out, stderr=out
        )
    try:
        _wait_healthy(proc, base, log, "the server", 300)
        url = f"{base}/v1"
        first: dict = {}
        long_request(url, first)  # 504 after 1 s; its block must stop at the next forward
        assert first["status"] == 504
        t0 = time.perf_counter()
        short = httpx.post(
            f"{url}/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4}, timeout=300
        )
        waited = time.perf_counter() - t0
        assert short.status_code == 200 and waited < 10, (short.text, waited)  # the long block: ~2 min

        second: dict = {}
        thread = threading.Thread(target=long_request, args=(url, second))
        thread.start()
        while not decoding(url):
            time.sleep(0.05)
        time.sleep(0.3)  # inside the block
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        stopped = time.perf_counter() - t0
        thread.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert stopped < 8, (stopped, log.read_text()[-2000:])  # 2 s of grace, then the next forward stops
    # uvicorn re-raises the SIGTERM it handled once shut down: -15 is a clean stop too
    assert code in (0, -signal.SIGTERM) and "Traceback" not in log.read_text(), log.read_text()[-2000:]
