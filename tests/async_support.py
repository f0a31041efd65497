"""Running a coroutine from a synchronous test, whatever ran before it in the same process."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run`` in a thread of its own: once a browser test's session-scoped Playwright (sync API) has
    started in a test process, an asyncio loop stays running on that process's main thread, where asyncio.run
    refuses to start another (which module runs after the browser tests depends on pytest-xdist's split)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()
