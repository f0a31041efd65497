"""Shared fixtures for the whole suite, registered once here instead of imported by hand into each test module.

- ``tests.test_gateway_support``: ``tiny_model_dir`` (a tiny random Llama with smollm2's tokenizer) and real
  ``kvgate serve`` deployments shared by the whole session, one per configuration: ``server`` (the defaults),
  ``fp32_server``, ``fcfs_server``, ``two_worker_server`` and ``smollm2_server``. Import none of these into a test
  module: pytest would make that module an instance of its own (another model directory, another server);
- ``tests.test_browser_support``: Chromium through Playwright and a gateway that allows one cross-origin page;
- ``tests.redis_support``: ``redis_server`` / ``redis_url`` (a private redis-server per module);
- ``tests.postgres_support``: ``postgres_cluster`` / ``postgres_url`` (a private PostgreSQL cluster) and ``any_db``
  (a test of the store on SQLite and on PostgreSQL).

Importing a support module starts nothing: each service starts when a test first asks for its fixture.
"""

import os
import sys

import pytest

# In the parallel pass (pytest-xdist: three processes on two cores) each process's torch runs one intra-op thread
# by default, as the servers the tests start already do (OMP_NUM_THREADS=1, test_gateway_support), and a thread
# that waits at an OpenMP barrier sleeps instead of spinning (the servers inherit that too). With two spinning
# threads per process, every op of an in-process model waited on a thread another process held, and the waiter
# burnt the core that thread needed. Zen 4, beside a busy core: transformers' greedy reference in the golden test
# 45 s on two threads, 24 s on one (the same tokens); the smollm2 determinism test (two threads on purpose) 73 s
# with libgomp's default waits, 45 s passive. The pass (two processes): 566 -> 503 s (threads) -> 470 s (passive).
# The tests about threads (determinism, the kernels' thread sweeps) set their own counts; arithmetic does not
# depend on how a thread waits. libgomp reads the policy when torch loads it, so this runs before any import of it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before tests/conftest.py could set its OpenMP wait policy")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(1)

pytest_plugins = [
    "tests.test_gateway_support",
    "tests.test_browser_support",
    "tests.redis_support",
    "tests.postgres_support",
]

# The longest modules, longest first: 24 to 80 s of one pytest process each (each CI log's --durations).
# `make test` hands whole modules to its processes in collection order (--dist loadscope
# --no-loadscope-reorder); putting these first lets the short ones fill in at the end, so the processes finish
# together. xdist's own reorder (most tests first) sent the one-test wheel build and the drills last, and one
# process waited ~80 s on the other. A scheduling hint only: a module missing here just runs in its usual place.
_LONG_MODULES = (
    "test_gateway_http.py", "test_chaos_restarts.py", "test_batch_api.py", "test_packaging.py",
    "test_determinism.py", "test_golden_smollm2.py", "test_worker_liveness.py", "test_quantization.py",
    "test_kernels_compile.py", "test_chaos_batches.py", "test_chaos_input.py", "test_chaos_clients.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order is kept
