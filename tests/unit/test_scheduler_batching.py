"""How the serving `Scheduler` forms batches, against a stand-in engine that records what it was given
(no model): a full batch starts without waiting out the batching window, a batch still collects
requests that arrive a little apart, and a turn's events reach the streams before the next turn.

    pytest tests/unit/test_scheduler_batching.py
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from dllmflow.inference.engine import ChatRequest
from dllmflow.inference.scheduler import Scheduler


@dataclass
class _Decode:
    reqs: list[ChatRequest]


@dataclass
class RecordingEngine:
    """Each batch finishes at its first turn; records the loop time and rows of every prefill."""

    blocks: int = 1  # turns per batch
    prefills: list[tuple[float, int]] = field(default_factory=list)

    def prefill(self, reqs):  # runs in a worker thread: the loop's clock is time.monotonic
        self.prefills.append((time.monotonic(), len(reqs)))
        return self.step(_Decode(list(reqs)), 1)

    def step(self, decode, num_tokens):
        for req in decode.reqs:
            req.tokens.append(7)
            if len(req.tokens) >= self.blocks:
                req.finish_reason = "length"
        decode.reqs = [r for r in decode.reqs if r.finish_reason is None]
        return decode

    def keep(self, decode, rows):
        decode.reqs = [decode.reqs[i] for i in rows]

    def result(self, req):
        return {"tokens": list(req.tokens)}


def _req(stream: bool = False) -> ChatRequest:
    return ChatRequest([1, 2], 4, 0.0, 1.0, stream=stream)


async def _run(scheduler: Scheduler, body):
    worker = asyncio.create_task(scheduler.run())
    try:
        return await body()
    finally:
        worker.cancel()


def test_a_full_batch_starts_without_waiting_out_the_window():
    engine = RecordingEngine()
    scheduler = Scheduler(engine, max_batch_size=3, batch_wait_s=30.0)
    reqs = [_req() for _ in range(3)]

    async def body():
        submitted = time.monotonic()
        for r in reqs:
            scheduler.submit(r)
        async with asyncio.timeout(10):  # the window is 30 s: only an early start answers in time
            done = [await r.events.get() for r in reqs]
        return submitted, done

    submitted, done = asyncio.run(_run(scheduler, body))
    assert [kind for kind, _ in done] == ["done"] * 3
    assert len(engine.prefills) == 1 and engine.prefills[0][1] == 3
    assert engine.prefills[0][0] - submitted < 30.0


def test_requests_arriving_apart_within_the_window_share_a_batch():
    # A 30 s window the three fill (max_batch_size 3), so the batch leaves when the third arrives: how
    # late a loaded machine runs the sleeps below cannot push a request out of it (a 0.3 s window could).
    engine = RecordingEngine()
    scheduler = Scheduler(engine, max_batch_size=3, batch_wait_s=30.0)
    reqs = [_req() for _ in range(3)]

    async def body():
        for r in reqs:  # 0.05 s apart: each arrives inside the window the first one opened
            scheduler.submit(r)
            await asyncio.sleep(0.05)
        for r in reqs:
            await r.events.get()

    asyncio.run(_run(scheduler, body))
    assert engine.prefills and [rows for _, rows in engine.prefills] == [3]
    assert scheduler.counters["batches"] == 1


def test_a_lone_request_waits_one_window_then_decodes_alone():
    engine = RecordingEngine()
    scheduler = Scheduler(engine, max_batch_size=8, batch_wait_s=0.2)
    req = _req()

    async def body():
        submitted = time.monotonic()
        scheduler.submit(req)
        await req.events.get()
        return submitted

    submitted = asyncio.run(_run(scheduler, body))
    ((started, rows),) = engine.prefills
    assert rows == 1 and started - submitted >= 0.2  # it gave others the window to join
    assert scheduler.room == 0  # no batch is being formed any more: later submits wake nothing


def test_streams_take_a_turns_events_before_the_next_turn_starts(monkeypatch):
    """Each turn runs in a worker thread that competes with the streams for the GIL: the scheduler lets
    every stream take the block just committed before it starts the next turn."""
    engine = RecordingEngine(blocks=3)
    scheduler = Scheduler(engine, max_batch_size=4, batch_wait_s=0.01)
    reqs = [_req(stream=True) for _ in range(4)]
    taken: list[int] = []  # per turn started: how many streams had no event left waiting
    to_thread = asyncio.to_thread

    def recording_to_thread(fn, *args):
        taken.append(sum(r.events.qsize() == 0 for r in reqs))
        return to_thread(fn, *args)

    monkeypatch.setattr(asyncio, "to_thread", recording_to_thread)

    async def consume(r):
        while (await r.events.get())[0] != "done":
            pass

    async def body():
        for r in reqs:
            scheduler.submit(r)
        await asyncio.gather(*[consume(r) for r in reqs])

    asyncio.run(_run(scheduler, body))
    assert taken == [4, 4, 4]  # the first turn (nothing sent yet), then blocks 2 and 3
