"""Progress of the long start-up steps (GGUF conversion, weight loading, kernel build, KV allocation, warm-up).

On a terminal each step shows a live spinner with its elapsed time, then a line with what it took; anywhere
else (a log file, CI) it is two log lines per step. Either way an operator watching a slow first start sees
which step it is in instead of silence. Output goes to stderr, never stdout (the gateway prints the demo key
there), and names only steps and sizes: no model text, no prompts.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

log = logging.getLogger("kvgate.startup")


class StartupProgress:
    def __init__(self, who: str, stream: TextIO | None = None) -> None:
        self.who = who
        self._stream = stream or sys.stderr
        self._live = self._stream.isatty()
        self._t0 = time.monotonic()

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        start = time.monotonic()
        if self._live:
            from rich.console import Console

            console = Console(file=self._stream, stderr=True, highlight=False)
            with console.status(f"{self.who}: {what}..."):
                yield
            console.print(f"[green]✓[/green] {self.who}: {what} ({time.monotonic() - start:.1f}s)")
            return
        log.info("%s: %s...", self.who, what)
        yield
        log.info("%s: %s done in %.1fs", self.who, what, time.monotonic() - start)

    def done(self, summary: str) -> None:
        log.info("%s: %s (start-up took %.1fs)", self.who, summary, time.monotonic() - self._t0)
