"""One way to reach an object store (any fsspec URL: s3://, gs://, a local path), for every stage that
uses one: checkpoints (`checkpoint.remote_dir`, training/storage.py) and prepared data
(`dataset.remote_dir`, data/remote.py). For S3 the endpoint comes from DLLMFLOW_S3_ENDPOINT_URL or
AWS_ENDPOINT_URL (MinIO, moto).

    fs, path = remote_fs("s3://bucket/prefix")      # the filesystem and the path without the scheme
    retried(lambda: fs.cat_file(key), give_up=lambda e: UserError(f"{url}: ..."))   # backoff, then one line
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from dllmflow.errors import UserError

ENDPOINT_ENVS = ("DLLMFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
RETRY_ATTEMPTS = 5  # an unreachable store: tries before the caller's one-line error
RETRY_WAIT_S = (0.5, 8.0)  # exponential backoff between tries, from .. to
T = TypeVar("T")


def endpoint_url() -> str | None:
    return next((os.environ[k] for k in ENDPOINT_ENVS if os.environ.get(k)), None)


def remote_fs(url: str, single_try: bool = False) -> tuple[Any, str]:
    """(fsspec filesystem, path without the scheme) of `url`; S3 gets the endpoint from the env.
    `single_try`: S3 calls are not retried inside the client (botocore's retries took 14 s to give up on
    a dead endpoint), so the caller's own backoff (tenacity) decides."""
    import fsspec

    options: dict[str, Any] = {}
    endpoint = endpoint_url()
    if url.startswith(("s3://", "s3a://")):
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        if single_try:
            options["config_kwargs"] = {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 10,
            }
    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()  # another process (another rank, the previous attempt) may have written
    return fs, path.rstrip("/")


def transient(e: BaseException) -> bool:
    """Connection trouble (retried), not an answer from the store (a missing key, a refused PUT)."""
    # answers: a missing key, a refused conditional PUT (s3fs: FileExistsError), no access, our own errors
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, UserError)):
        return False
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectionError", "EndpointConnectionError", "ConnectTimeoutError", "TimeoutError",
                         "ReadTimeoutError", "ClientConnectorError", "ServerDisconnectedError"})  # fmt: skip


def retried(fn: Callable[[], T], give_up: Callable[[BaseException], Exception]) -> T:
    """`fn()`, retried with exponential backoff (tenacity) while the store is unreachable (`transient`);
    after RETRY_ATTEMPTS tries `give_up(error)` is raised instead: the caller's one line naming its URL
    and what failed. An answer from the store (a missing key, a refused PUT) is raised at once."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    try:
        for attempt in Retrying(
            retry=retry_if_exception(transient),
            stop=stop_after_attempt(RETRY_ATTEMPTS),
            wait=wait_exponential(multiplier=RETRY_WAIT_S[0], max=RETRY_WAIT_S[1]),
            reraise=True,
        ):
            with attempt:
                return fn()
    except BaseException as e:
        if transient(e):
            raise give_up(e) from None
        raise
    raise AssertionError("unreachable")  # Retrying either returns or raises
