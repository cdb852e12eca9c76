"""The trainer's live MLflow logger with a fake client: batching, retry after an outage, the bounded
buffer, and the env contract with the launcher."""

from __future__ import annotations

import logging
import threading
import time

from dllmflow.settings import load_settings
from dllmflow.training import live as live_tracking


class FakeClient:
    """log_batch that fails while `down` is set and records what it received."""

    def __init__(self, down: bool = False):
        self.down = threading.Event()
        if down:
            self.down.set()
        self.calls: list[list] = []
        self.failures = 0

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        if self.down.is_set():
            self.failures += 1
            raise ConnectionError("server down")
        self.calls.append(list(metrics))

    def metrics(self):
        return [m for call in self.calls for m in call]


def _record(i: int) -> dict:
    return {"step": i, "loss": 1.0 / i, "lr": 1e-3, "mode": "mdlm", "skipped": False, "nan": float("nan")}


def test_batches_steps_and_timestamps():
    client = FakeClient()
    live = live_tracking.LiveLogger(client, "r1", flush_every_s=60.0, flush_every_steps=5)
    for i in range(1, 6):
        live.log(_record(i), i)
    deadline = time.time() + 10
    while not client.calls and time.time() < deadline:  # 5 steps due: sent long before flush_every_s
        time.sleep(0.01)
    assert client.calls
    for i in range(6, 13):
        live.log(_record(i), i)
    assert live.close(timeout=10.0)
    got = client.metrics()
    # numeric keys only (no mode/skipped/nan/step), all 12 steps, in order, with real timestamps
    assert {m.key for m in got} == {"train/loss", "train/lr"}
    steps = [m.step for m in got if m.key == "train/loss"]
    assert steps == list(range(1, 13))
    stamps = [m.timestamp for m in got if m.key == "train/loss"]
    assert stamps == sorted(stamps) and stamps[0] > 1_600_000_000_000
    assert 2 <= len(client.calls) < 12  # batches, not one call per step


def test_outage_warns_once_buffers_and_delivers(caplog):
    client = FakeClient(down=True)
    live = live_tracking.LiveLogger(client, "r1", flush_every_s=0.05, flush_every_steps=1, backoff_max_s=0.1)
    with caplog.at_level(logging.WARNING, logger=live_tracking.__name__):
        for i in range(1, 6):
            live.log(_record(i), i)
        assert not live.flush(timeout=0.5)  # still down: nothing delivered, log() never blocked
        assert client.failures >= 2
        client.down.clear()
        assert live.flush(timeout=10.0)
        assert live.close(timeout=5.0)
    assert [m.step for m in client.metrics() if m.key == "train/loss"] == [1, 2, 3, 4, 5]
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_bounded_buffer_drops_oldest_and_close_gives_up(caplog):
    client = FakeClient(down=True)
    live = live_tracking.LiveLogger(client, "r1", flush_every_s=0.05, max_buffer=6, backoff_max_s=0.05)
    with caplog.at_level(logging.WARNING, logger=live_tracking.__name__):
        for i in range(1, 11):
            live.log(_record(i), i)  # 2 metrics per step: 20 logged, 6 kept
        assert live.dropped == 14
        assert not live.close(timeout=0.3)  # the server never returns: close stops waiting
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "dropping the oldest" in messages and "not delivered" in messages
    assert not live._thread.is_alive()


def test_env_contract_and_rank0_only(monkeypatch, tmp_path):
    s = load_settings(registry={"tracking_uri": f"sqlite:///{tmp_path}/m.db"})
    assert live_tracking.tracking_env(s, None) == {}
    env = live_tracking.tracking_env(s, "abc")
    assert env == {live_tracking.RUN_ID_ENV: "abc", live_tracking.URI_ENV: f"sqlite:///{tmp_path}/m.db"}
    monkeypatch.delenv(live_tracking.RUN_ID_ENV, raising=False)
    assert live_tracking.build_live_logger(s, is_main=True, client=FakeClient()) is None
    monkeypatch.setenv(live_tracking.RUN_ID_ENV, "abc")
    assert live_tracking.build_live_logger(s, is_main=False, client=FakeClient()) is None
    off = load_settings(registry={"live_tracking": False})
    assert live_tracking.build_live_logger(off, is_main=True, client=FakeClient()) is None
    client = FakeClient()
    live = live_tracking.build_live_logger(s, is_main=True, client=client)
    live.log(_record(1), 1)
    live.close()
    live.close()  # idempotent (also registered at exit)
    assert [m.step for m in client.metrics()] == [1, 1]
