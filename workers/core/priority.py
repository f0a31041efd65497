"""The ``priority`` scheduling policy (vLLM's ``--scheduling-policy priority``): a request's ``priority`` (an int,
lower runs sooner, default 0) orders the waiting queue before tenant fairness does, and a better-placed arrival
may take a worse running request's place.

- Waiting: the fair queue keeps one FIFO per (tenant, priority) and picks the head with the best *effective*
  priority, then the tenant's virtual time. Aging bounds starvation: a waiting request gains one level per
  ``AGING_S`` seconds waited, up to the best of 0 and its own (a bulk line at 100 catches up with interactive
  traffic at 0 within ~100 s; it never overtakes a request placed above 0).
- Running: requests are planned best-first, so the token budget and KV blocks go to better ones first, and the
  victim of a preemption is the worst-placed, latest one. A running prefill chunk of a request placed below the
  best waiting one is held back a step, leaving the budget to the arrival (decodes always run: one token each).
- Arrival: when the best waiting request is placed above some running ones and finds no KV blocks or no sequence
  slot, the worst of those are preempted (recomputed later, as any preemption) until it fits.

Under ``fcfs`` (the default of vLLM, not of kvgate) every request must have priority 0: the engine refuses others.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.core.request import Request

POLICIES = ("fcfs", "priority")
AGING_S = 1.0


def effective(req: Request, now: float) -> int:
    """The level a request competes at now (lower is sooner), waiting or running: one measure on both sides.
    (Comparing running requests by their own priority and waiting ones by this let a preempted request, back in
    the queue and aged, take its place again at once, step after step: a livelock the property test found.)"""
    aged = req.priority - int(max(0.0, now - req.arrival_time) / AGING_S)
    return max(aged, min(req.priority, 0))


def running_order(now: float) -> Callable[[Request], int]:
    """Best first by effective level (a stable sort: admission order within a level, as under fcfs): the token
    budget is spent in this order; a preemption takes from the end, the worst-placed, most recently admitted."""
    return lambda req: effective(req, now)


class BackgroundBudget:
    """The prompt tokens a step still gives requests placed below 0 (``SchedulerConfig.background_budget``):
    their prefill chunks (a prompt, or a recompute after preemption) share it; their decodes are never cut."""

    def __init__(self) -> None:
        self._left = 0

    def start_step(self, budget: int) -> None:
        self._left = budget

    @staticmethod
    def _counts(req: Request) -> bool:
        """A request placed below 0 with more than its next token to compute: not a decode."""
        return req.priority > 0 and req.num_tokens - req.num_computed_tokens > 1

    def cap(self, req: Request, n: int) -> int:
        """``n`` tokens of ``req`` this step, cut to what is left where it counts (0: none left this step)."""
        return min(n, self._left) if self._counts(req) else n

    def take(self, req: Request, n: int) -> None:
        if self._counts(req):
            self._left = max(0, self._left - n)


def holds_back(running: Request, best_waiting: int | None, now: float) -> bool:
    """Whether ``running``'s prefill chunk waits this step for a better-placed arrival."""
    prefilling = running.num_computed_tokens < running.num_tokens - 1
    return best_waiting is not None and prefilling and effective(running, now) > best_waiting
