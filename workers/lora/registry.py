"""The worker's resident adapters: loaded on demand from ``--lora-dir``, at most ``max_cpu_loras`` kept (LRU).

Loading happens beside the engine, never on its thread: ``acquire`` pins the adapter for a request and, when it is
not resident, starts reading it in a thread of its own (``load_adapter``: read, check, map; tens of ms for a
rank-16 adapter of SmolLM2, which other requests' steps used to wait for). The engine parks the request and
``settle``s the name at each step boundary; the registry's state (resident set, pins) changes only there, on the
engine's thread, so a step only ever sees resident adapters and nothing else needs a lock. A load that fails (a
broken file) is reported once, to every request waiting on that name, and forgotten: a later request retries.

An adapter in use by an unfinished request is pinned (a reference count): evicting it would mean reloading it in
the middle of that request's life. So the bound is soft where more distinct adapters are in flight than
``max_cpu_loras``: the least recently used unpinned ones go first, and the count falls back as requests finish.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch

from workers.grammar_compile import in_thread
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
        # name -> its load in a thread: (the adapter, seconds) or the error; settled on the engine thread
        self._loading: dict[str, concurrent.futures.Future[tuple[LoraAdapter, float]]] = {}
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

    def acquire(self, name: str) -> bool:
        """Pin the adapter for one more request. True: it is resident; False: it is loading beside the engine
        (``settle`` says when it is there). Raises UnknownLora (nothing pinned) for a name that is not one."""
        if name not in self._resident:
            path = self.path(name)
            if name not in self._loading:
                self._loading[name] = in_thread(lambda: self._read(path, name), f"lora-load-{name}")
        self._refs[name] = self._refs.get(name, 0) + 1  # pinned before any eviction, so never itself evicted
        if name in self._resident:
            self._resident.move_to_end(name)
            self._evict()
            return True
        return False

    def _read(self, path: Path, name: str) -> tuple[LoraAdapter, float]:
        """In the load's thread: the adapter built from its files; touches no registry state."""
        t0 = time.perf_counter()
        return load_adapter(path, name, self.base, self.device), time.perf_counter() - t0

    def settle(self, name: str) -> bool | str:
        """On the engine thread, for a name pinned by ``acquire``: True once resident (a finished load is made
        resident here), False while it loads, else why it cannot be loaded (reported once: the failed load is
        forgotten, so the caller gives the reason to every request waiting on the name at once)."""
        if name in self._resident:
            return True
        future = self._loading.get(name)
        if future is None:
            raise RuntimeError(f"LoRA adapter {name!r} is neither resident nor loading")
        if not future.done():
            return False
        del self._loading[name]
        try:
            adapter, seconds = future.result()
        except ValueError as e:  # a broken adapter (load_adapter says what is wrong)
            return str(e)
        except Exception as e:  # noqa: BLE001 - the load thread's failure is this name's, not the worker's
            log.exception("LoRA adapter %s failed to load", name)
            return f"internal error while loading: {type(e).__name__}"
        self.loads += 1
        self.load_seconds += seconds
        self._resident[name] = adapter
        log.info("LoRA adapter %s loaded: rank %d, %.1f MiB, %.1f ms (beside the engine)", name, adapter.rank,
                 adapter.nbytes / 2**20, seconds * 1e3)
        self._evict()
        return True

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` until a load ends: for an engine with nothing else to do, instead of spinning."""
        pending = [f for f in self._loading.values() if not f.done()]  # a done one is settled at the next step
        if pending and len(pending) == len(self._loading):
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

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

    @property
    def loading(self) -> list[str]:
        """Names whose load was started and not yet settled (done or not)."""
        return list(self._loading)

    @property
    def pinned(self) -> dict[str, int]:
        """Unfinished requests per adapter they pin."""
        return dict(self._refs)

    @property
    def loads_in_flight(self) -> int:
        """Loads still reading in their threads."""
        return sum(not f.done() for f in self._loading.values())

    def _evict(self) -> None:
        for name in [n for n in self._resident if self._refs.get(n, 0) == 0]:
            if len(self._resident) <= self.max_cpu_loras:
                return
            del self._resident[name]
            log.info("LoRA adapter %s evicted (least recently used)", name)
