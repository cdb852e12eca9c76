"""`free_port()`: a TCP port nothing listens on right now (local rendezvous, a test or local server).

    port = free_port()            # then hand it to torchrun --master_port, a server's --port ...

The port is drawn at random below the kernel's ephemeral range (Linux: net.ipv4.ip_local_port_range,
32768-60999 by default), where the kernel never puts the source port of an outgoing connection nor an
ask for port 0. A port asked of the kernel (bind to 0) comes from that range, and between this check and
the caller's own bind any process's next connection may take it (seen: torchrun's TCPStore failing with
EADDRINUSE while a moto server beside it served requests).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # above the well-known and most registered service ports
_TRIES = 64
_DRAW = random.SystemRandom()  # not the seeded module state: two seeded processes would pick alike


def free_port(host: str = "127.0.0.1") -> int:
    high = _ephemeral_low() - 1
    for port in _DRAW.sample(range(_LOWEST, high + 1), k=min(_TRIES, high - _LOWEST + 1)):
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # none free there: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return max(_LOWEST + 1, int(_EPHEMERAL.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default (and outside Linux, a range the IANA leaves to services)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
