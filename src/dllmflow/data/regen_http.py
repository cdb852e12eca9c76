"""The HTTP side of `dllmflow regenerate`: one chat request per prompt to an OpenAI-compatible server,
retried (tenacity) on 5xx, 429, timeouts, connection errors and unreadable replies after
min(base * 2^attempt, cap) with jitter, or after the server's `Retry-After` when that is longer.

    async with httpx.AsyncClient() as client:
        await check_server(client, "http://localhost:30000/v1", "target")
        reply = await post_chat(client, url, build_payload(cfg, prompt, row_index), max_retries=3,
                                backoff_base_s=1.0, backoff_cap_s=30.0, counters=Counters())
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import hashlib
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from dllmflow.errors import UserError
from dllmflow.settings import RegenerateConfig

log = logging.getLogger("dllmflow.regenerate")

API_KEY_ENV_VARS = ("DLLMFLOW_API_KEY", "OPENAI_API_KEY")
MAX_RETRY_AFTER_S = 300.0  # a Retry-After longer than this is treated as this (the run must end)


class RequestFailed(Exception):
    """One prompt's request failed for good (retries exhausted, or a non-retryable 4xx)."""


class _Retryable(Exception):
    """A 5xx/429 status: worth another attempt, after `retry_after` seconds when the server said so."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def backoff_s(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Delay before retry number `attempt + 1`: min(base * 2^attempt, cap)."""
    return min(base * 2.0**attempt, cap)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks for: delta-seconds (`120`) or an HTTP date
    (`Wed, 21 Oct 2015 07:28:00 GMT`, relative to `now`, epoch seconds); None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_wait_s(
    attempt: int, retry_after: float | None, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Delay before retry number `attempt + 1`: the capped exponential backoff with equal jitter (uniform
    in [backoff/2, backoff], so clients that failed together do not come back together), but never
    shorter than the server's Retry-After (itself bounded by MAX_RETRY_AFTER_S)."""
    backoff = backoff_s(attempt, base, cap)
    wait = backoff * (0.5 + 0.5 * (rng or random).random())
    if retry_after is not None:
        wait = max(wait, min(retry_after, MAX_RETRY_AFTER_S))
    return wait


def row_seed(seed: int, row_index: int) -> int:
    """The `seed` of the request for input row `row_index` of a run seeded with `seed`: a 63-bit hash of
    the pair, so a row's sample depends on neither the shard size, the concurrency nor a resume."""
    digest = hashlib.blake2b(f"dllmflow-regenerate:{seed}:{row_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def build_payload(cfg: RegenerateConfig, prompt: list[dict[str, Any]], row_index: int = 0) -> dict[str, Any]:
    """The chat request for `prompt`, input row `row_index` (it seeds the request when `cfg.seed` is set)."""
    payload = {
        "model": cfg.model,
        "messages": prompt,
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
    }
    if cfg.seed is not None:  # OpenAI's `seed`: SGLang, vLLM and `dllmflow serve` sample reproducibly
        payload["seed"] = row_seed(cfg.seed, row_index)
    if cfg.reasoning == "disable":  # top level, as SGLang and vLLM read it (not inside extra_body)
        payload["chat_template_kwargs"] = {"enable_thinking": False}
    return payload


def assistant_turn(reply: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """`choices[0].message` -> the new assistant message (reasoning kept only with `save`)."""
    msg = reply["choices"][0]["message"]
    turn = {"role": "assistant", "content": msg.get("content") or ""}
    thought = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning == "save" and thought:
        turn["reasoning_content"] = thought
    return turn


def api_key_from_env() -> str | None:
    return next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)


@dataclass
class Counters:
    rows_total: int = 0
    rows_skipped: int = 0
    rows_resumed: int = 0
    rows_written: int = 0
    rows_failed: int = 0
    shards_total: int = 0
    shards_resumed: int = 0
    shards_written: int = 0
    requests: int = 0
    retries: int = 0


async def post_chat(
    client,
    url: str,
    payload: dict[str, Any],
    *,
    max_retries: int,
    backoff_base_s: float,
    backoff_cap_s: float,
    counters: Counters,
    on_retry=None,
    sleep=None,
    rng: random.Random | None = None,
) -> dict[str, Any]:
    """POST with up to `max_retries` retries on 5xx, 429, timeouts, connection errors and unreadable
    replies, waiting `retry_wait_s` (which honours Retry-After) between attempts. Other 4xx mean the
    request itself is wrong: no retry. `sleep` (default asyncio.sleep) and `rng` are for tests."""
    import httpx
    import tenacity

    async def attempt() -> dict[str, Any]:
        counters.requests += 1
        resp = await client.post(url, json=payload)
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retryable(
                f"HTTP {resp.status_code}: {resp.text[:300]}", retry_after_s(resp.headers.get("retry-after"))
            )
        if resp.status_code >= 400:
            raise RequestFailed(f"{url} rejected the request: HTTP {resp.status_code}: {resp.text[:500]}")
        reply = resp.json()
        reply["choices"][0]["message"]  # noqa: B018 - validate the shape before accepting
        return reply

    def wait(state: tenacity.RetryCallState) -> float:
        error = state.outcome.exception()
        return retry_wait_s(
            state.attempt_number - 1, getattr(error, "retry_after", None), backoff_base_s, backoff_cap_s, rng
        )

    def before_sleep(state: tenacity.RetryCallState) -> None:
        counters.retries += 1
        log.debug(
            "attempt %d/%d failed: %r; retrying in %.2fs",
            state.attempt_number, max_retries + 1, state.outcome.exception(), state.upcoming_sleep,
        )  # fmt: skip
        if on_retry:
            on_retry()

    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(max_retries + 1),
        wait=wait,
        # httpx.TimeoutException and ConnectError are TransportErrors; the rest is an unreadable reply
        retry=tenacity.retry_if_exception_type(
            (httpx.TransportError, _Retryable, ValueError, KeyError, IndexError, TypeError)
        ),
        sleep=sleep or _sleep,
        before_sleep=before_sleep,
    )
    try:
        return await retrying(attempt)
    except tenacity.RetryError as e:
        last = e.last_attempt.exception()
        raise RequestFailed(
            f"{url}: failed after {max_retries + 1} attempts; last error: {type(last).__name__}: {last}"
        ) from None


async def _sleep(seconds: float) -> None:
    # Looked up at call time, so a test can patch it for a whole `regenerate()` run.
    await asyncio.sleep(seconds)


async def check_server(client, base_url: str, model: str) -> None:
    """Fail fast with a clear message when the server is unreachable or does not serve `model`."""
    import httpx

    try:
        resp = await client.get(f"{base_url}/models", timeout=30.0)
    except httpx.TransportError as e:
        raise UserError(
            f"--target-server {base_url}: cannot reach it ({type(e).__name__}: {e}). Start a server "
            "(`dllmflow serve --model-path DIR --port 30000`, SGLang or vLLM) or fix the URL"
        ) from e
    if resp.status_code in (401, 403):
        raise UserError(
            f"--target-server {base_url}: HTTP {resp.status_code}; set the API key in {' or '.join(API_KEY_ENV_VARS)}"
        )
    if resp.status_code != 200:
        log.warning("%s/models answered HTTP %d; continuing", base_url, resp.status_code)
        return
    try:
        served = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return
    if served and model not in served:
        raise UserError(
            f"--model {model!r} is not served by {base_url} (it serves {served}); use one of those"
        )
