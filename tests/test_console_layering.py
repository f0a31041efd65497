"""The operator console (console/: ``kvgate``, ``kvgatectl``) sits on top (docs/ARCHITECTURE.md, package map): it
may import tenancy, the gateway's command line and config, ipc, common and chaos; nothing imports it back, so
tenancy/ holds the store, limits, ledger and admin operations with no console in them; and no import circle joins
the packages. Read from the source with ``ast`` (every import counts: top-level, in a function, under
``TYPE_CHECKING``), so nothing is imported."""

from __future__ import annotations

from tests.import_graph import REPO, edges, edges_cycle, modules_of

PACKAGES = ("console", "tenancy", "gateway", "workers", "ipc", "common", "chaos", "kernels_cupy")
# The console is the top: chaos is below it (``kvgate chaos`` dispatches to it), so chaos may not import it either.
NEVER_IMPORT_THE_CONSOLE = ("tenancy", "gateway", "workers", "ipc", "common", "chaos", "kernels_cupy")
# What the console may use of the gateway: its command line (``kvgate serve``) and config, never the server itself
# (``gateway.cli`` loads that only when serve runs). The engine is exec'd (``python -m workers.process.cli``), never
# imported.
CONSOLE_MAY_IMPORT = ("console", "tenancy", "ipc", "common", "chaos", "gateway.cli", "gateway.config")
# tenancy/ modules that are console (moved out by issue 27): never again beside the store.
CONSOLE_ONLY = ("cli", "cli_render", "adapter_cli", "worker_cli", "top", "plan", "plan_cli", "plan_model",
                "plan_presets", "plan_render", "admin_client")

MODULES = modules_of(*PACKAGES)
EDGES = edges(MODULES)  # parsed once: every test reads the same graph


def _top(module: str) -> str:
    return module.split(".")[0]


def _where(importer: str, line: int) -> str:
    return f"{MODULES[importer].relative_to(REPO)}:{line}"


def test_the_edges_are_seen() -> None:
    # The parser itself: known arrows must be found, or the rules below check nothing.
    seen = {(a, b) for a, b, _ in EDGES}
    assert ("console.kvgatectl", "tenancy.admin_ops") in seen
    assert ("console.kvgatectl", "console.render") in seen  # from console import render
    assert ("console.kvgate", "gateway.cli") in seen  # inside a function
    assert ("console.kvgate", "chaos.cli") in seen


def test_tenancy_holds_no_console_module() -> None:
    left = [m for m in CONSOLE_ONLY if (REPO / "tenancy" / f"{m}.py").exists()]
    assert not left, f"console modules back in tenancy/ (they belong in console/): {left}"


def test_nothing_below_imports_the_console() -> None:
    upward = [f"{_where(a, line)} imports {b}" for a, b, line in EDGES
              if _top(a) in NEVER_IMPORT_THE_CONSOLE and _top(b) == "console"]
    assert not upward, "the console is imported from below it:\n" + "\n".join(upward)


def test_the_console_imports_only_what_it_drives() -> None:
    ours = set(PACKAGES)
    bad = [f"{_where(a, line)} imports {b}" for a, b, line in EDGES
           if _top(a) == "console" and _top(b) in ours
           and not any(b == allowed or b.startswith(allowed + ".") for allowed in CONSOLE_MAY_IMPORT)]
    assert not bad, "the console imports outside its rule:\n" + "\n".join(bad)


def test_no_import_circle_through_the_console_or_tenancy() -> None:
    found = edges_cycle(e for e in EDGES if _top(e[0]) in ("console", "tenancy") and e[1] in MODULES)
    assert found is None, "import circle: " + " -> ".join(found or ())
