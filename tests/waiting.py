"""Waiting on a condition in another process (a gateway, its workers, a store), with a deadline.

A test cannot drive a subprocess's clock, so it observes: ``wait_until`` polls what the test can see until it
holds, instead of sleeping for a guessed time (a cache TTL, a heartbeat period) and hoping. Code the test runs
in process on Trio uses the autojump clock instead (tests/test_gateway_sse_ping.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(fetch: Callable[[], T], done: Callable[[T], object] = bool, *, within: float, what: str,
               interval: float = 0.05) -> T:
    """The first value of ``fetch()`` for which ``done`` holds; AssertionError naming ``what`` (and the last
    value seen) once ``within`` seconds pass without one."""
    deadline = time.monotonic() + within
    while True:
        value = fetch()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s (last seen: {value!r})"[:2000])
        time.sleep(interval)
