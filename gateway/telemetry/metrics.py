"""``/metrics`` in the Prometheus text format, with vLLM's metric names where they exist.

Per-worker series (label ``worker``) come from each live worker's last Stats heartbeat, so a worker that
died disappears from the exposition instead of reporting stale numbers. Below them: the pool's own state (IPC
backlogs, worker time) and, with ``--gpu-hour-cost``, what a token costs. The gateway's per-tenant and
per-request metrics are in ``gateway.telemetry.gateway_metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from gateway.fleet.pool import WorkerPool
from gateway.fleet.worker_state import WorkerState
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
    ("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
     lambda s: s.spec_num_drafts),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
     lambda s: s.spec_num_draft_tokens),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
     lambda s: s.spec_num_accepted_tokens),
)


def _accepted_per_pos(workers: list[WorkerState], model_name: str) -> list[str]:
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines = [f"# HELP {name} Accepted tokens per draft position.", f"# TYPE {name} counter"]
    for w in workers:
        for pos, n in enumerate([] if w.stats is None else w.stats.spec_accepted_per_pos):
            lines.append(f"{name}{_labels(model_name=model_name, worker=w.worker_id, position=str(pos))} {n}")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _cost(model_name: str, worker_seconds: float, gpu_hour_cost: float, billed_tokens: int) -> list[str]:
    """A price per worker-hour (one worker per GPU) over everything billed since the gateway started. For a
    window, dashboards divide increases: increase(kvgate:gpu_cost_total) / increase(kvgate:tokens_total)."""
    cost = worker_seconds / 3600.0 * gpu_hour_cost
    per_1k = cost / (billed_tokens / 1000.0) if billed_tokens else float("nan")
    m = _labels(model_name=model_name)
    return ["# HELP kvgate:gpu_cost_total Worker (GPU) time used since start, priced at --gpu-hour-cost.",
            "# TYPE kvgate:gpu_cost_total counter", f"kvgate:gpu_cost_total{m} {_num(cost)}",
            "# HELP kvgate:cost_per_1k_tokens Cost of worker time per 1000 billed tokens (prompt + completion).",
            "# TYPE kvgate:cost_per_1k_tokens gauge", f"kvgate:cost_per_1k_tokens{m} {_num(per_1k)}"]


_HEALTH_STATES = ("idle", "busy", "slow")


def _budget(w: WorkerState) -> int:
    """The worker's step budget: its last heartbeat's (it sizes its steps again while idle), else its Hello's."""
    reported = w.stats.max_num_batched_tokens if w.stats is not None else 0  # 0: a heartbeat without it
    return reported or w.hello.max_num_batched_tokens


def _liveness(pool: WorkerPool, workers: list[WorkerState], model_name: str) -> list[str]:
    """Step progress and health per worker (slow is load, never a failure), the step budget each chose, the
    send queue per worker, and the workers lost by kind (dead, frozen, hung, ...)."""
    now = trio.current_time()
    lines = ["# HELP kvgate:worker_health 1 for the worker's current state: idle, busy (a step runs) or slow "
             "(a step has run over 1 s; heartbeats still arrive).", "# TYPE kvgate:worker_health gauge"]
    for w in workers:
        health = w.health(now)
        lines += [f"kvgate:worker_health{_labels(model_name=model_name, worker=w.worker_id, state=st)} "
                  f"{int(st == health)}" for st in _HEALTH_STATES]
    per_worker: tuple[tuple[str, str, str, Callable[[WorkerState], float | None]], ...] = (
        ("kvgate:worker_step_seconds", "gauge", "How long the worker's current engine step has run (0 between "
         "steps).", lambda w: w.step_elapsed(now) or 0.0),
        ("kvgate:worker_steps_total", "counter", "Engine steps the worker has completed.",
         lambda w: None if w.stats is None else w.stats.steps_done),
        ("kvgate:worker_max_num_batched_tokens", "gauge", "The worker's token budget per step (set, or sized to "
         "its machine at start and again while idle).", _budget),
        ("kvgate:ipc_send_queue", "gauge", "Messages queued for the worker's sender (bounded).",
         lambda w: w.outbox_depth()))
    for name, kind, help_, get in per_worker:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        values = [(w.worker_id, get(w)) for w in workers]
        lines += [f"{name}{_labels(model_name=model_name, worker=wid)} {_num(v)}" for wid, v in values if v is not None]
    lines += ["# HELP kvgate:workers_lost_total Workers given up on, by kind: exited, goodbye, send_failed, "
              "frozen (no frame for the heartbeat timeout), hung (a step past the step timeout), replaced.",
              "# TYPE kvgate:workers_lost_total counter"]
    lines += [f"kvgate:workers_lost_total{_labels(model_name=model_name, kind=k)} {pool.losses[k]}"
              for k in ("exited", "goodbye", "send_failed", "frozen", "hung", "replaced")]
    lines += ["# HELP kvgate:reconciled_aborts_total Requests a worker held that this gateway did not track "
              "(given up on, or from before a restart), aborted.", "# TYPE kvgate:reconciled_aborts_total counter",
              f"kvgate:reconciled_aborts_total{_labels(model_name=model_name)} {pool.reconciled_aborts}"]
    return lines


def queues(ledger_rows: int, settles: int) -> str:
    """Depths of the gateway's unbounded-by-design queues (each bounded by admission while its sink works)."""
    return ("# HELP kvgate:ledger_queue Usage rows waiting to be committed to the store.\n"
            "# TYPE kvgate:ledger_queue gauge\n"
            f"kvgate:ledger_queue {ledger_rows}\n"
            "# HELP kvgate:settle_queue Quota settlements waiting for the shared (Redis) limiter.\n"
            "# TYPE kvgate:settle_queue gauge\n"
            f"kvgate:settle_queue {settles}\n")


def render(pool: WorkerPool, model_name: str, gpu_hour_cost: float | None = None, billed_tokens: int = 0) -> str:
    lines: list[str] = []
    workers: list[WorkerState] = sorted(pool.workers.values(), key=lambda w: w.worker_id)
    for name, kind, help_, get in _WORKER_METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for w in workers:
            if w.stats is not None:
                lines.append(f"{name}{_labels(model_name=model_name, worker=w.worker_id)} {_num(get(w.stats))}")
    lines += _accepted_per_pos(workers, model_name)
    lines += ["# HELP kvgate:workers_ready Workers that said Hello and are alive.",
              "# TYPE kvgate:workers_ready gauge",
              f"kvgate:workers_ready{_labels(model_name=model_name)} {len(workers)}",
              "# HELP kvgate:gateway_requests_in_flight Requests this gateway has handed to workers.",
              "# TYPE kvgate:gateway_requests_in_flight gauge"]
    for w in workers:
        lines.append(f"kvgate:gateway_requests_in_flight{_labels(model_name=model_name, worker=w.worker_id)} "
                     f"{len(w.requests)}")
    lines += _liveness(pool, workers, model_name)
    aborts = pool.pending_aborts()
    lines += ["# HELP kvgate:ipc_pending_outputs Worker outputs received but not yet taken by their clients.",
              "# TYPE kvgate:ipc_pending_outputs gauge"]
    lines += [f"kvgate:ipc_pending_outputs{_labels(model_name=model_name, worker=w.worker_id)} "
              f"{w.pending_outputs()}" for w in workers]
    lines += ["# HELP kvgate:ipc_pending_aborts Requests whose Abort was queued for a worker that has not yet confirmed "
              "them gone (its next Stats heartbeat does).",
              "# TYPE kvgate:ipc_pending_aborts gauge"]
    lines += [f"kvgate:ipc_pending_aborts{_labels(model_name=model_name, worker=w.worker_id)} "
              f"{aborts.get(w.worker_id, 0)}" for w in workers]
    worker_seconds = pool.worker_seconds()
    lines += ["# HELP kvgate:worker_seconds_total Time workers have been live on this gateway.",
              "# TYPE kvgate:worker_seconds_total counter",
              f"kvgate:worker_seconds_total{_labels(model_name=model_name)} {_num(worker_seconds)}"]
    if gpu_hour_cost is not None:
        lines += _cost(model_name, worker_seconds, gpu_hour_cost, billed_tokens)
    return "\n".join(lines) + "\n"


def lora_requests_info(pool: WorkerPool, max_loras: int) -> str:
    """vLLM's ``vllm:lora_requests_info``: the adapters of the requests in flight, as comma-separated label values
    (running: their worker has sent a token; waiting: not yet), valued at the time of the scrape as vLLM's is. The
    adapters are registered names (an operator's, bounded), sorted, each once."""
    running: set[str] = set()
    waiting: set[str] = set()
    for h in pool.inflight():
        if h.adapter is not None:
            (running if h.generated_tokens else waiting).add(h.adapter)
    labels = _labels(running_lora_adapters=",".join(sorted(running)), max_lora=str(max_loras),
                     waiting_lora_adapters=",".join(sorted(waiting)))
    # Valued at wall time, as vLLM's: a dashboard reads the latest series by its value.
    return ("# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n"
            f"vllm:lora_requests_info{labels} {_num(time.time())}\n")
