"""`common.net.free_port`: a port below the kernel's ephemeral range (where no outgoing connection's
source port lands between the pick and the caller's bind), free, and not tied to the seeded `random`."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from dllmflow.common.net import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_the_port_is_free_and_below_the_ephemeral_range():
    low = int(RANGE.read_text().split()[0]) if RANGE.is_file() else 32768
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # raises if it were taken


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        monkeypatch.setattr("dllmflow.common.net._LOWEST", taken)  # the range starts at the taken port ...
        monkeypatch.setattr("dllmflow.common.net._ephemeral_low", lambda: taken + 2)  # ... and holds 2
        assert free_port() == taken + 1


def test_seeded_processes_do_not_pick_alike():
    picks = set()
    for _ in range(5):
        random.seed(0)  # as a seeded trainer or test would
        picks.add(free_port())
    assert len(picks) > 1
