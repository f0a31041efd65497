"""kvgate's operator console: the ``kvgate`` dispatcher (``console/kvgate.py``: serve, worker, generate, keys,
chaos) and ``kvgatectl`` (``console/kvgatectl.py``: tenants, keys, quotas, tiers, usage, top, plan, workers,
adapters), both Typer. It drives the other packages and nothing imports it: tenancy's admin operations (local
mode) or a gateway's admin API (remote mode), the gateway's own command line (``gateway/cli.py``), the engine's
(``workers.process.cli``, exec'd, never imported) and the chaos drills. ``tests/test_console_layering.py`` holds the
rule (docs/ARCHITECTURE.md, package map)."""
