"""What a request is submitted as: its tier (the admission class) and the priority its workers get.

The tier's table is ``tenancy/tiers.py``. A request to a generation route (chat, completions) runs in its tenant's
tier, or a lower one its OpenAI ``service_tier`` asks for ("default": standard, "flex": batch; "priority" and
"auto" never lift it above its tenant's); a Batch API line always in ``batch``, whatever its tenant's tier (the Batch API is the bulk
class), at a priority no better than ``BATCH_PRIORITY``. Under ``--scheduling-policy fcfs`` the workers refuse any
priority but 0, so the tier changes no priority there (a client's own priority reaches them as before and gets
their 400); admission by tier still applies. The policy is the one this gateway starts its workers with: workers
started by hand must run the same one (as for the Batch API's lines), or an fcfs worker refuses the requests of
interactive and batch tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenancy.tiers import engine_priority, requested_tier

BATCH_LINE_TIER = "batch"


@dataclass(frozen=True)
class Submission:
    tier: str  # the class whose share of each worker's admission bounds the request may fill
    priority: int  # what its Generate carries (lower runs sooner)


def route_submission(tenant_tier: str, requested: int, scheduling_policy: str | None,
                     service_tier: str | None = None) -> Submission:
    """A request to a generation route by a tenant of ``tenant_tier`` that asked for priority ``requested`` (0:
    nothing) and OpenAI's ``service_tier`` (None: nothing; "flex" runs it as batch, "default" as standard; never
    above the tenant's own tier)."""
    runs_as = requested_tier(tenant_tier, service_tier)
    if scheduling_policy == "fcfs":
        return Submission(runs_as, requested)
    return Submission(runs_as, engine_priority(runs_as, requested))


def line_submission(tenant_tier: str, requested: int, floor: int | None) -> Submission:
    """A Batch API line; ``floor``: ``line.batch_priority`` (None under fcfs: the line's priority as written)."""
    if floor is None:
        return Submission(BATCH_LINE_TIER, requested)
    return Submission(BATCH_LINE_TIER, engine_priority(tenant_tier, requested, floor))
