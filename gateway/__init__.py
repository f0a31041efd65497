"""kvgate gateway: the OpenAI-compatible HTTP front of kvgate, one Trio process.

``cli`` (the ``kvgate`` command), ``server`` (``serve``'s lifecycle), ``config`` and ``state`` (what the routes
share) sit here; ``api/`` is the Quart app and its route modules, ``pipeline/`` one request from parsed JSON to
its last SSE byte and its ledger row, ``fleet/`` the worker pool, routing and supervisor, ``telemetry/`` metrics
and tracing. The gateway talks to workers only over ``ipc`` and never imports ``workers`` or torch
(docs/ARCHITECTURE.md)."""
