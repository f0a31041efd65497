"""Speculative decoding, the pure half: config validation, the n-gram proposer, the back-off rule, the block
manager's rollback and the scheduler's accounting of drafts (no model: tokens are handed in)."""

from __future__ import annotations

import pytest

from workers.core import spec_decode
from workers.core.block_manager import BlockManager
from workers.core.outputs import SampledToken, SchedulerOutput
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import Scheduler
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig, SpecState, may_draft, propose_ngram, update_acceptance


# ---- config ---------------------------------------------------------------------------------------
def test_config_from_json_vllm_shape() -> None:
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                                    '"prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 2, 4)
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 5)


@pytest.mark.parametrize("text, match", [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "only one implemented"),
    ('{"method": "ngram"}', "needs 'method' and 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', r"unknown key\(s\) \['draft_model'\]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "acceptance_threshold": 2}', "acceptance_threshold"),
])
def test_config_errors_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_json(text)


# ---- proposer -------------------------------------------------------------------------------------
def test_proposer_prefers_longest_then_most_recent_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 7, 2, 3, 6, 7]
    # suffix (6, 7) occurred at 1..2 (followed by 8, 9, 1); suffix (7,) alone would match later at 6 -> (2, 3)
    assert propose_ngram(tokens, 1, 3, 3) == [8, 9, 1]
    assert propose_ngram(tokens, 1, 1, 3) == [2, 3, 6]  # unigram: the most recent earlier 7 is at 6
    assert propose_ngram(tokens, 3, 3, 3) == []  # no earlier trigram (3, 6, 7)
    assert propose_ngram(tokens, 1, 3, 1) == [8]
    assert propose_ngram([1, 2, 3], 1, 2, 4) == []
    assert propose_ngram([4, 4], 1, 2, 4) == [4]  # the draft may run up to the end of the sequence


def test_proposer_never_matches_across_token_boundaries() -> None:
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: byte patterns that straddle tokens must not count
    tokens = [256, 0, 5, 1, 0]
    assert propose_ngram(tokens, 2, 2, 2) == []
    assert propose_ngram([1, 0, 9, 8, 1, 0], 2, 2, 2) == [9, 8]


# ---- back-off rule --------------------------------------------------------------------------------
def test_backoff_rule_batch_size_acceptance_and_probe() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4, acceptance_threshold=0.3)
    st = SpecState()
    assert may_draft(st, cfg, 4) and not may_draft(st, cfg, 5)  # batch: more than 4 running -> never
    update_acceptance(st, 4, 0)  # EMA 1 -> 0.5
    assert st.acceptance_ema == pytest.approx(0.5) and may_draft(st, cfg, 1)
    update_acceptance(st, 4, 0)  # 0.25 < 0.3: stop drafting
    assert not may_draft(st, cfg, 1)
    for _ in range(spec_decode.PROBE_INTERVAL - 1):
        update_acceptance(st, 0, 0)  # decode steps without a draft
        assert not may_draft(st, cfg, 1)
    update_acceptance(st, 0, 0)
    assert may_draft(st, cfg, 1)  # the probe
    assert not may_draft(st, cfg, 5)  # ... but never in a large batch
    update_acceptance(st, 4, 4)  # the probe was accepted: 0.625, drafting again every step
    assert st.acceptance_ema == pytest.approx(0.625) and st.steps_without_draft == 0 and may_draft(st, cfg, 1)


# ---- block manager rollback -----------------------------------------------------------------------
def _req(rid: str, prompt: list[int], max_tokens: int = 20, eos: frozenset[int] = frozenset(),
         stop_ids: tuple[int, ...] = ()) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop_ids)),
                   eos_token_ids=eos, max_total_tokens=10_000)


def test_trim_frees_only_the_draft_tail_blocks_to_the_front() -> None:
    bm = BlockManager(16, 4)
    r = _req("a", list(range(10)))
    assert bm.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    bm.cache_full_blocks(r)  # blocks 0, 1 full and hashed
    assert bm.allocate_slots(r, 1 + 6)  # 17 tokens -> 5 blocks
    table = list(bm.block_table("a"))
    assert len(table) == 5
    bm.trim("a", 12)  # 12 tokens valid -> 3 blocks
    assert bm.block_table("a") == table[:3]
    assert bm.free_block_ids()[:2] == [table[3], table[4]]  # hashless: evicted first, reused first
    assert bm.num_free_blocks == 16 - 3
    bm.trim("a", 12)  # idempotent
    assert bm.block_table("a") == table[:3]
    with pytest.raises(RuntimeError, match="shared or cached"):
        bm.trim("a", 4)  # block 1 is hashed (prefix cache): never a draft block


# ---- scheduler ------------------------------------------------------------------------------------
def _sched(budget: int = 32, blocks: int = 64, k: int = 4, batch: int = 8) -> Scheduler:
    cfg = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=batch)
    return Scheduler(SchedulerConfig(8, budget, cfg), BlockManager(blocks, 4))


def _prefill(s: Scheduler, first: int) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: SampledToken(first) for x in out.scheduled if x.samples})
    return s.schedule()


def test_draft_is_scheduled_counted_and_rolled_back() -> None:
    s = _sched(budget=32)
    r = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])  # ends in (1, 2): drafts 3, 4, 5, 6
    s.add_request(r)
    out = _prefill(s, 3)  # output so far: [3] -> suffix (1, 2, 3) matched at 0 -> draft 4 5 6 7
    [sr] = out.scheduled
    assert sr.spec_token_ids == (4, 5, 6, 7) and sr.num_new_tokens == 5 and out.num_batched_tokens == 5
    assert sr.input_token_ids() == [3, 4, 5, 6, 7] and sr.samples
    assert len(s.bm.block_table("a")) == 4  # 16 slots: 11 prompt + 1 + 4 drafts
    # the model accepted 4, 5 and then said 9 instead of 6
    [o] = s.update_from_output(out, {"a": [SampledToken(4), SampledToken(5), SampledToken(9)]})
    assert o.new_token_ids == [4, 5, 9] and o.finish_reason is None
    assert r.num_computed_tokens == 14 and r.num_tokens == 15  # prompt + 3 + 4 + 5; 9 is not computed yet
    assert len(s.bm.block_table("a")) == 4  # 14 tokens need 4 blocks: nothing to trim here
    c = s.spec_counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (1, 4, 2, [1, 1, 0, 0])


def test_rejected_draft_blocks_are_freed() -> None:
    s = _sched(budget=32, k=8)
    r = _req("a", list(range(1, 8)) + [1])  # 8 tokens: 2 blocks; suffix (1,) -> draft 2..7, 1
    s.add_request(r)
    out = _prefill(s, 2)  # suffix (1, 2) -> drafts 3 4 5 6 7 1 2 ... (8 at most)
    [sr] = out.scheduled
    k = len(sr.spec_token_ids)
    assert k == 7 and len(s.bm.block_table("a")) == 4  # 8 + 1 + 7 = 16 slots
    free_before = s.bm.num_free_blocks
    s.update_from_output(out, {"a": [SampledToken(0)]})  # nothing accepted
    assert r.num_computed_tokens == 9 and len(s.bm.block_table("a")) == 3 and s.bm.num_free_blocks == free_before + 1


@pytest.mark.parametrize("stop", ["max_tokens", "eos", "stop_id"])
def test_an_accepted_run_stops_where_the_request_finishes(stop: str) -> None:
    s = _sched(budget=32)
    r = _req("a", [1, 2, 3, 4, 5, 6, 1, 2], max_tokens=5 if stop == "max_tokens" else 20,
             eos=frozenset({5}) if stop == "eos" else frozenset(), stop_ids=(5,) if stop == "stop_id" else ())
    s.add_request(r)
    out = _prefill(s, 3)
    [sr] = out.scheduled
    assert sr.spec_token_ids == (4, 5, 6, 1)[: len(sr.spec_token_ids)]
    if stop == "max_tokens":
        assert len(sr.spec_token_ids) == 3  # 1 output so far, 4 to go: 3 drafts + 1 own token at most
    [o] = s.update_from_output(out, {"a": [SampledToken(t) for t in (4, 5, 6, 1, 2)[: len(sr.spec_token_ids) + 1]]})
    expected = {"max_tokens": [4, 5, 6, 1], "eos": [4, 5], "stop_id": [4, 5]}[stop]
    assert o.new_token_ids == expected and r.output_token_ids == [3] + expected
    assert o.finish_reason == ("length" if stop == "max_tokens" else "stop")
    assert s.bm.num_free_blocks == s.bm.num_blocks  # finished: everything freed


def test_no_drafts_in_a_large_batch_and_drafts_never_preempt() -> None:
    s = _sched(budget=64, batch=2)
    for i, prompt in enumerate(([7, 8, 9, 7, 8], [1, 2, 3, 1, 2], [4, 5, 6, 4, 5])):  # no shared prefix: all 3 run
        s.add_request(_req(f"r{i}", prompt))
    out = _prefill(s, 3)
    assert all(not x.spec_token_ids for x in out.scheduled)  # 3 running > 2
    s2 = _sched(budget=64, blocks=5)  # 20 slots
    s2.add_request(_req("a", [1, 2, 3, 4, 1, 2, 3]))  # 7 tokens: 2 blocks, its next token still fits
    s2.add_request(_req("b", [9, 8, 7, 6, 5, 4, 3, 2]))  # 8 tokens: 2 blocks, its next token needs a 3rd
    out = _prefill(s2, 4)  # one block left: a's draft would take it, and b would have to be preempted
    assert plan_of(out) == {"a": 1, "b": 1} and s2.num_preemptions == 0


def plan_of(out: SchedulerOutput) -> dict[str, int]:
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


# ---- config on `kvgate serve`, counters on the wire and in /metrics ------------------------------------
def test_serve_flag_validated_and_forwarded() -> None:
    from gateway.config import EngineArgs

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert EngineArgs(speculative_config=text).argv()[-2:] == ["--speculative-config", text]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
                                      '"prompt_lookup_max": 4}')


def test_spec_counters_travel_in_stats_and_render_as_vllm_metrics() -> None:
    from types import SimpleNamespace

    from gateway.telemetry.metrics import _WORKER_METRICS, _accepted_per_pos
    from ipc.codec import decode, encode
    from ipc.messages import Stats

    st = Stats("w0", 1, 0, 0.5, 10, 20, 0, 0, 0, 5, 9, 1.0, 3, None, ["a"], 4, 12, 7, [4, 2, 1])
    back = decode(encode(st))
    assert back == st
    values = {name: get(back) for name, _, _, get in _WORKER_METRICS}
    assert (values["vllm:spec_decode_num_drafts_total"], values["vllm:spec_decode_num_draft_tokens_total"],
            values["vllm:spec_decode_num_accepted_tokens_total"]) == (4, 12, 7)
    lines = _accepted_per_pos([SimpleNamespace(worker_id="w0", stats=back)], "m")  # type: ignore[list-item]
    assert lines[2:] == [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",worker="w0",'
                         f'position="{i}"}} {n}' for i, n in enumerate([4, 2, 1])]


class _CharTok:
    """Each token id is one character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_stop_string_inside_an_accepted_run_drops_the_tokens_after_it() -> None:
    """A speculative run brings several tokens in one output: those after the one that completes a stop string
    are not sent, not counted in usage, and carry no logprobs."""
    from gateway.pipeline.generation import OutputAssembler
    from ipc.messages import RequestOutputMsg

    asm = OutputAssembler(_CharTok(), ("END",), True)  # type: ignore[arg-type]
    lps = [(-0.5, [])] * 8
    first = asm.add(RequestOutputMsg("r", [ord(c) for c in "ab"], None, 0, lps[:2], None, None))
    d = asm.add(RequestOutputMsg("r", [ord(c) for c in "cENDxyz"], None, 0, lps[:7], None, None))
    assert first.text + d.text == "abc" and d.finish_reason == "stop" and asm.hit_stop_string
    assert d.token_ids == [ord(c) for c in "cEND"] and asm.token_ids == [ord(c) for c in "abcEND"]
    assert d.logprobs is not None and len(d.logprobs) == 4 and len(asm.logprobs) == 6
