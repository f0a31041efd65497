"""tests/ports.py: the ports test servers are started on lie below the kernel's ephemeral range and are free."""

from __future__ import annotations

import socket

from tests import ports


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    start = ports._ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert 1024 <= port < start, (port, start)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
