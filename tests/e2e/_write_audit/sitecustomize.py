"""Test-only: loaded at interpreter start by the "pods" of tests/e2e/test_shared_nothing.py (this dir first
on their PYTHONPATH; torchrun's agent and workers, pip and every other Python child inherit it). With
DLLM_TEST_WRITE_LOG=<dir>, an audit hook (PEP 578) appends to <dir>/<pid>.log, one line per event, every
path this interpreter opens for writing, creates, renames to, links, removes or changes: what the test
checks lies in the pod's own dirs. Writes by C/C++/Rust code that opens a path itself (torch's zip writer,
safetensors) are not seen here; their dirs are (os.mkdir), and the test snapshots every other dir.

Stdlib only, nothing raised from the hook: it must never change what the process does.
"""

from __future__ import annotations

import os
import sys

LOG_ENV = "DLLM_TEST_WRITE_LOG"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# event -> positions of (path, dir_fd) pairs among its arguments that name what is written
_PATHS = {
    "os.mkdir": [(0, 2)],
    "os.rename": [(0, 2), (1, 3)],  # os.replace raises this event too
    "os.remove": [(0, 1)],
    "os.rmdir": [(0, 1)],
    "os.symlink": [(1, 2)],
    "os.link": [(1, 3)],
    "os.truncate": [(0, None)],
    "os.chmod": [(0, 2)],
    "os.chown": [(0, 3)],
    "os.utime": [(0, 3)],
    "os.mkfifo": [(0, 2)],
    "os.mknod": [(0, 3)],
    "shutil.copyfile": [(1, None)],
    "shutil.copytree": [(1, None)],
    "shutil.move": [(0, None), (1, None)],
    "shutil.rmtree": [(0, 1)],
    "sqlite3.connect": [(0, None)],
    "tempfile.mkstemp": [(0, None)],
    "tempfile.mkdtemp": [(0, None)],
}


def _absolute(path, dir_fd) -> str | None:
    if isinstance(path, int) or path is None:
        return None  # an fd: its open was logged
    path = os.fsdecode(path)
    if path in ("", ":memory:"):
        return None
    if not os.path.isabs(path):
        # dir_fd: None, or -1 (CPython's "unset") unless the call named a directory's fd
        base = (
            os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
        )
        path = os.path.join(base, path)
    return os.path.normpath(path)


def _install(log_dir: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open":
                if isinstance(args[2], int) and args[2] & _WRITE_FLAGS:
                    written = [_absolute(args[0], None)]
                else:
                    return
            elif event in _PATHS:
                written = [
                    _absolute(args[i], args[j] if j is not None and j < len(args) else None)
                    for i, j in _PATHS[event]
                    if i < len(args)
                ]
            else:
                return
            lines = "".join(f"{event}\t{p}\n" for p in written if p)
            if lines:
                os.write(fd, lines.encode("utf-8", "surrogateescape"))
        except Exception:  # noqa: BLE001 - an audit hook must not change the process's behaviour
            pass

    sys.addaudithook(hook)


if os.environ.get(LOG_ENV):
    _install(os.environ[LOG_ENV])
