"""kvgate gateway: the OpenAI-compatible HTTP front of kvgate, one Trio process.

``cli`` (the ``kvgate`` command), ``server`` (``serve``'s lifecycle) and ``config`` sit here; ``base/`` holds the
types every layer shares (errors, principal, request handle, worker security), ``api/`` is the Quart app, its route
modules and the state they share, ``responses/`` and ``batches/`` the Responses and Batch APIs, ``pipeline/`` one
request from parsed JSON to its last SSE byte and its ledger row, ``fleet/`` the worker pool, routing and
supervisor, ``telemetry/`` metrics and tracing. Imports point down only: base < config < fleet < telemetry <
pipeline < responses, batches < api < server and cli (``tests/test_gateway_layering.py``). The gateway talks to
workers only over ``ipc`` and never imports ``workers`` or torch (docs/ARCHITECTURE.md)."""
