"""Run a command that dies with the process that started it: what keeps a local training from
outliving `dllmflow train`.

    python -m dllmflow.training.tether PARENT_PID -- torchrun --nproc_per_node 2 -m dllmflow.training.main ...

torchx's local schedulers start each replica in a session of its own (`start_new_session`), so a
`kill -9` of the CLI's process group left torchrun and its ranks training to the end, holding the run
dir's lock. The launcher (`launch.build_app`, local schedulers only) runs torchrun through this module:
it asks the kernel for SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`, kept across the exec),
checks that the parent is still PARENT_PID (it may have died before the request), then execs the
command. torchrun answers SIGTERM by stopping its ranks; the kernel frees their lock. Linux only;
elsewhere the command runs untethered. Stdlib only: it must start fast and import no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def tether_to_parent(parent_pid: int) -> bool:
    """SIGTERM to this process when its parent dies (also after an exec); False where unsupported.
    Exits at once if the parent is already gone (this process was reparented before the request)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        sys.exit(f"tether: the process that started this one ({parent_pid}) is gone; not starting")
    return True


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m dllmflow.training.tether PARENT_PID -- COMMAND [ARGS...]")
    tether_to_parent(int(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
