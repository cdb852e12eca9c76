"""`ChatServer.prep`: a request body up to INLINE_PREP_BYTES is prepared on the event loop's own thread
(no thread handoff per request of a burst), a larger one in the server's `prep_pool`, so a huge body
never stalls the loop; either way the result and a refusal (RequestError) reach the caller. The server
object alone over a stub engine: `prep` touches nothing else."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dllmflow.inference.requests import RequestError, RequestLimits
from dllmflow.inference.serve import INLINE_PREP_BYTES, ChatServer


def server() -> ChatServer:
    return ChatServer(None, "m", None, RequestLimits(), request_timeout_s=1.0, api_key=None)


def where(raw: bytes) -> tuple[str, int]:
    if raw.startswith(b"bad"):
        raise RequestError("refused", "prompt")
    return threading.current_thread().name, len(raw)


def run_prep(srv: ChatServer, raw: bytes):
    async def go():
        return threading.current_thread().name, await srv.prep(where, raw)

    return asyncio.run(go())


@pytest.mark.parametrize("size", [0, 100, INLINE_PREP_BYTES])
def test_small_bodies_are_prepared_on_the_loop_thread(size):
    srv = server()
    loop_thread, (thread, n) = run_prep(srv, b"x" * size)
    assert thread == loop_thread and n == size
    srv.prep_pool.shutdown()


@pytest.mark.parametrize("size", [INLINE_PREP_BYTES + 1, 4 * INLINE_PREP_BYTES])
def test_large_bodies_are_prepared_in_the_pool(size):
    srv = server()
    loop_thread, (thread, n) = run_prep(srv, b"x" * size)
    assert thread != loop_thread and thread.startswith("serve-prep") and n == size
    srv.prep_pool.shutdown()


@pytest.mark.parametrize("size", [10, 2 * INLINE_PREP_BYTES])
def test_a_refusal_reaches_the_caller_either_way(size):
    srv = server()
    with pytest.raises(RequestError, match="refused") as e:
        run_prep(srv, b"bad" + b"x" * size)
    assert e.value.param == "prompt"
    srv.prep_pool.shutdown()
