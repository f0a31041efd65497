"""Prompt logprobs travel chunk by chunk: each engine step's output of a request carries the prompt logprobs of the
chunk that step computed (never the whole prompt's at the first token, which made one message per request grow with
its prompt and starved a worker's heartbeats), the worker cuts a big step into bounded frames, and the gateway
gathers the chunks into the same response as before."""

from __future__ import annotations

import pytest
import torch
import trio

from gateway.base.handle import RequestHandle, output_bytes
from gateway.pipeline.generation import OutputAssembler
from gateway.pipeline.streaming import follow
from ipc.codec import decode, encode
from ipc.messages import PromptLogprob, RequestOutputMsg, StepOutputs
from tests.test_determinism import _tiny, drain, engine
from tests.test_gateway_units import _FakeTok
from tests.tiny import VOCAB
from workers.core.outputs import StepOutput
from workers.core.sampling_params import SamplingParams
from workers.process.step_frames import entries, step_frames

PROMPT = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(11)).tolist()


def _steps(eng: object, rid: str) -> list[StepOutput]:
    """Step until idle; the outputs of ``rid``, one a step that produced any."""
    outs: list[StepOutput] = []
    while eng.has_unfinished():  # type: ignore[attr-defined]
        outs += [o for o in eng.step() if o.request_id == rid]  # type: ignore[attr-defined]
    return outs


def test_each_step_carries_only_the_prompt_logprobs_of_its_chunk() -> None:
    model, max_len = _tiny("none")
    eng = engine(model, max_len, "none", batched=16)  # chunks of 16, 16 and 8 prompt tokens
    eng.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    outs = _steps(eng, "r")
    # positions 0-15, 16-31, then 32-38 (39 is the last prompt token: it predicts the first generated one)
    assert [len(o.prompt_logprobs or []) for o in outs] == [16, 16, 7, 0]
    assert [len(o.new_token_ids) for o in outs] == [0, 0, 1, 1]  # the chunks that sampled nothing say so alone
    assert all(o.finish_reason is None for o in outs[:3]) and outs[-1].finish_reason == "length"
    whole = engine(model, max_len, "none", batched=512)  # one chunk: the same values, in one output
    whole.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
    one = _steps(whole, "r")
    assert [p for o in outs for p in o.prompt_logprobs or []] == one[0].prompt_logprobs
    assert len(one[0].prompt_logprobs or []) == len(PROMPT) - 1


def test_a_preempted_prompt_does_not_send_a_position_twice() -> None:
    model, max_len = _tiny("none")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    want = drain(engine(model, max_len, "none", batched=16), [("r", PROMPT, params)])["r"]
    eng = engine(model, max_len, "none", batched=16)
    eng.add_request("r", PROMPT, params)
    first = eng.step()  # positions 0-15 went out
    assert [len(o.prompt_logprobs or []) for o in first] == [16]
    s = eng.scheduler
    s._preempt(s.running.pop())  # as the scheduler does for a victim: recomputed from position 0
    later = drain(eng)["r"]
    assert len(later[2]) == len(PROMPT) - 1 - 16  # the recompute sends only what was not sent
    assert list(first[0].prompt_logprobs or []) + later[2] == want[2] and later[:2] == want[:2]


def _lps(n: int, top: int, base: int = 0) -> list[PromptLogprob]:
    return [(-1.0 - (base + i) / 1000, 1 + i % 3, [(t, -2.0 - t / 10) for t in range(top)]) for i in range(n)]


def test_a_big_step_leaves_in_bounded_frames_that_reassemble_in_order() -> None:
    outs = [RequestOutputMsg("a", [], None, 0, None, None, None, None, _lps(300, 20)),
            RequestOutputMsg("b", [7], None, 0, [(-0.5, [(7, -0.5)] * 20)], None, None, None, _lps(200, 20, 300)),
            RequestOutputMsg("c", [9], "length", 0, None, None, None)]
    frames = step_frames(outs, 512, cap=1000)
    assert len(frames) > 5 and all(sum(entries(o) for o in f.outputs) <= 1000 for f in frames)
    assert [f.num_batched_tokens for f in frames] == [512] + [0] * (len(frames) - 1)  # the step counted once
    got = [o for f in frames for o in decode(encode(f)).outputs]  # type: ignore[attr-defined]
    for orig in outs:
        mine = [o for o in got if o.request_id == orig.request_id]
        assert [p for o in mine for p in o.prompt_logprobs or []] == (orig.prompt_logprobs or [])
        assert all(not o.new_token_ids and o.finish_reason is None for o in mine[:-1])  # tokens come last
        assert (mine[-1].new_token_ids, mine[-1].finish_reason, mine[-1].logprobs) == (
            orig.new_token_ids, orig.finish_reason, orig.logprobs)
    small = [RequestOutputMsg("d", [1], None, 0, None, None, None)]
    assert step_frames(small, 3) == [StepOutputs(small, 3)]  # an ordinary step: one frame, as it was


@pytest.mark.trio
async def test_the_gateway_gathers_the_chunks_and_sends_them_with_the_first_token() -> None:
    handle = RequestHandle("r", "w0", prompt_len=9)
    asm = OutputAssembler(_FakeTok(), (), False)  # type: ignore[arg-type]
    chunks = [_lps(4, 2), _lps(4, 2, 4)]
    for c in chunks:
        handle.push(RequestOutputMsg("r", [], None, 0, None, None, None, None, c))
    handle.push(RequestOutputMsg("r", [5], "length", 0, None, None, None))
    deltas: list[object] = []

    async def emit(d: object) -> None:
        deltas.append(d)

    with trio.fail_after(5):
        await follow(handle, asm, emit)
    assert len(deltas) == 1  # the chunks alone show the client nothing
    assert deltas[0].prompt_logprobs == chunks[0] + chunks[1] == asm.prompt_logprobs  # type: ignore[attr-defined]


@pytest.mark.trio
async def test_one_chunk_over_the_stream_bound_is_not_a_slow_client_but_a_backlog_is() -> None:
    chunk = RequestOutputMsg("r", [], None, 0, None, None, None, None, _lps(512, 20))
    assert output_bytes(chunk) > 1 << 20  # a 512-token chunk with 20 alternatives weighs more than the bound
    h = RequestHandle("r", "w0", 600)
    h.push(chunk)  # its client has taken everything so far: never cut for this one
    assert not h.overflowed and h.pending_bytes() == output_bytes(chunk)
    await h.next_outputs()
    h.push(chunk)
    h.push(chunk)  # this one waits behind a megabyte its client did not take: cut
    assert h.overflowed


def test_decoding_top_logprobs_keeps_its_checks() -> None:
    ok = StepOutputs([RequestOutputMsg("r", [1], None, 0, [(-1.0, [(3, -1.0), (4, 0)])], None, None, None,
                                       [(-2.0, 1, [(5, -2.0)])])], 1)
    back = decode(encode(ok))
    assert back == StepOutputs([RequestOutputMsg("r", [1], None, 0, [(-1.0, [(3, -1.0), (4, 0.0)])], None, None,
                                                 None, [(-2.0, 1, [(5, -2.0)])])], 1)
    assert type(back.outputs[0].logprobs[0][1][1][1]) is float  # type: ignore[union-attr,index]  # an int became one
    from ipc.codec import ProtocolError
    for bad in ([(True, -1.0)], [(3, "x")], [(3,)]):
        with pytest.raises(ProtocolError):
            decode(encode(StepOutputs([RequestOutputMsg("r", [], None, 0, None, None, None, None,
                                                        [(-1.0, 1, bad)])], 0)))  # type: ignore[list-item]
