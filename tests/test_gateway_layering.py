"""gateway/ is strictly layered (docs/ARCHITECTURE.md, "Layers of gateway/"): a module imports modules of its own
layer or of lower ones, never of a higher one, and no import circle joins gateway modules. Read from the source
with ``ast`` (every import counts: top-level, in a function, under ``TYPE_CHECKING``), so nothing is imported."""

from __future__ import annotations

from tests.import_graph import REPO, Edge, cycle, edges, edges_cycle, modules_of

# Lowest first. Layers of one rank are siblings: neither may import the other.
RANKS = {
    "base": 0,  # gateway/base/: shared value types and errors (APIError, Principal, RequestHandle, WorkerSecurity)
    "config": 1,  # gateway/config.py: GatewayConfig, frozen and validated
    "fleet": 2,  # gateway/fleet/: the worker pool, routing, links, supervisor, worker authentication (over ipc)
    "telemetry": 3,  # gateway/telemetry/: Prometheus series (reading the pool), tracing
    "pipeline": 4,  # gateway/pipeline/: one request from parsed JSON to its ledger row, over the pool
    "responses": 5,  # gateway/responses/: the Responses API over the pipeline
    "batches": 5,  # gateway/batches/: the Batch API over the pipeline
    "api": 6,  # gateway/api/: the Quart app, its routes and the state they share
    "composition": 7,  # gateway/server.py, cli.py, __main__.py: build and run the rest
}
TOP_LEVEL = {"gateway": "base", "gateway.config": "config", "gateway.server": "composition",
             "gateway.cli": "composition", "gateway.__main__": "composition"}

MODULES = modules_of("gateway")


def layer_of(module: str) -> str | None:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANKS) else None


def gateway_edges() -> list[Edge]:
    return edges(MODULES, MODULES)


def test_every_gateway_module_has_a_layer() -> None:
    unplaced = [str(p.relative_to(REPO)) for m, p in MODULES.items() if layer_of(m) not in RANKS]
    assert not unplaced, f"place these in a layer (RANKS/TOP_LEVEL here, docs/ARCHITECTURE.md): {unplaced}"


def test_the_edges_are_seen() -> None:
    # The parser itself: known arrows of each import form must be found, or the rule below checks nothing.
    edges = {(a, b) for a, b, _ in gateway_edges()}
    assert ("gateway.fleet.pool", "gateway.base.handle") in edges
    assert ("gateway.api.service_routes", "gateway.telemetry.metrics") in edges  # from gateway.telemetry import m
    assert ("gateway.cli", "gateway.server") in edges  # inside a function


def test_no_gateway_module_imports_a_higher_or_sibling_layer() -> None:
    upward = []
    for importer, target, line in gateway_edges():
        mine, theirs = layer_of(importer), layer_of(target)
        if mine is None or theirs is None:
            continue  # test_every_gateway_module_has_a_layer names it
        if theirs != mine and RANKS[theirs] >= RANKS[mine]:
            where = f"{MODULES[importer].relative_to(REPO)}:{line}"
            upward.append(f"{where} imports {target}: layer {mine} may not import {theirs}")
    assert not upward, "gateway/ imports against its layers:\n" + "\n".join(upward)


def test_no_import_circle_between_gateway_modules() -> None:
    found = edges_cycle(gateway_edges())
    assert found is None, "import circle: " + " -> ".join(found or ())


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}}) is None
