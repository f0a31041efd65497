"""A free TCP port for a server a test starts, chosen below the kernel's ephemeral range.

A port the kernel hands out for ``bind(0)`` is an ephemeral one, and so is the local port of every outgoing
connection: between the test finding it free and the server binding it (seconds later, after the server's imports)
any connection could take it, and CI once saw a gateway exit with "Address already in use" that way (tenth session,
a whole module's fixture lost). Below the range nothing is assigned by the kernel; a port is still checked free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12_000  # ports tried below the range's start


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    start = _ephemeral_start()
    low = max(1024, start - _SPAN)
    rng = random.SystemRandom()
    for _ in range(200 if start > low else 0):  # no room below the range: the kernel's choice, as before
        port = rng.randrange(low, start)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried was taken: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
