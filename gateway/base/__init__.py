"""The gateway's base layer: value types and errors that every role shares, importing nothing else of ``gateway``.

``errors`` (``APIError``, the one OpenAI-shaped exception any layer raises), ``principal`` (``Principal``, an
authenticated caller), ``handle`` (``RequestHandle``: what the fleet fills and the pipeline reads, with its byte
bounds) and ``worker_security`` (``WorkerSecurity``, the worker socket's configuration). The layer rule of
``gateway/`` (docs/ARCHITECTURE.md, tested by ``tests/test_gateway_layering.py``) lets any module import these;
they import only ``ipc``, ``common``, ``tenancy`` and third-party packages."""
