"""``/metrics`` in the Prometheus text format, with vLLM's metric names where they exist.

Per-worker series (label ``worker``) come from each live worker's last Stats heartbeat, so a worker that
died disappears from the exposition instead of reporting stale numbers. The full set of metrics comes with
the observability issue; these are the ones routing and the tests need.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.pool import WorkerPool, WorkerState
from ipc.messages import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, value from a worker's Stats)
_WORKER_METRICS: tuple[tuple[str, str, str, Callable[[Stats], float]], ...] = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
     lambda s: s.running),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", lambda s: s.waiting),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_usage),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", lambda s: s.num_preemptions),
    ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", lambda s: s.prefix_queries),
    ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", lambda s: s.prefix_hits),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", lambda s: s.prompt_tokens_total),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
     lambda s: s.generation_tokens_total),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def render(pool: WorkerPool, model_name: str) -> str:
    lines: list[str] = []
    workers: list[WorkerState] = sorted(pool.workers.values(), key=lambda w: w.worker_id)
    for name, kind, help_, get in _WORKER_METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for w in workers:
            if w.stats is not None:
                lines.append(f"{name}{_labels(model_name=model_name, worker=w.worker_id)} {_num(get(w.stats))}")
    lines += ["# HELP kvgate:workers_ready Workers that said Hello and are alive.",
              "# TYPE kvgate:workers_ready gauge",
              f"kvgate:workers_ready{_labels(model_name=model_name)} {len(workers)}",
              "# HELP kvgate:gateway_requests_in_flight Requests this gateway has handed to workers.",
              "# TYPE kvgate:gateway_requests_in_flight gauge"]
    for w in workers:
        lines.append(f"kvgate:gateway_requests_in_flight{_labels(model_name=model_name, worker=w.worker_id)} "
                     f"{len(w.requests)}")
    return "\n".join(lines) + "\n"
