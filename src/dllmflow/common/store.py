"""One way to reach an object store (any fsspec URL: s3://, gs://, a local path), for every stage that
uses one: checkpoints (`checkpoint.remote_dir`, training/storage.py) and prepared data
(`dataset.remote_dir`, data/remote.py). For S3 the endpoint comes from DLLMFLOW_S3_ENDPOINT_URL or
AWS_ENDPOINT_URL (MinIO, moto).

    fs, path = remote_fs("s3://bucket/prefix")      # the filesystem and the path without the scheme
"""

from __future__ import annotations

import os
from typing import Any

ENDPOINT_ENVS = ("DLLMFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


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
