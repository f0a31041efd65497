"""Issue 25's chaos drill at its --quick size: adapters registered and unregistered in a loop through the admin API
under 16 streams over the base model and the adapters (a spawned gateway + one CPU worker on the tiny random model,
``--lora-dir`` of random PEFT adapters, loopback). 0 failed streams, 0 leaked KV blocks, 0 worker restarts."""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


def test_lora_churn_quick() -> None:
    [result] = run_quick("lora-churn")
    assert_passed([result])
    m = result.measurements
    assert m["failed_streams"] == 0 and m["leaked_blocks"] == 0 and m["worker_restarts"] == 0, m
    assert isinstance(m["adapter_completions"], int) and m["adapter_completions"] > 0, m


def test_answers_are_judged_against_the_registry_while_each_request_ran() -> None:
    """The drill's judge, on made-up answers: a 404 is expected only while its name changed, a settled name must
    answer as it stands, and anything unclean is a failure whatever the registry did."""
    from chaos.drills.lora_churn import Op, Pick, Registry, judge
    from chaos.load import Outcome

    reg = Registry(registered={"a"}, unregistered={"b"}, ops={"c": [Op("c", "unload", 5.0, 6.0, 200)]})

    def out(i: int, kind: str, status: int, code: str | None = None) -> Outcome:
        return Outcome(i, kind, status, code, headers_at=10.0 + i)

    picks = [Pick("a", "registered", 9.0), Pick("b", "unregistered", 9.0), Pick("c", "registered", 4.0),
             Pick("c", "registered", 4.0), Pick("a", "registered", 9.0), Pick("b", "unregistered", 9.0),
             Pick("base", "base", 9.0), Pick("c", "registered", 7.0)]
    outs = [out(0, "completed", 200), out(1, "rejected", 404, "model_not_found"),
            out(2, "rejected", 404, "model_not_found"), out(3, "completed", 200),
            out(4, "rejected", 404, "model_not_found"), out(5, "completed", 200), out(6, "server_error", 500),
            out(7, "rejected", 404, "model_not_found")]
    outs[7].headers_at = 7.0
    v = judge(reg, picks, outs, late_s=1.0)  # as against several gateways: each re-reads within a second
    assert (v.completed, v.adapter_completed, v.expected_refusals, v.unregistered_refused) == (2, 2, 1, 1)
    assert [s.split(":")[0] for s in v.stale] == ["#4 registered a", "#5 unregistered b"]
    assert [s.split(":")[0] for s in v.late] == ["#7 registered c"]  # 1.0s after c's last change answered
    assert [f.split(":")[0] for f in v.failed] == ["#6 base base"]
    strict = judge(reg, picks, outs)  # the drill's one gateway: no allowance
    assert [s.split(":")[0] for s in strict.stale] == ["#4 registered a", "#5 unregistered b", "#7 registered c"]
    assert not strict.late
