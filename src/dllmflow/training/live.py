"""Live MLflow tracking from the trainer: rank 0 sends each step's metrics to the run the launcher
opened, batched, from a background thread, without ever stopping training.

    from dllmflow.training.live import build_live_logger
    live = build_live_logger(settings, is_main=info.is_main)   # None: no run id in the env, or rank > 0
    live.log(record, step)        # non-blocking: a deque append
    live.close()                  # at the end: waits up to registry.flush_timeout_s for the server

The run comes from the environment (`DLLMFLOW_MLFLOW_RUN_ID` + `MLFLOW_TRACKING_URI`), which the flow
(`workflow.finetune.start_tracking`) or `dllmflow train` (training/launch.py) passes to torchx, so the
trainer needs no Metaflow and no `dllmflow.tracking` (a higher layer): it talks to MLflow directly.

When the server is unreachable, metrics stay buffered (one warning, then retries with exponential
backoff); beyond `max_buffer` the oldest are dropped (one more warning). `metrics.jsonl` always holds
every step, and `register` backfills the steps a run is missing (tracking/mlflow_run.py).
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_ID_ENV = "DLLMFLOW_MLFLOW_RUN_ID"
URI_ENV = "MLFLOW_TRACKING_URI"
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limit
MAX_BATCH_PARAMS = 100
# Our own retry loop replaces MLflow's HTTP retries (7 retries, ~2 min), which would hold a batch.
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def resolve_tracking_uri(settings=None) -> str:
    """`registry.tracking_uri`, else MLFLOW_TRACKING_URI, else an absolute `sqlite:///<cwd>/mlflow.db`."""
    if settings is not None and settings.registry.tracking_uri:
        return settings.registry.tracking_uri
    return os.environ.get(URI_ENV) or f"sqlite:///{Path.cwd().absolute() / 'mlflow.db'}"


def tracking_env(settings, run_id: str | None) -> dict[str, str]:
    """What a launcher puts in the trainers' environment so that rank 0 logs into `run_id`."""
    if not run_id:
        return {}
    return {RUN_ID_ENV: run_id, URI_ENV: resolve_tracking_uri(settings)}


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def train_metrics(record: dict[str, Any], step: int, timestamp_ms: int | None = None) -> list:
    """A metrics.jsonl record -> MLflow `Metric`s `train/<key>` at `step` (non-numeric keys dropped)."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    return [
        Metric(f"train/{k}", float(v), ts, step) for k, v in record.items() if k != "step" and is_number(v)
    ]


def param_value(v: Any) -> str:
    import json

    s = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return s[:6000]


def create_run(settings, *, tags: dict[str, str] | None = None, run_name: str | None = None) -> str:
    """A new RUNNING MLflow run in `registry.experiment_name` with the settings as params."""
    from mlflow import MlflowClient
    from mlflow.entities import Param

    for k, v in _HTTP_ENV.items():  # a dead server costs seconds, not MLflow's ~2 min of retries
        os.environ.setdefault(k, v)
    client = MlflowClient(resolve_tracking_uri(settings))
    name = settings.registry.experiment_name
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=run_name or settings.name, tags=tags or {})
    params = [Param(k, param_value(v)) for k, v in settings.flat().items()]
    for i in range(0, len(params), MAX_BATCH_PARAMS):
        client.log_batch(run.info.run_id, params=params[i : i + MAX_BATCH_PARAMS])
    return run.info.run_id


def end_run(settings, run_id: str, status: str = "FINISHED") -> None:
    from mlflow import MlflowClient

    MlflowClient(resolve_tracking_uri(settings)).set_terminated(run_id, status)


class LiveLogger:
    """A bounded buffer of metrics and one daemon thread that sends it with `client.log_batch`, every
    `flush_every_s` seconds or as soon as `flush_every_steps` steps are pending."""

    def __init__(
        self,
        client: Any,
        run_id: str,
        *,
        flush_every_s: float = 5.0,
        flush_every_steps: int = 50,
        max_buffer: int = 200_000,
        close_timeout_s: float = 30.0,
        backoff_max_s: float = 30.0,
    ):
        self.client, self.run_id = client, run_id
        self.flush_every_s, self.flush_every_steps = flush_every_s, flush_every_steps
        self.max_buffer, self.close_timeout_s, self.backoff_max_s = max_buffer, close_timeout_s, backoff_max_s
        self._buf: collections.deque = collections.deque()  # (seq, Metric)
        self._seq = 0
        self._steps_pending = 0
        self._cond = threading.Condition()
        self._closing = False
        self._abandon = threading.Event()  # set when close() gives up: stop retrying
        self._failing = False
        self.dropped = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._loop, name="dllmflow-mlflow-live", daemon=True)
        self._thread.start()

    # ---- the training thread's side: never blocks on the network ----
    def log(self, record: dict[str, Any], step: int) -> None:
        metrics = train_metrics(record, step)
        with self._cond:
            for m in metrics:
                self._seq += 1
                self._buf.append((self._seq, m))
            over = len(self._buf) - self.max_buffer
            if over > 0:
                for _ in range(over):
                    self._buf.popleft()
                if not self.dropped:
                    log.warning(
                        "MLflow live tracking: buffer full (%d metrics); dropping the oldest. They are "
                        "still in metrics.jsonl and `register` backfills them.",
                        self.max_buffer,
                    )
                self.dropped += over
            self._steps_pending += 1
            if self._steps_pending >= self.flush_every_steps:
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far was sent (True) or `timeout` passed (False)."""
        with self._cond:
            self._steps_pending = self.flush_every_steps  # due now
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._buf, timeout=timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Send what is left (waiting up to `timeout`, default `close_timeout_s`), then stop."""
        timeout = self.close_timeout_s if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._abandon.set()
        self._thread.join(5.0)
        left = len(self._buf)
        if left:
            log.warning(
                "MLflow live tracking: %d metrics not delivered to run %s after %.0f s; they are in "
                "metrics.jsonl and `register` backfills them.",
                left,
                self.run_id,
                timeout,
            )
        return left == 0

    # ---- the sender thread ----
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closing or self._steps_pending >= self.flush_every_steps,
                    timeout=self.flush_every_s,
                )
                batch = [self._buf[i] for i in range(min(len(self._buf), MAX_BATCH_METRICS))]
                if not batch:
                    self._steps_pending = 0
                    self._cond.notify_all()
                    if self._closing:
                        return
                    continue
            if not self._send([m for _, m in batch]):
                return  # abandoned by close()
            with self._cond:
                last = batch[-1][0]
                while self._buf and self._buf[0][0] <= last:  # the front may have been dropped meanwhile
                    self._buf.popleft()
                self.sent += len(batch)
                if len(self._buf) < MAX_BATCH_METRICS:
                    self._steps_pending = 0
                self._cond.notify_all()

    def _send(self, metrics: list) -> bool:
        """log_batch with retries (exponential backoff) until it succeeds (True) or close() gives up."""
        import tenacity

        def before_sleep(state: tenacity.RetryCallState) -> None:
            if not self._failing:
                self._failing = True
                log.warning(
                    "MLflow tracking server unreachable (%s); training continues, metrics are buffered "
                    "and retried",
                    state.outcome.exception() if state.outcome else "?",
                )

        retrying = tenacity.Retrying(
            wait=tenacity.wait_exponential(multiplier=0.5, max=self.backoff_max_s),
            stop=tenacity.stop_when_event_set(self._abandon),
            sleep=self._abandon.wait,  # close() cuts a backoff short
            before_sleep=before_sleep,
            retry=tenacity.retry_if_exception_type(Exception),
            reraise=False,
        )
        try:
            retrying(self.client.log_batch, self.run_id, metrics=metrics)
        except tenacity.RetryError:
            return False
        if self._failing:
            self._failing = False
            log.warning("MLflow tracking server reachable again; buffered metrics sent")
        return True


class _SystemMetrics:
    """MLflow's system metrics monitor (CPU, memory, disk, network, GPU) on the same run."""

    def __init__(self, run_id: str, uri: str):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(run_id, tracking_uri=uri)
        self.monitor.start()

    def close(self) -> None:
        self.monitor.finish()


class TrainerTracking:
    """What the trainer holds: the live logger and, optionally, the system metrics monitor. Closed by
    the trainer at its end, or at interpreter exit when training raised (so a failed run's last steps
    still reach MLflow)."""

    def __init__(self, live: LiveLogger, system: _SystemMetrics | None = None):
        self.live, self.system = live, system
        self.closed = False
        atexit.register(self.close)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.live.log(record, step)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.system is not None:
            self.system.close()
        self.live.close()


def build_live_logger(settings, is_main: bool, client: Any = None) -> TrainerTracking | None:
    """The trainer's tracking on rank 0 when a run id was passed in the environment, else None."""
    run_id = os.environ.get(RUN_ID_ENV)
    if not (is_main and run_id and settings.registry.live_tracking):
        return None
    for k, v in _HTTP_ENV.items():
        os.environ.setdefault(k, v)
    uri = resolve_tracking_uri(settings)  # the launcher put the same one in MLFLOW_TRACKING_URI
    if client is None:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
    r = settings.registry
    live = LiveLogger(client, run_id, flush_every_s=r.flush_every_s, close_timeout_s=r.flush_timeout_s)
    system = None
    if r.system_metrics:
        try:
            system = _SystemMetrics(run_id, uri)
        except Exception as e:  # psutil missing, ...: optional, never stops training
            log.warning("MLflow system metrics unavailable: %s", e)
    return TrainerTracking(live, system)
