"""workers/ is the engine and, apart, the process around it (docs/ARCHITECTURE.md, "The engine and its process"):

- ``workers/process/`` is the worker process (command line, start-up step sizing, the engine thread's loop, the
  I/O thread on the ZeroMQ socket, wire frames); everything else in ``workers/`` is the engine;
- the engine imports nothing of the process, nor zmq, Trio or the gateway's stack, even through the modules of
  the repo it imports (``ipc``, ``common``, ``kernels_cupy``): it stays synchronous, drivable in-process (the
  offline ``LLM``, tests) with no sockets or threads of the worker's;
- the engine core (``workers/core/``) is pure: the standard library, itself and the wire's value types only
  (no torch, NumPy, CuPy, kernels, threads);
- no import circle joins workers modules.

Read from the source with ``ast`` (every import counts: top-level, in a function, under ``TYPE_CHECKING``), so
nothing is imported."""

from __future__ import annotations

import sys

from tests.import_graph import REPO, Edge, edges, edges_cycle, modules_of

PROCESS = "workers.process"
# Third-party packages the engine never reaches: the worker process's transport, and the gateway's async stack.
NOT_IN_THE_ENGINE = ("zmq", "trio", "quart", "hypercorn", "gateway", "tenancy", "console", "chaos")
# Threads are the worker process's (its I/O thread) and the grammar compiles' (workers.grammar_compile), not the
# core's; nor is any third-party package.
NOT_IN_THE_CORE = ("threading", "concurrent", "asyncio", "multiprocessing", "queue")
CORE_MAY_IMPORT = ("workers.core", "ipc.messages", "ipc.sampling", "common.speculative")

WORKERS = modules_of("workers")
REPO_MODULES = modules_of("workers", "ipc", "common", "kernels_cupy")


def is_process(module: str) -> bool:
    return module == PROCESS or module.startswith(PROCESS + ".")


def is_core(module: str) -> bool:
    return module == "workers.core" or module.startswith("workers.core.")


def _with_packages(module: str) -> list[str]:
    """``module`` and the packages above it (importing ``a.b.c`` runs ``a`` and ``a.b`` first)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _imports() -> dict[str, list[tuple[str, int]]]:
    """Per repo module, what it imports: repo modules (each with the packages above it) and top-level names of
    everything else, with the line."""
    found: dict[str, list[tuple[str, int]]] = {m: [] for m in REPO_MODULES}
    for importer, target, line in edges(REPO_MODULES):
        if target in REPO_MODULES:
            found[importer].extend((m, line) for m in _with_packages(target) if m in REPO_MODULES)
        elif target.split(".")[0] not in ("workers", "ipc", "common", "kernels_cupy"):  # a name, not a module
            found[importer].append((target.split(".")[0], line))
    return found


IMPORTS = _imports()


def reach(start: str) -> dict[str, list[str]]:
    """Everything ``start`` imports, directly or through repo modules, each with one chain leading to it."""
    chains: dict[str, list[str]] = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        for target, _line in IMPORTS.get(module, ()):
            if target not in chains:
                chains[target] = chains[module] + [target]
                if target in REPO_MODULES:
                    todo.append(target)
    return chains


def workers_edges() -> list[Edge]:
    """Imports between workers modules, less those of a package above the importer: ``from workers import
    structured`` imports the submodule, and a module's packages have run before it anyway (``workers``'s own
    ``__init__`` imports the engine lazily, for ``workers.LLM``: no circle)."""
    return [(a, b, line) for a, b, line in edges(WORKERS, WORKERS) if not a.startswith(b + ".")]


def test_the_split_is_seen() -> None:
    # The parser itself: known arrows must be found, or the rules below check nothing.
    found = {(a, b) for a, b, _ in workers_edges()}
    assert ("workers.process.worker", "workers.engine") in found
    assert ("workers.process.worker", "workers.process.step_sizing") in found  # from workers.process import x
    assert ("workers.engine_build", "workers.models.loader") in found  # inside a function
    assert any(is_process(m) for m in WORKERS) and any(is_core(m) for m in WORKERS)
    assert "zmq" in reach("workers.process.worker") and "torch" in reach("workers.engine")


def test_the_engine_imports_nothing_of_the_process() -> None:
    wrong = []
    for module in sorted(m for m in WORKERS if not is_process(m)):
        for target, chain in reach(module).items():
            if is_process(target) or target in NOT_IN_THE_ENGINE:
                wrong.append(f"{WORKERS[module].relative_to(REPO)}: {' -> '.join(chain)}")
    assert not wrong, "the engine imports the worker process's side:\n" + "\n".join(wrong)


def test_the_core_is_pure() -> None:
    stdlib = sys.stdlib_module_names
    wrong = []
    for module in sorted(m for m in WORKERS if is_core(m)):
        for target, line in IMPORTS[module]:
            where = f"{WORKERS[module].relative_to(REPO)}:{line}"
            if target in REPO_MODULES:
                if not any(target == ok or target.startswith(ok + ".") for ok in CORE_MAY_IMPORT) \
                        and target not in ("workers", "ipc", "common"):
                    wrong.append(f"{where} imports {target}")
            elif target not in stdlib or target in NOT_IN_THE_CORE:
                wrong.append(f"{where} imports {target}")
    assert not wrong, "workers/core/ must stay pure and synchronous:\n" + "\n".join(wrong)


def test_no_import_circle_between_workers_modules() -> None:
    found = edges_cycle(workers_edges())
    assert found is None, "import circle: " + " -> ".join(found or ())
