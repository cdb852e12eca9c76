"""Prepared data through an object store (`dataset.remote_dir`, infra/README.md): a prepared set is
published once, and every consumer (the flow's steps, each trainer node) fetches it into its own local
`dataset.prepared_dir`, so no step or node needs a shared volume for the data.

    etag = pointer_etag(remote)                                # when the publisher plans (None: no pointer yet)
    publish_prepared(prepared_dir, remote, expect=etag)        # the set's objects, its manifest last, the pointer
    fetch_prepared(remote, prepared_dir, content_hash=None)    # reuse the local copy, or download, verify, swap in
    local_prepared_dir(settings)                               # what a consumer reads (fetched when remote_dir is set)

Remote layout: content-addressed sets behind one pointer.

    <remote>/sets/<content_hash>/train/*, eval/*, tokenizer/*   the prepared dir's files, as they are
    <remote>/sets/<content_hash>/objects.json                   every file's sha256 and bytes
    <remote>/sets/<content_hash>/manifest.json                  the prepared manifest, uploaded last
    <remote>/manifest.json                                      the pointer {"content_hash", "set"}

A set is complete once its manifest.json is up, and the pointer moves only after that, in one PUT: a
reader following the pointer (or a pinned `dataset.content_hash`) never sees half a set. On S3 the
pointer is written with If-Match on the ETag the publisher read when it planned (If-None-Match when
there was none), so of two flows publishing one URL at once one wins and the other is refused in one
line; neither pointer names a mixed set (other fsspec stores: a check before the write, not atomic).

A fetch downloads into a fresh temporary sibling of the local dir, checks every object against
objects.json and the recomputed content hash against the set's, and swaps it into place: a local copy
of another content hash is replaced whole, never mixed, and a failed fetch leaves nothing behind.
Processes of one machine fetch one at a time (a blocking file lock); the first fetches, the others reuse.
An unreachable store is retried with backoff (tenacity), then named in one line.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dllmflow.common.files import sha256_file
from dllmflow.common.outputs import wait_beside
from dllmflow.common.store import RETRY_ATTEMPTS, endpoint_url, remote_fs, retried
from dllmflow.errors import UserError

from .prepared_dir import (
    MANIFEST,
    PreparedDataError,
    check_prepared_dir,
    content_hash,
    read_manifest,
    swap_into_place,
)

SETS = "sets"
STAGING = "staging"  # <remote>/staging/<plan>/: the fan-out's unit shards and records before the join
OBJECTS = "objects.json"
POINTER = MANIFEST  # <remote>/manifest.json: where a reader starts
T = TypeVar("T")


class PublishRaceError(UserError):
    """Another publisher moved the pointer after this one planned: nothing of this one is pointed at."""


# ---- the store, retried --------------------------------------------------------------------------------


def _retried(remote: str, what: str, fn: Callable[[], T]) -> T:
    def give_up(e: BaseException) -> UserError:
        return UserError(
            f"dataset.remote_dir {remote}: {what} failed {RETRY_ATTEMPTS} times ({type(e).__name__}: "
            f"{str(e)[:160]}) at {endpoint_url() or 'the default endpoint'}; check that the store is "
            "reachable (AWS_ENDPOINT_URL / DLLMFLOW_S3_ENDPOINT_URL, credentials)"
        )

    return retried(fn, give_up)


def _read_json(fs: Any, path: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


# ---- publish -------------------------------------------------------------------------------------------


def pointer_etag(remote: str) -> str | None:
    """The pointer's ETag now (None: nothing published yet): what a publisher expects when it publishes."""
    fs, base = remote_fs(remote, single_try=True)

    def info() -> str | None:
        try:
            meta = fs.info(f"{base}/{POINTER}")
        except FileNotFoundError:
            return None
        return str(meta.get("ETag") or meta.get("etag") or meta.get("mtime") or meta.get("size"))

    return _retried(remote, "reading the pointer", info)


def publish_prepared(prepared_dir: str | Path, remote: str, expect: str | None = "any") -> dict:
    """Upload `prepared_dir` as `<remote>/sets/<hash>/` (skipped when that set is already complete), its
    manifest last, then point `<remote>/manifest.json` at it. `expect`: the pointer ETag read when the
    caller planned (None: there was none; "any": do not check). Returns {"content_hash", "set",
    "uploaded_bytes"}; PublishRaceError when the pointer moved in between."""
    local = Path(prepared_dir)
    manifest = read_manifest(local)
    if not manifest or "content_hash" not in manifest:
        raise UserError(
            f"{local}: not a prepared dataset (no {MANIFEST} with a content_hash): nothing to publish"
        )
    digest = manifest["content_hash"]
    fs, base = remote_fs(remote, single_try=True)
    set_dir = f"{base}/{SETS}/{digest}"
    uploaded = 0
    if _read_json_retried(remote, fs, f"{set_dir}/{MANIFEST}") is None:
        files = sorted(p for p in local.rglob("*") if p.is_file() and _published(p.relative_to(local)))
        objects = {p.relative_to(local).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                   for p in files}  # fmt: skip
        for rel in objects:
            _retried(
                remote, f"upload of {rel}", lambda rel=rel: fs.put_file(str(local / rel), f"{set_dir}/{rel}")
            )
            uploaded += objects[rel]["bytes"]
        body = json.dumps({"content_hash": digest, "files": objects}, indent=1, sort_keys=True).encode()
        _retried(remote, f"upload of {OBJECTS}", lambda: fs.pipe_file(f"{set_dir}/{OBJECTS}", body))
        data = (local / MANIFEST).read_bytes()
        _retried(remote, f"upload of {MANIFEST}", lambda: fs.pipe_file(f"{set_dir}/{MANIFEST}", data))
        uploaded += len(body) + len(data)
    pointer = json.dumps({"content_hash": digest, "set": f"{SETS}/{digest}"}, sort_keys=True).encode()
    _put_pointer(fs, base, remote, pointer, expect, digest)
    return {
        "content_hash": digest,
        "set": f"{remote.rstrip('/')}/{SETS}/{digest}",
        "uploaded_bytes": uploaded,
    }


def _published(rel: Path) -> bool:
    """A prepared dir's own files: not its lock, not a hidden temporary."""
    return not any(part.startswith(".") for part in rel.parts)


def _put_pointer(fs: Any, base: str, remote: str, body: bytes, expect: str | None, digest: str) -> None:
    path = f"{base}/{POINTER}"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    conditional = "s3" in protocols  # S3's conditional PUT; elsewhere a check before the write
    if expect == "any":
        kwargs: dict[str, str] = {}
    elif conditional:
        kwargs = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
    else:
        kwargs = {}
        if pointer_etag(remote) != expect:
            raise _race(remote, digest)
    try:
        _retried(remote, "publishing the pointer", lambda: fs.pipe_file(path, body, **kwargs))
    except OSError as e:  # s3fs reads 412 PreconditionFailed as FileExistsError (If-None-Match) or EINVAL
        if isinstance(e, FileExistsError) or "pre-condition" in str(e).lower():
            raise _race(remote, digest) from None
        raise


def _race(remote: str, digest: str) -> PublishRaceError:
    now = (_pointer(remote) or {}).get("content_hash", "?")
    return PublishRaceError(
        f"dataset.remote_dir {remote}: another prepare published {now[:12]} since this one planned; this one "
        f"({digest[:12]}) is not published (its set's objects may stay, unreferenced): prepare again"
    )


def _read_json_retried(remote: str, fs: Any, path: str) -> dict | None:
    return _retried(remote, f"reading {path.rsplit('/', 1)[-1]}", lambda: _read_json(fs, path))


def _pointer(remote: str) -> dict | None:
    fs, base = remote_fs(remote, single_try=True)
    return _read_json_retried(remote, fs, f"{base}/{POINTER}")


# ---- the fan-out's staging: each unit task in its own pod ------------------------------------------------


def staging_url(remote: str, plan: dict) -> str:
    """Where a plan's units put their shards and records: `<remote>/staging/<the plan's staging name>`
    (unique per plan: a mkdtemp name), so two flows never write into each other's staging."""
    return f"{remote.rstrip('/')}/{STAGING}/{Path(plan['staging']).name}"


def upload_staged(local: str | Path, url: str, names: list[str]) -> int:
    """Upload `names` (paths relative to `local`, a unit's shards then its record last: a record in the
    store means the unit's files are up) to `url`. Returns the bytes sent."""
    fs, base = remote_fs(url, single_try=True)
    sent = 0
    for rel in names:
        _retried(
            url, f"upload of {rel}", lambda rel=rel: fs.put_file(str(Path(local) / rel), f"{base}/{rel}")
        )
        sent += (Path(local) / rel).stat().st_size
    return sent


def download_staged(url: str, local: str | Path, prefix: str = "") -> int:
    """Everything under `url/prefix` into `local/prefix` (the unit tasks' staging, for the join; the
    plan's tokenizer, for a unit). Returns the bytes received."""
    fs, base = remote_fs(url, single_try=True)
    root = f"{base}/{prefix}".rstrip("/")
    try:
        found = _retried(url, f"listing {prefix or 'the staging'}", lambda: fs.find(root, detail=True))
    except FileNotFoundError:
        found = {}
    got = 0
    for key, meta in sorted(found.items()):
        rel = key[len(base) + 1 :]
        dest = Path(local) / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        _retried(url, f"download of {rel}", lambda key=key, dest=dest: fs.get_file(key, str(dest)))
        got += int(meta.get("size") or 0)
    return got


def remove_staged(url: str) -> None:
    """The staging objects of a joined plan (its shards now live in the published set)."""
    fs, base = remote_fs(url, single_try=True)
    with contextlib.suppress(FileNotFoundError):
        _retried(url, "removing the staging", lambda: fs.rm(base, recursive=True))


# ---- fetch ---------------------------------------------------------------------------------------------


def fetch_prepared(remote: str, prepared_dir: str | Path, content_hash_pin: str | None = None) -> dict:
    """Make `prepared_dir` (this machine's) hold the set `content_hash_pin` (None: the one the pointer
    names): reused when it already does, else downloaded whole into a new dir, verified and swapped in.
    Returns {"content_hash", "reused", "fetched_bytes"}."""
    local = Path(prepared_dir)
    with wait_beside(local, "fetch"):
        fs, base = remote_fs(remote, single_try=True)
        digest = content_hash_pin
        if digest is None:
            pointer = _pointer(remote)
            if pointer is None:
                raise UserError(
                    f"dataset.remote_dir {remote}: nothing published there ({POINTER} missing): prepare first"
                )
            digest = pointer["content_hash"]
        here = read_manifest(local) if check_prepared_dir(local) else None
        if here is not None and here.get("content_hash") == digest:
            return {"content_hash": digest, "reused": True, "fetched_bytes": 0}
        set_dir = f"{base}/{SETS}/{digest}"
        objects = _read_json_retried(remote, fs, f"{set_dir}/{OBJECTS}")
        if objects is None or _read_json_retried(remote, fs, f"{set_dir}/{MANIFEST}") is None:
            raise UserError(
                f"dataset.remote_dir {remote}: holds no complete set {digest[:12]} ({SETS}/{digest})"
            )
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.tmp-", dir=local.parent))
        try:
            fetched = _download(fs, remote, set_dir, objects["files"], tmp, digest)
            manifest = json.loads((tmp / MANIFEST).read_text())
            if manifest.get("content_hash") != digest or content_hash(tmp, manifest) != digest:
                raise PreparedDataError(
                    f"{remote}/{SETS}/{digest}: its files do not make the manifest's content hash {digest[:12]}; "
                    "publish the set again"
                )
            swap_into_place(tmp, local)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"content_hash": digest, "reused": False, "fetched_bytes": fetched}


def _download(fs: Any, remote: str, set_dir: str, files: dict, tmp: Path, digest: str) -> int:
    total = 0
    for rel, meta in sorted(files.items(), key=lambda kv: kv[0] == MANIFEST):
        url = f"{remote.rstrip('/')}/{SETS}/{digest}/{rel}"
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            _retried(
                remote,
                f"download of {rel}",
                lambda rel=rel, dest=dest: fs.get_file(f"{set_dir}/{rel}", str(dest)),
            )
        except FileNotFoundError:
            raise PreparedDataError(
                f"{url}: missing from the set of manifest {digest[:12]} (deleted after it was published); "
                "publish the set again"
            ) from None
        if dest.stat().st_size != meta["bytes"] or sha256_file(dest) != meta["sha256"]:
            raise PreparedDataError(
                f"{url}: changed after the set of manifest {digest[:12]} was published (sha256 differs from "
                f"{OBJECTS}); publish the set again"
            )
        total += meta["bytes"]
    return total


def local_prepared_dir(settings) -> str:
    """The prepared dir a consumer reads: `dataset.prepared_dir`, first fetched from `dataset.remote_dir`
    (pinned to `dataset.content_hash` when set) when that is set."""
    d = settings.dataset
    if d.remote_dir:
        fetch_prepared(d.remote_dir, d.prepared_dir, d.content_hash)
    return d.prepared_dir
