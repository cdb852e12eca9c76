"""Live MLflow tracking against a real `mlflow server` (SQLite backend): rank 0 of the tiny recipe,
trained in-process, sends its metrics while it trains; with the server down, training completes, a
warning says so, and every step arrives once the server is back."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _prepared import prepare_tiny
from _services import mlflow_server_args

from dllmflow.common.net import free_port
from dllmflow.settings import load_settings
from dllmflow.training import live as live_tracking

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "params" / "tiny_mdlm.yaml"
STEPS = 8


def _start_server(port: int, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            *mlflow_server_args(f"sqlite:///{tmp / 'server.db'}", str(tmp / "artifacts"), port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait_healthy(uri: str, server: subprocess.Popen, timeout: float = 240.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(uri + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert server.poll() is None, "mlflow server exited"
        assert time.time() < deadline, f"mlflow server did not answer /health in {timeout:.0f} s"
        time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory, RECIPE, limit=32)


def _settings(prep: Path, uri: str):
    return load_settings(
        RECIPE,
        dataset={"prepared_dir": str(prep)},
        train={"max_steps": STEPS, "log_every": 100},
        checkpoint={"every_steps": 100},
        registry={"tracking_uri": uri, "flush_every_s": 0.2, "flush_timeout_s": 120.0},
    )


def _history(client, run_id: str) -> list:
    return sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)


@pytest.mark.slow
def test_live_metrics_and_server_outage(tmp_path, prep, monkeypatch, caplog):
    from mlflow import MlflowClient

    from dllmflow.training import trainer

    for k, v in live_tracking._HTTP_ENV.items():  # what build_live_logger sets, undone after the test
        monkeypatch.setenv(k, v)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = _start_server(port, tmp_path)
    try:
        _wait_healthy(uri, server)
        s = _settings(prep, uri)
        client = MlflowClient(uri)
        live_run, outage_run = live_tracking.create_run(s), live_tracking.create_run(s)

        # 1) server up: metrics reach the run while training runs (checked from inside step 5)
        monkeypatch.setenv(live_tracking.RUN_ID_ENV, live_run)
        held, seen_mid_training = {}, []

        def capture(settings, is_main, **kw):
            held["live"] = live_tracking.build_live_logger(settings, is_main, **kw)
            return held["live"]

        calls = {"n": 0}
        real_memory_gib = trainer.memory_gib

        def memory_probe(device):  # called once per step, before that step is logged
            calls["n"] += 1
            if calls["n"] == 5:
                assert held["live"].live.flush(timeout=30)
                seen_mid_training.extend(m.step for m in _history(client, live_run))
            return real_memory_gib(device)

        monkeypatch.setattr(trainer, "build_live_logger", capture)
        monkeypatch.setattr(trainer, "memory_gib", memory_probe)
        result = trainer.run_training(s, tmp_path / "live")
        monkeypatch.setattr(trainer, "build_live_logger", live_tracking.build_live_logger)
        monkeypatch.setattr(trainer, "memory_gib", real_memory_gib)
        assert result.final_step == STEPS
        assert seen_mid_training == [1, 2, 3, 4]
        hist = _history(client, live_run)
        assert [m.step for m in hist] == list(range(1, STEPS + 1))
        assert [m.value for m in hist] == pytest.approx(result.losses)
        stamps = [m.timestamp for m in hist]
        assert stamps == sorted(stamps) and stamps[-1] > stamps[0]  # real per-step times
        assert {"train/lr", "train/grad_norm", "train/tps"} <= set(client.get_run(live_run).data.metrics)

        # 2) server down during training: training completes, a warning, then every step arrives
        _stop(server)
        monkeypatch.setenv(live_tracking.RUN_ID_ENV, outage_run)
        restarted: dict = {}

        def restart_later():
            time.sleep(3.0)
            restarted["server"] = _start_server(port, tmp_path)

        thread = threading.Thread(target=restart_later)
        thread.start()
        with caplog.at_level(logging.WARNING, logger=live_tracking.__name__):
            result = trainer.run_training(s, tmp_path / "outage")  # close() waits for the server
        thread.join()
        server = restarted["server"]
        assert result.final_step == STEPS
        messages = [r.getMessage() for r in caplog.records if r.name == live_tracking.__name__]
        assert any("unreachable" in m and "training continues" in m for m in messages), messages
        assert any("reachable again" in m for m in messages), messages
        _wait_healthy(uri, server)
        hist = _history(client, outage_run)
        assert [m.step for m in hist] == list(range(1, STEPS + 1))
        assert [m.value for m in hist] == pytest.approx(result.losses)
    finally:
        _stop(server)
