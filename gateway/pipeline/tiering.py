"""What a request is submitted as: its tier (the admission class) and the priority its workers get.

The tier's table is ``tenancy/tiers.py``. A request to a generation route (chat, completions, Responses) runs in
its tenant's tier; a Batch API line always in ``batch``, whatever its tenant's tier (the Batch API is the bulk
class), at a priority no better than ``BATCH_PRIORITY``. Under ``--scheduling-policy fcfs`` the workers refuse any
priority but 0, so the tier changes no priority there (a client's own priority reaches them as before and gets
their 400); admission by tier still applies. The policy is the one this gateway starts its workers with: workers
started by hand must run the same one (as for the Batch API's lines), or an fcfs worker refuses the requests of
interactive and batch tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenancy.tiers import engine_priority

BATCH_LINE_TIER = "batch"


@dataclass(frozen=True)
class Submission:
    tier: str  # the class whose share of each worker's admission bounds the request may fill
    priority: int  # what its Generate carries (lower runs sooner)


def route_submission(tenant_tier: str, requested: int, scheduling_policy: str | None) -> Submission:
    """A request to a generation route by a tenant of ``tenant_tier`` that asked for ``requested`` (0: nothing)."""
    if scheduling_policy == "fcfs":
        return Submission(tenant_tier, requested)
    return Submission(tenant_tier, engine_priority(tenant_tier, requested))


def line_submission(tenant_tier: str, requested: int, floor: int | None) -> Submission:
    """A Batch API line; ``floor``: ``line.batch_priority`` (None under fcfs: the line's priority as written)."""
    if floor is None:
        return Submission(BATCH_LINE_TIER, requested)
    return Submission(BATCH_LINE_TIER, engine_priority(tenant_tier, requested, floor))
