"""The exactly-once verdict on a batch that lived through kills (issue 26's goal: every line ends with exactly one
result, none run twice to completion, none lost, billed once), judged from the store and the gateway's log only.

"Ran to completion" is a ``request_finished`` log line with a completed status: the gateway writes it when the
line's answer is whole, before its result is committed. So one case of two completions is by design and not a
failure: the gateway was SIGKILLed after a line's answer was whole and before its commit (that line had no result
when the store was read right after the kill), and the next gateway ran it again; it is billed once, and counted
apart. Two completions in one gateway's life, or a line run again although its result was stored, are bugs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from chaos.batches import FinishedBatch
from chaos.verdict import Check, Measure, check, equal


def _listed(ids: Sequence[str] | set[str], limit: int = 5) -> str:
    ordered = sorted(ids)
    return ", ".join(ordered[:limit]) + (f" (+{len(ordered) - limit} more)" if len(ordered) > limit else "")


def result_checks(fin: FinishedBatch, custom_ids: Sequence[str]) -> list[Check]:
    """Every line has exactly one result (output or error file), none unknown, and none failed."""
    seen = Counter(str(r.get("custom_id")) for r in (*fin.output, *fin.errors))
    expected = set(custom_ids)
    missing = expected - set(seen)
    doubled = {cid for cid, n in seen.items() if n > 1}
    unknown = set(seen) - expected
    codes = Counter(str(((r.get("response") or {}).get("body") or {}).get("error", {}).get("code")
                        if r.get("response") else (r.get("error") or {}).get("code")) for r in fin.errors)
    return [
        equal("the batch completed", fin.status, "completed"),
        check("every line ends with exactly one result", not (missing or doubled or unknown)
              and fin.total == len(expected) == sum(seen.values()),
              f"{sum(seen.values())} results for {len(expected)} lines (total {fin.total})"
              + (f"; missing {_listed(missing)}" if missing else "") + (f"; doubled {_listed(doubled)}" if doubled
                                                                        else "")
              + (f"; unknown {_listed(unknown)}" if unknown else "")),
        check("none lost: every line answered 200 (a kill is waited out, never a failed line)",
              not fin.errors and fin.failed == 0 and fin.completed == len(expected),
              f"{fin.completed} completed, {fin.failed} failed"
              + (f" ({', '.join(f'{c} x{n}' for c, n in codes.items())})" if codes else "")),
    ]


def billing_checks(fin: FinishedBatch) -> list[Check]:
    """One ledger row per result that ran on a worker, with that very result's tokens, and the batch's own
    counters equal to the ledger's sum (a row billed for a run whose result was not kept would differ)."""
    tokens_of = {str(r["id"]): int(r["response"]["body"]["usage"]["completion_tokens"]) for r in fin.output}
    wrong = {rid for rid, n in tokens_of.items() if fin.billed.get(rid) != n}
    stray = set(fin.billed) - {str(r.get("id")) for r in (*fin.output, *fin.errors)}
    total = sum(fin.billed.values())
    return [
        check("billed once: one ledger row per result, with that result's tokens", not wrong and not stray,
              f"{fin.billed_rows} rows for {len(tokens_of)} results" + (f"; wrong {_listed(wrong)}" if wrong else "")
              + (f"; rows without a result {_listed(stray)}" if stray else "")),
        equal("the batch's output tokens = the ledger's", fin.completion_tokens, total),
    ]


def run_checks(fin: FinishedBatch, before: Counter[str], after: Counter[str],
               unstored_at_kill: set[str]) -> tuple[list[Check], dict[str, Measure]]:
    """None ran twice to completion (except the commit the kill cut, counted), and every stored success ran."""
    twice_in_one_life = {rid for rid in (*before, *after) if before[rid] > 1 or after[rid] > 1}
    across = {rid for rid in before if before[rid] == 1 and after[rid] == 1}
    cut_commit = across & unstored_at_kill
    rerun_stored = across - unstored_at_kill
    never_ran = {str(r["id"]) for r in fin.output} - set(before) - set(after)
    bad = twice_in_one_life | rerun_stored
    detail = (f"{sum(before.values())} completions before the gateway kill, {sum(after.values())} after; "
              f"{len(cut_commit)} computed twice because the kill cut their commit (billed once)")
    if twice_in_one_life:
        detail += f"; twice within one gateway's life: {_listed(twice_in_one_life)}"
    if rerun_stored:
        detail += f"; run again although stored: {_listed(rerun_stored)}"
    checks = [check("none ran twice to completion", not bad, detail),
              check("every stored answer ran to completion once (the log check sees every line)", not never_ran,
                    f"no completion logged for {_listed(never_ran)}" if never_ran
                    else f"{len(fin.output)} of {len(fin.output)}")]
    return checks, {"computed_twice_commit_cut": len(cut_commit), "completions_before_kill": sum(before.values()),
                    "completions_after_restart": sum(after.values())}
