"""Production services started by tests, offline: an S3 endpoint (moto server), PostgreSQL (pgserver)
and an `mlflow server` on both, each a context manager that cleans up.

    from _services import moto_s3, postgres, mlflow_server
    with moto_s3("bucket") as s3:              # s3.endpoint, s3.env (AWS_* + endpoint vars), s3.stop(), s3.keys()
        with postgres(tmp) as pg_uri:          # postgresql+psycopg://postgres:@/postgres?host=<socket dir>
            with mlflow_server(pg_uri, "s3://bucket/mlflow", s3.env) as uri:   # http://127.0.0.1:PORT
                ...

Every server runs as a child process in its own process group (killed by group on exit) and is polled
until it answers, so a test never races its start. A test module wraps them in its own fixtures (a
fixture imported from here would be shadowed by the test's argument of the same name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dllmflow.common.net import free_port

BIN = Path(sys.executable).parent


def wait_until(
    ready: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float, log: Path | None = None
) -> None:
    """Poll `ready()` until it is true; fail with the end of the server's log when it exits or times out."""
    deadline = time.time() + timeout
    while not ready():
        tail = log.read_text()[-4000:] if log and log.is_file() else ""
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not answer in {timeout:.0f} s:\n{tail}")
        time.sleep(0.5)


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def start(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """A server child in its own process group (so `stop` also ends the workers it forks)."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# ---- S3 (moto) -----------------------------------------------------------------------------------


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        """Take the endpoint down (its data is lost: moto keeps it in memory)."""
        stop(self.proc)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


def s3_env(endpoint: str) -> dict[str, str]:
    """What every client (boto3, s3fs, MLflow, Metaflow, DVC's env, dllmflow.training.storage) needs to
    talk to `endpoint` with test credentials."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
        "METAFLOW_S3_ENDPOINT_URL": endpoint,
    }


@contextlib.contextmanager
def moto_s3(bucket: str = "dllmflow", log: Path | None = None) -> Iterator[S3Server]:
    """`moto_server` on a free port with `bucket` created; sets the AWS_* test credentials in this
    process too (boto3 and s3fs read them) and restores the environment after."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log=log)
    env = s3_env(endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        wait_until(lambda: _http_ok(endpoint + "/moto-api/"), proc, "moto_server", 60, log)
        server = S3Server(endpoint, bucket, proc, env)
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        stop(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- PostgreSQL (pgserver) ---------------------------------------------------------------------------


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A PostgreSQL 16 server from pgserver's wheel; yields a SQLAlchemy URI over its unix socket
    (`postgresql+psycopg://postgres:@/postgres?host=<dir>`, the dialect MLflow's SQLAlchemy takes).
    The data dir is short and under /tmp: a unix socket path is limited to ~107 characters."""
    import pgserver

    pgdata = Path(tempfile.mkdtemp(prefix="pg-", dir="/tmp"))
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    try:
        uri = server.get_uri()  # postgresql://postgres:@/postgres?host=<pgdata>
        yield uri.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        server.cleanup()
        shutil.rmtree(pgdata, ignore_errors=True)


# ---- MLflow server --------------------------------------------------------------------------------------


def mlflow_server_args(backend_uri: str, artifacts: str, port: int) -> list[str]:
    """The flags infra/k8s/mlflow.yaml runs the server with (host aside): a SQL backend store, artifacts
    proxied by the server (clients need no S3 credentials) to an S3 destination."""
    return [
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        artifacts,
        "--serve-artifacts",
        "--workers",
        "1",
    ]


@contextlib.contextmanager
def mlflow_server(
    backend_uri: str, artifacts: str, env: dict[str, str], log: Path | None = None
) -> Iterator[str]:
    """`mlflow server` on a free port; yields http://127.0.0.1:PORT once /health answers (the first
    start on PostgreSQL runs the schema migrations: allow minutes on a busy 2-core machine)."""
    port = free_port()
    server_env = {**os.environ, **env, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = start([str(BIN / "mlflow"), *mlflow_server_args(backend_uri, artifacts, port)], server_env, log)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _http_ok(uri + "/health"), proc, "mlflow server", 240, log)
        yield uri
    finally:
        stop(proc)
