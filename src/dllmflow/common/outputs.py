"""Output directories this project may replace or delete, and one writer per directory.

Every directory the project writes as a unit (a prepared dataset, a run dir, an export, a regeneration
output) carries a marker file: the manifest or settings file only this project writes there. Before a
path is replaced or cleared, `check_output_dir` proves it is ours by that marker, never by its name: an
existing file where a directory is expected, or a non-empty directory without the marker, is refused
with one line naming the path, so nothing the project did not create is ever deleted. An output FILE
(`evaluate --output`) is replaced only when it holds the project's JSON of that kind (`check_output_file`,
by its keys): never a symlink, a directory or a file someone else wrote.

    check_output_dir(out, marker="manifest.json", kind="prepared dataset", field="dataset.prepared_dir")
    check_output_file(out, kind="evaluation result", keys=("metrics", "protocol"), field="--output")
    with hold_dir_lock(run_dir, "train"):    # one writer: a second one is refused naming the holder's pid
        ...

The lock is an advisory `fcntl.flock` on `<dir>/.dllmflow.lock`: the kernel releases it when the holder
exits, however it exits, so a crash never leaves a lock that blocks the next run. The file keeps the
last holder's pid and purpose, so a lock found free but naming a process that no longer runs is
reported as stale (the previous writer died) before it is taken over.

Stdlib only (importable from every layer).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from dllmflow.errors import UserError

LOCK_FILE = ".dllmflow.lock"


class OutputPathError(UserError):
    """An output path exists and is not this project's artefact of the expected kind."""


class DirLockedError(UserError):
    """Another process holds the output directory's lock."""


def check_output_dir(path: str | os.PathLike, *, marker: str, kind: str, field: str | None = None) -> bool:
    """Whether `path` holds this project's `kind` (True: it may be replaced), is absent or an empty
    dir (False: write freely); else OutputPathError naming the path. `marker` is the file, relative to
    `path`, that only this project writes into such a dir."""
    path = Path(path)
    named = f"{field} = {path}" if field else str(path)
    if path.is_symlink() and not path.exists():
        raise OutputPathError(
            f"{named}: a dangling symlink, not a {kind} directory; remove it or choose another path"
        )
    if not path.exists():
        return False
    if not path.is_dir():
        raise OutputPathError(f"{named} is an existing file, not a {kind} directory; refusing to replace it")
    entries = [p for p in path.iterdir() if p.name != LOCK_FILE]
    if not entries:
        return False
    if (path / marker).is_file():
        return True
    raise OutputPathError(
        f"{named} is a non-empty directory that is not a {kind} (no {marker}); refusing to replace or delete "
        "it: choose an empty or new path"
    )


def json_object_with(path: str | os.PathLike, keys: Collection[str]) -> bool:
    """Whether the file `path` holds a JSON object with every key in `keys`: a marker proved by its
    content, not by its name (a file the project did not write rarely has them all)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and set(keys) <= data.keys()


def check_output_file(
    path: str | os.PathLike, *, kind: str, keys: Collection[str], field: str | None = None
) -> bool:
    """Whether the output file `path` holds this project's `kind` (a JSON object with `keys`: True, it
    may be replaced) or is absent (False); else OutputPathError naming it: a symlink (the link would be
    replaced by a file), a directory, or a file the project did not write. Nothing is touched."""
    path = Path(path)
    named = f"{field} {path}" if field else str(path)
    if path.is_symlink():
        raise OutputPathError(
            f"{named} is a symlink; refusing to replace it with a {kind}: write to its target"
        )
    if not path.exists():
        return False
    if not path.is_file():
        raise OutputPathError(
            f"{named} is an existing directory or special file, not a {kind}: choose a file path"
        )
    if json_object_with(path, keys):
        return True
    raise OutputPathError(
        f"{named} is an existing file that is not a {kind} (no {'/'.join(sorted(keys))}); refusing to "
        "overwrite it: choose a new path"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@contextlib.contextmanager
def hold_dir_lock(directory: str | os.PathLike, purpose: str) -> Iterator[Path]:
    """Hold `<directory>/.dllmflow.lock` (created with the dir) for the block; another holder anywhere
    on this host (or on a filesystem whose flock is shared) makes this raise DirLockedError naming its
    pid and purpose. A stale record (a holder that died) is reported on stderr and taken over."""
    import fcntl

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            who = (
                f"pid {holder.get('pid', '?')} ({holder.get('purpose', 'unknown')})"
                if holder
                else "another process"
            )
            raise DirLockedError(
                f"{directory} is in use by {who}: one writer per directory; wait for it to finish or stop it"
            ) from None
        previous = _read_holder(fd)
        if previous and isinstance(previous.get("pid"), int) and not _pid_alive(previous["pid"]):
            print(
                f"warning: {path}: stale lock of pid {previous['pid']} ({previous.get('purpose', '?')}), "
                "which exited without releasing it (crashed or killed); taking it over",
                file=sys.stderr,
                flush=True,
            )
        record = json.dumps({"pid": os.getpid(), "purpose": purpose, "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released cleanly: no stale record left behind
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def wait_beside(path: str | os.PathLike, what: str) -> Iterator[None]:
    """One `what` of `path` at a time on this machine: the others wait (ranks of a node for the first one's
    fetch, evaluation branches for one restore). The lock file sits beside `path`, never inside it."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.{what}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}
