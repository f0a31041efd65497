"""The gateway's own Prometheus metrics: per-tenant traffic under ``kvgate:`` and the per-request histograms
vLLM's dashboards read (``vllm:time_to_first_token_seconds`` and friends), measured where the client sees them.

One ``GatewayMetrics`` per gateway process owns a private registry (never the global one, so tests and
several apps in one process do not collide). Label values are tenant names (unique in the store), route
templates (never raw paths: bounded cardinality), reasons and worker ids. No label ever carries user text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tenancy.models import UsageRow

# The *_created series double the exposition, and no vLLM dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# vLLM's buckets, so existing dashboards' histogram_quantile panels line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISHED = ("stop", "length", "abort")  # vLLM's finished_reason values; anything else counts as abort


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("kvgate:requests", "HTTP requests by route template, status and tenant.",
                                ["route", "status", "tenant"], registry=r)
        self.rejected = Counter("kvgate:rejected_requests", "Requests refused by rate limits or quotas, by reason.",
                                ["tenant", "reason"], registry=r)
        self.auth_failures = Counter("kvgate:auth_failures", "Failed authentications (no tenant: none is known).",
                                     ["reason"], registry=r)
        self.streams = Gauge("kvgate:streams_in_flight", "SSE streams open now.", ["tenant"], registry=r)
        self.tokens = Counter("kvgate:tokens", "Tokens per tenant: prompt, cached (of prompt) and completion.",
                              ["tenant", "kind"], registry=r)
        self.cancellations = Counter("kvgate:client_cancellations", "Requests the client abandoned before the end.",
                                     ["tenant"], registry=r)
        labels = ["model_name", "worker"]
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "worker", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                           "processed.", labels, buckets=TOKEN_BUCKETS, registry=r)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def request_finished(self, row: UsageRow, tenant: str, worker: str | None) -> None:
        """One request ended on any path (``row`` is its ledger row)."""
        self.tokens.labels(tenant, "prompt").inc(row.prompt_tokens)
        self.tokens.labels(tenant, "cached").inc(row.cached_tokens)
        self.tokens.labels(tenant, "completion").inc(row.completion_tokens)
        if row.status == "cancelled":
            self.cancellations.labels(tenant).inc()
        if worker is None:
            return  # never reached a worker: no engine-side request to describe
        w = (self.model_name, worker)
        reason = row.status if row.status in FINISHED else "abort"
        self.success.labels(*w, reason).inc()
        if row.ttft_ms is not None:
            self.ttft.labels(*w).observe(row.ttft_ms / 1000.0)
        if row.latency_ms is not None:
            self.e2e.labels(*w).observe(row.latency_ms / 1000.0)
        self.prompt_tokens.labels(*w).observe(row.prompt_tokens)
        self.generation_tokens.labels(*w).observe(row.completion_tokens)
