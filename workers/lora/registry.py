"""The worker's resident adapters: loaded on demand from ``--lora-dir``, at most ``max_cpu_loras`` kept (LRU).

Loading happens where a request is added (the engine thread's step boundary), never inside a step: by the time
a step runs, every adapter its rows use is resident. An adapter in use by an unfinished request is pinned (a
reference count): evicting it would mean reloading it in the middle of that request's life, at a step boundary
that did not ask for it. So the bound is soft where more distinct adapters are in flight than
``max_cpu_loras``: the least recently used unpinned ones go first, and the count falls back as requests finish.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch

from workers.lora.adapter import NAME_RE, LoraAdapter, load_adapter
from workers.models.llama import LlamaConfig

log = logging.getLogger(__name__)


class UnknownLora(ValueError):
    """The name is not an adapter this worker can serve (no such directory, or no --lora-dir at all)."""


class LoraRegistry:
    def __init__(self, directory: Path | None, base: LlamaConfig, max_cpu_loras: int,
                 device: torch.device | None = None) -> None:
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {max_cpu_loras}")
        self.directory = directory
        self.base = base
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._refs: dict[str, int] = {}  # unfinished requests per adapter (pinned while > 0)
        self.loads = 0  # adapters read from disk, for tests and stats
        self.load_seconds = 0.0

    def path(self, name: str) -> Path:
        """The adapter's directory under --lora-dir; UnknownLora for a name that cannot be one."""
        if self.directory is None:
            raise UnknownLora(f"LoRA adapter {name!r} requested, but this worker serves none (no --lora-dir)")
        if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
            raise UnknownLora(f"{name!r} is not a valid LoRA adapter name")
        path = self.directory / name
        if not path.is_dir():
            raise UnknownLora(f"unknown LoRA adapter {name!r}")
        return path

    def acquire(self, name: str) -> LoraAdapter:
        """The adapter, loaded if it is not resident, and pinned for one more request. Raises UnknownLora or
        ValueError (a broken adapter: nothing is loaded)."""
        adapter = self._resident.get(name)
        if adapter is None:
            t0 = time.perf_counter()
            adapter = load_adapter(self.path(name), name, self.base, self.device)
            self.loads += 1
            self.load_seconds += time.perf_counter() - t0
            self._resident[name] = adapter
            log.info("LoRA adapter %s loaded: rank %d, %.1f MiB, %.1f ms", name, adapter.rank,
                     adapter.nbytes / 2**20, (time.perf_counter() - t0) * 1e3)
        self._resident.move_to_end(name)
        self._refs[name] = self._refs.get(name, 0) + 1  # pinned before any eviction, so never itself evicted
        self._evict()
        return adapter

    def release(self, name: str) -> None:
        """One request using ``name`` finished."""
        n = self._refs.get(name, 0) - 1
        if n < 0:
            raise RuntimeError(f"LoRA adapter {name!r} released more often than acquired")
        if n:
            self._refs[name] = n
        else:
            del self._refs[name]
            self._evict()

    def get(self, name: str) -> LoraAdapter:
        """A resident adapter (a step's rows only use pinned ones), marked as recently used."""
        adapter = self._resident[name]
        self._resident.move_to_end(name)
        return adapter

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def _evict(self) -> None:
        for name in [n for n in self._resident if self._refs.get(n, 0) == 0]:
            if len(self._resident) <= self.max_cpu_loras:
                return
            del self._resident[name]
            log.info("LoRA adapter %s evicted (least recently used)", name)
