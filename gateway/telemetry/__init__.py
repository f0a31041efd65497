"""What the gateway reports about itself: Prometheus series (worker-level and per-request) and OpenTelemetry tracing."""
