"""The scheduler of `dllmflow serve`: one worker owns the model and gives every active batch a turn
(round-robin), so a long request delays a short one by a few turns instead of holding the model until it
is done. It drives either engine (`inference/engine.py`'s causal `ChatEngine`, `inference/dllm_engine.py`'s
`DllmEngine`) through the same interface: `prefill(reqs)`, `step(decode, n)`, `keep(decode, rows)`,
`result(req)`.

    scheduler = Scheduler(engine, max_batch_size=16, chunk_tokens=8)
    scheduler.submit(ChatRequest(prompt_ids, max_tokens=32, temperature=0.8, top_p=1.0, seed=7))
    await scheduler.run()                                   # the one worker that owns the model

Requests that arrive together with the same `batch_key()` share a batch (up to `max_batch_size`); a turn
is `chunk_tokens` new tokens of one batch (a dLLM's: one block). A request's events ("tokens", "done",
"error") go to its `events` queue, which `inference/serve.py` turns into HTTP answers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from dllmflow.inference.engine import ChatRequest, Decode

log = logging.getLogger("dllmflow.inference.serve")


class DecodeAborted(Exception):
    """A turn stopped between two forwards: every row of its batch is gone (timed out, client gone) or
    the server is stopping (`DllmEngine`: a dLLM block is up to --max-tokens-cap forwards)."""


class Scheduler:
    """One worker owns the model: it batches queued requests and gives every active batch a turn of
    `chunk_tokens` tokens in round-robin, so no request waits for another to finish."""

    def __init__(
        self,
        engine: Any,  # a ChatEngine or a DllmEngine
        max_batch_size: int,
        chunk_tokens: int = 8,
        *,
        batch_wait_s: float = 0.005,
        incoming: Callable[[], int] | None = None,
        settle_s: float = 0.05,
    ):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.batch_wait_s = batch_wait_s
        # Requests the server is still reading and validating: a batch being formed waits for them (at
        # most `settle_s`), so clients that send together share a batch. None: only the queue counts.
        self.incoming = incoming or (lambda: 0)
        self.settle_s = settle_s
        self.queue: asyncio.Queue[ChatRequest] = asyncio.Queue()
        self.full = asyncio.Event()  # set by `submit` when the batch being formed has no room left
        self.room = 0  # rows that batch can still take (0: none is being formed)
        self.active: collections.deque[Decode] = collections.deque()
        self.running: list[ChatRequest] = []  # rows of the batch taking its turn now
        self.counters = {"batches": 0, "max_batch_size_seen": 0, "turns": 0, "dropped": 0, "early_events": 0}
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once `run` started

    def submit(self, req: ChatRequest) -> None:
        self.queue.put_nowait(req)
        if self.room:  # a batch is being formed
            self.room -= 1
            if not self.room:
                self.full.set()

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "active_rows": len(self.running) + sum(len(d.reqs) for d in self.active),
            "queued": self.queue.qsize(),
        }

    def publish(self, req: ChatRequest, event: tuple) -> None:
        """Queue `event` for `req` from the worker thread during a turn (a dLLM row's block that is final
        before its batch's: `DllmEngine`), in order before what the turn's end queues."""
        self.counters["early_events"] += 1
        self.loop.call_soon_threadsafe(req.events.put_nowait, event)

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            await self._admit(wait=not self.active)
            if self.active:
                decode = self.active.popleft()
                live = [i for i, r in enumerate(decode.reqs) if not r.cancelled]
                self.counters["dropped"] += len(decode.reqs) - len(live)
                self.engine.keep(decode, live)
                if decode.reqs:
                    await self._turn(
                        decode.reqs, functools.partial(self.engine.step, decode, self.chunk_tokens)
                    )

    async def _admit(self, wait: bool) -> None:
        """Start a batch per sampling setting from what is queued; when idle, wait for requests first."""
        pending = []
        if wait:
            pending.append(await self.queue.get())
            await self._gather(pending)
        while not self.queue.empty():
            pending.append(self.queue.get_nowait())
        groups: dict[tuple, list[ChatRequest]] = {}
        for req in pending:
            groups.setdefault(req.batch_key(), []).append(req)
        for group in groups.values():
            for start in range(0, len(group), self.max_batch_size):
                batch = [r for r in group[start : start + self.max_batch_size] if not r.cancelled]
                self.counters["dropped"] += min(self.max_batch_size, len(group) - start) - len(batch)
                if batch:
                    self.counters["batches"] += 1
                    self.counters["max_batch_size_seen"] = max(
                        self.counters["max_batch_size_seen"], len(batch)
                    )
                    await self._turn(batch, functools.partial(self.engine.prefill, batch))

    async def _gather(self, pending: list[ChatRequest]) -> None:
        """Collect the requests sent together with `pending[0]`: they arrive a few ms apart. Windows of
        `batch_wait_s` while requests keep arriving or are being read (the latter for at most
        `settle_s`), but not once the batch is full: waiting longer cannot grow it."""
        loop = asyncio.get_running_loop()
        settle = loop.time() + self.settle_s
        try:
            while True:
                while not self.queue.empty() and len(pending) < self.max_batch_size:
                    pending.append(self.queue.get_nowait())
                if len(pending) >= self.max_batch_size:
                    return
                # `submit` wakes this wait only when the batch fills, not per arrival: a wake costs the
                # loop time the next arrivals' reading needs.
                self.room = self.max_batch_size - len(pending)  # the queue is drained: not full
                self.full.clear()
                try:
                    async with asyncio.timeout(self.batch_wait_s):
                        await self.full.wait()
                except TimeoutError:
                    if self.queue.empty() and not (self.incoming() and loop.time() < settle):
                        return
        finally:
            self.room = 0

    async def _turn(self, reqs: list[ChatRequest], work) -> None:
        """Run one turn (`work` returns the batch's Decode) in a thread, answer the rows it finished and
        requeue the batch while rows are live."""
        self.counters["turns"] += 1
        self.running = reqs
        try:
            decode = await asyncio.to_thread(work)
        except DecodeAborted as e:  # nobody waits for these rows any more: drop the batch
            log.info("%s", e)
            self.counters["dropped"] += len(reqs)
            for req in reqs:
                req.events.put_nowait(("error", e))
            return
        except Exception as e:  # answer every waiter; the server keeps running
            log.exception("generation failed")
            for req in reqs:
                req.events.put_nowait(("error", e))
            return
        finally:
            self.running = []
        for req in reqs:
            if req.finish_reason is not None:
                req.events.put_nowait(("done", self.engine.result(req)))
            elif req.stream:
                req.events.put_nowait(("tokens", list(req.tokens)))
        # Let the streams send what this turn committed before the next turn's thread competes with
        # them for the GIL: a few loop iterations (each stream takes its event and writes it in one).
        for _ in range(8):
            if all(r.events.empty() for r in reqs):
                break
            await asyncio.sleep(0)
        if decode.reqs:
            self.active.append(decode)
