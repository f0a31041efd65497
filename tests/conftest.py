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

pytest_plugins = [
    "tests.test_gateway_support",
    "tests.test_browser_support",
    "tests.redis_support",
    "tests.postgres_support",
]
