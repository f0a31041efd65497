"""The gateway's own Prometheus metrics: per-tenant traffic under ``kvgate:`` and the per-request histograms
vLLM's dashboards read (``vllm:time_to_first_token_seconds`` and friends), measured where the client sees them.

One ``GatewayMetrics`` per gateway process owns a private registry (never the global one, so tests and
several apps in one process do not collide). Label values are tenant names (unique in the store), route
templates (never raw paths: bounded cardinality), reasons and worker ids. No label ever carries user text.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ipc.messages import EngineTimings
from tenancy.models import UsageRow
from tenancy.tiers import TIER_NAMES

# The *_created series double the exposition, and no vLLM dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# vLLM's buckets, so existing dashboards' histogram_quantile panels line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for vllm:request_params_n and _best_of
FINISHED = ("stop", "length", "abort")  # vLLM's finished_reason values; anything else counts as abort


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.billed_tokens = 0  # prompt + completion of every ended request (the denominator of cost per token)
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
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                  buckets=PARAMS_N_BUCKETS, registry=r)
        self.params_best_of = Histogram("vllm:request_params_best_of", "Histogram of the best_of request "
                                        "parameter (n where it is not given).", labels, buckets=PARAMS_N_BUCKETS,
                                        registry=r)
        self.restarts = Counter("kvgate:worker_restarts", "Worker processes restarted by the supervisor.",
                                ["model_name", "worker"], registry=r)
        self._engine_histograms(labels)
        self._tier_metrics()
        # Per LoRA adapter (its registered name: operators register them, so the label set is bounded).
        self.lora_requests = Counter("kvgate:lora_requests", "Requests that ran with a LoRA adapter, by adapter and "
                                     "status.", ["adapter", "status"], registry=r)
        self.lora_tokens = Counter("kvgate:lora_tokens", "Tokens of requests run with a LoRA adapter: prompt, "
                                   "cached (of prompt) and completion.", ["adapter", "kind"], registry=r)

    def _tier_metrics(self) -> None:
        """Per tier (tenancy/tiers.py; a Batch API line counts as batch), each with its series from the start."""
        r = self.registry
        self.tier_requests = Counter("kvgate:tier_requests", "Requests that reached a worker, by tier and status.",
                                     ["tier", "status"], registry=r)
        self.tier_refusals = Counter("kvgate:tier_refusals", "Requests no worker was given, by tier and reason "
                                     "(tier_capacity_exceeded: kept out of the headroom of higher tiers, a 429; "
                                     "no_capacity: every worker full, a 503).", ["tier", "reason"], registry=r)
        # TTFT's buckets for both: an interactive tier's queue time is milliseconds, and must be seen as such.
        self.tier_queue_time = Histogram("kvgate:tier_queue_time_seconds", "Time a request's first sequence "
                                         "waited in its worker's queue before it first ran, by tier.", ["tier"],
                                         buckets=TTFT_BUCKETS, registry=r)
        self.tier_ttft = Histogram("kvgate:tier_time_to_first_token_seconds", "Time to first token as the "
                                   "gateway sees it, by tier.", ["tier"], buckets=TTFT_BUCKETS, registry=r)
        self.tier_preemptions = Counter("kvgate:tier_preemptions", "Preemptions of requests' sequences on their "
                                        "workers, by tier (from the engine timings of each finished sequence).",
                                        ["tier"], registry=r)
        for name in TIER_NAMES:
            self.tier_queue_time.labels(name)
            self.tier_ttft.labels(name)
            self.tier_preemptions.labels(name)

    def _engine_histograms(self, labels: list[str]) -> None:
        """Measured by the worker's engine (queue, prefill, decode, iterations) or between its outputs as they
        reach the gateway (inter-token latency, as vLLM's frontend measures it)."""
        r = self.registry

        def latency(name: str, help_: str) -> Histogram:
            return Histogram(name, help_, labels, buckets=LATENCY_BUCKETS, registry=r)

        self.queue_time = latency("vllm:request_queue_time_seconds",
                                  "Histogram of time spent in WAITING phase for request.")
        self.prefill_time = latency("vllm:request_prefill_time_seconds",
                                    "Histogram of time spent in PREFILL phase for request.")
        self.decode_time = latency("vllm:request_decode_time_seconds",
                                   "Histogram of time spent in DECODE phase for request.")
        self.inference_time = latency("vllm:request_inference_time_seconds",
                                      "Histogram of time spent in RUNNING phase for request.")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", labels, buckets=ITERATION_BUCKETS, registry=r)

    # ---- PoolObserver: called from the pool's receive loop ------------------------------------------------

    def iteration(self, worker_id: str, num_batched_tokens: int) -> None:
        self.iteration_tokens.labels(self.model_name, worker_id).observe(num_batched_tokens)

    def inter_token(self, worker_id: str, seconds: float) -> None:
        self.itl.labels(self.model_name, worker_id).observe(seconds)

    def engine_finished(self, worker_id: str, t: EngineTimings) -> None:
        """vLLM's phases: queue = arrival to first scheduled; prefill = scheduled to first token; decode =
        first token to the end; inference = scheduled to the end. A request that never ran has only a queue."""
        w = (self.model_name, worker_id)
        if t.scheduled is None:
            self.queue_time.labels(*w).observe(t.finished)
            return
        self.queue_time.labels(*w).observe(t.scheduled)
        self.inference_time.labels(*w).observe(t.finished - t.scheduled)
        if t.first_token is not None:
            self.prefill_time.labels(*w).observe(t.first_token - t.scheduled)
            self.decode_time.labels(*w).observe(t.finished - t.first_token)

    def refused(self, tier: str, reason: str) -> None:
        self.tier_refusals.labels(tier, reason).inc()

    def tier_finished(self, tier: str, row: UsageRow, timings: Sequence[EngineTimings | None]) -> None:
        """A request that reached a worker ended (``timings``: each sequence's, None where none came back: a
        sequence cut before its end)."""
        self.tier_requests.labels(tier, row.status).inc()
        if row.ttft_ms is not None:
            self.tier_ttft.labels(tier).observe(row.ttft_ms / 1000.0)
        first = timings[0] if timings else None
        if first is not None:
            self.tier_queue_time.labels(tier).observe(first.finished if first.scheduled is None else first.scheduled)
        preempted = sum(len(t.preempted) for t in timings if t is not None)
        if preempted:
            self.tier_preemptions.labels(tier).inc(preempted)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def request_finished(self, row: UsageRow, tenant: str, worker: str | None, n: int = 1,
                         best_of: int = 1) -> None:
        """One request ended on any path (``row`` is its ledger row: the prompt once, the completion tokens of
        all its sequences); ``n`` and ``best_of`` are the sequences it asked for."""
        if row.status == "cancelled":
            self.cancellations.labels(tenant).inc()
        if worker is None:
            return  # never reached a worker: nothing billed, no engine-side request to describe
        self.tokens.labels(tenant, "prompt").inc(row.prompt_tokens)
        self.tokens.labels(tenant, "cached").inc(row.cached_tokens)
        self.tokens.labels(tenant, "completion").inc(row.completion_tokens)
        self.billed_tokens += row.prompt_tokens + row.completion_tokens
        if row.adapter is not None:
            self.lora_requests.labels(row.adapter, row.status).inc()
            for kind, n in (("prompt", row.prompt_tokens), ("cached", row.cached_tokens),
                            ("completion", row.completion_tokens)):
                self.lora_tokens.labels(row.adapter, kind).inc(n)
        w = (self.model_name, worker)
        reason = row.status if row.status in FINISHED else "abort"
        self.success.labels(*w, reason).inc()
        if row.ttft_ms is not None:
            self.ttft.labels(*w).observe(row.ttft_ms / 1000.0)
        if row.latency_ms is not None:
            self.e2e.labels(*w).observe(row.latency_ms / 1000.0)
        self.prompt_tokens.labels(*w).observe(row.prompt_tokens)
        self.generation_tokens.labels(*w).observe(row.completion_tokens)
        self.params_n.labels(*w).observe(n)
        self.params_best_of.labels(*w).observe(best_of)
