"""The worker fleet as the gateway sees it: the pool that submits requests, the per-worker IPC link and state,
routing (which worker takes a request) and the supervisor that starts and restarts worker processes."""
