"""ipc.codec: every message round-trips; every malformed frame is one ProtocolError (never a crash)."""

from __future__ import annotations

import dataclasses
import logging
import math

import msgpack
import pytest

from ipc.codec import MAX_FRAME_BYTES, ProtocolError, decode, decode_or_none, encode
from ipc.messages import (
    PROTOCOL_VERSION,
    Abort,
    Drain,
    EngineTimings,
    Generate,
    Goodbye,
    Hello,
    Message,
    Refused,
    RequestError,
    RequestOutputMsg,
    Shutdown,
    Stats,
    StepOutputs,
)
from ipc.sampling import SamplingParams

GENERATE = Generate(
    request_id="req-1",
    prompt_token_ids=[1, 2, 3, 49151],
    sampling=SamplingParams(temperature=0.7, top_k=50, max_tokens=None, ignore_eos=False, stop_token_ids=(2, 7),
                            seed=2**63 - 1, structured='{"type": "json_object"}'),
    cache_salt="tenant-salt",
    weight=2.5,
    deadline=1_900_000_000.25,
    trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
)
OUTPUT = RequestOutputMsg(
    request_id="req-1",
    new_token_ids=[42, 43],
    finish_reason="stop",
    num_cached_tokens=16,
    logprobs=[(-0.1, [(42, -0.1), (7, -2.5)]), (-math.inf, [])],
    error=None,
    timings=EngineTimings(scheduled=0.25, first_token=0.5, finished=1.75, preempted=[0.75, 1.0]),
)
HELLO = Hello(PROTOCOL_VERSION, "worker-0", 1234, "SmolLM2-135M-Instruct", 2048, 16, 4096, 49152, [2], 64, 512)
STATS = Stats("worker-0", 3, 1, 0.25, 3072, 4096, 2, 10, 7, 1000, 500, 1_700_000_000.5, 42, 1.25, ["r1", "r2"])

SAMPLES: list[Message] = [
    GENERATE,
    Generate("r", [], SamplingParams(), None, 1.0, None, None),  # every optional empty
    Abort(["req-1", "req-2"]),
    Abort([]),
    Drain(),
    Shutdown(),
    Refused("worker id 'w0' refused: key other may serve worker ids other and other/*"),
    HELLO,
    StepOutputs([OUTPUT, RequestOutputMsg("req-2", [], None, 0, None, "engine failed", None)], 48),
    StepOutputs([RequestOutputMsg("req-3", [], "length", 0, None, "the schema did not compile", None,
                                  "invalid_request")], 0),
    StepOutputs([RequestOutputMsg("r", [], "abort", 0, None, None, EngineTimings(None, None, 0.0, []))], 0),
    StepOutputs([], 512),  # a prefill chunk that sampled nothing
    Generate("r", [1, 2, 3], SamplingParams(logprobs=2, prompt_logprobs=20), None, 1.0, None, None),
    Generate("r", [1], SamplingParams(), "salt", 1.0, None, None, 100),  # a bulk request's priority
    Generate("r", [1], SamplingParams(), None, 1.0, None, None, -5),
    StepOutputs([RequestOutputMsg("r", [5], None, 0, None, None, None, None,
                                  [(-1.5, 3, [(7, -0.2), (9, -1.0)]), (-math.inf, 49152, [])])], 3),
    STATS,
    RequestError("req-3", "prompt is longer than max_model_len", "prompt_too_long"),
    Goodbye("worker-0", "drained ✓"),
]


def _ids(samples: list[Message]) -> list[str]:
    return [f"{i}-{type(m).__name__}" for i, m in enumerate(samples)]


def _frame(msg: Message) -> list[object]:
    """The raw msgpack array of a message, to corrupt in tests."""
    frame = msgpack.unpackb(encode(msg), raw=False)
    assert isinstance(frame, list)
    return frame


def _pack(frame: object) -> bytes:
    packed: bytes = msgpack.packb(frame, use_bin_type=True)
    return packed


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids(SAMPLES))
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg and decode(memoryview(data)) == msg


def test_every_message_type_is_sampled() -> None:
    import ipc.messages as messages

    wire_types = {obj for obj in vars(messages).values()
                  if dataclasses.is_dataclass(obj) and obj not in (RequestOutputMsg, EngineTimings, SamplingParams)}
    assert wire_types == {type(m) for m in SAMPLES}


def test_frame_layout_is_tag_then_fields_in_order() -> None:
    frame = _frame(Goodbye("w", "bye"))
    assert type(frame[0]) is int and frame[1:] == ["w", "bye"]
    tags = {_frame(m)[0] for m in SAMPLES}
    assert len(tags) == len({type(m) for m in SAMPLES})  # one distinct tag per type
    assert _frame(StepOutputs([OUTPUT], 1))[1][0][:2] == ["req-1", [42, 43]]  # nested output: plain array


def test_int_accepted_for_float_field_and_normalised() -> None:
    frame = _frame(GENERATE)
    frame[5] = 3  # weight as a msgpack int, as a non-Python writer may send it
    msg = decode(_pack(frame))
    assert isinstance(msg, Generate) and msg.weight == 3.0 and type(msg.weight) is float


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode(OUTPUT)  # type: ignore[arg-type]  # nested type, not a frame of its own
    with pytest.raises(TypeError):
        encode({"tag": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # a value msgpack cannot represent
        encode(Generate("r", [1], {"x": object()}, None, 1.0, None, None))  # type: ignore[dict-item]


# --------------------------------------------------------------------------------------------------
# malformed frames
# --------------------------------------------------------------------------------------------------


def _with(msg: Message, index: int, value: object) -> bytes:
    """msg's frame with element ``index`` (0 = tag) replaced."""
    frame = _frame(msg)
    frame[index] = value
    return _pack(frame)


def _with_sampling(index: int, value: object) -> bytes:
    """GENERATE's frame with field ``index`` of its nested SamplingParams array replaced."""
    frame = _frame(GENERATE)
    sampling = frame[3]
    assert isinstance(sampling, list)
    sampling[index] = value
    return _pack(frame)


def _gen_output(**changes: object) -> bytes:
    """A StepOutputs frame whose single output has some raw fields replaced."""
    names = [f.name for f in dataclasses.fields(RequestOutputMsg)]
    frame = _frame(StepOutputs([OUTPUT], 1))
    for name, value in changes.items():
        frame[1][0][names.index(name)] = value
    return _pack(frame)


MALFORMED: dict[str, bytes] = {
    # not msgpack / not an array
    "empty": b"",
    "garbage": b"\xc1\xff\x00garbage",
    "reserved byte": b"\xc1",
    "not an array": _pack({"tag": 1}),
    "int": _pack(16),
    "empty array": _pack([]),
    "trailing bytes": encode(Drain()) + b"\x00",
    "two frames": encode(Drain()) + encode(Drain()),
    "invalid utf-8": b"\x93\x14\xa2\xff\xfe\xa1x",
    "int map key": b"\x81\x01\x02",
    "huge nesting": b"\x91" * 100_000 + b"\xc0",
    "announces huge array": b"\xdd\xff\xff\xff\xff",
    # tags
    "unknown tag": _pack([99]),
    "negative tag": _pack([-1]),
    "string tag": _pack(["Generate", *_frame(GENERATE)[1:]]),
    "bool tag": _pack([True]),  # True == 1 == Generate's tag, but a bool is not a tag
    "float tag": _pack([3.0]),
    "nil tag": _pack([None]),
    # arity
    "drain with field": _pack([_frame(Drain())[0], 1]),
    "generate too short": _pack(_frame(GENERATE)[:-1]),
    "generate too long": _pack([*_frame(GENERATE), None]),
    "abort no field": _pack(_frame(Abort(["a"]))[:1]),
    "output too short": _pack([_frame(StepOutputs([], 0))[0], [["r", [1]]]]),
    "logprob pair arity": _gen_output(logprobs=[[-0.1, [[42]]], [-1.0, []]]),
    "logprob entry arity": _gen_output(logprobs=[[-0.1]]),
    "prompt logprob rank not int": _gen_output(prompt_logprobs=[[-0.1, 1.5, []]]),
    "prompt logprob arity": _gen_output(prompt_logprobs=[[-0.1, []]]),
    # field types
    "request_id int": _with(GENERATE, 1, 5),
    "request_id bytes": _with(GENERATE, 1, b"req-1"),
    "prompt not list": _with(GENERATE, 2, "1 2 3"),
    "prompt bool token": _with(GENERATE, 2, [1, True, 3]),
    "prompt float token": _with(GENERATE, 2, [1, 2.0]),
    "prompt nil token": _with(GENERATE, 2, [None]),
    "sampling a map (protocol 3)": _with(GENERATE, 3, {"temperature": 1.0}),
    "sampling too short": _with(GENERATE, 3, _frame(GENERATE)[3][:-1]),
    "prompt_logprobs out of range": _with_sampling(14, 21),
    "prompt_logprobs not int": _with_sampling(14, "3"),
    "sampling nested list": _with_sampling(10, [[1, 2]]),
    "sampling bytes value": _with_sampling(13, b"\x00"),
    "sampling ext value": _with_sampling(13, msgpack.ExtType(5, b"x")),
    "sampling temperature str": _with_sampling(1, "0.7"),
    "sampling ignore_eos int": _with_sampling(11, 1),
    "sampling top_k bool": _with_sampling(2, True),
    # sampling ranges: the worker's one check of them is this decode
    "sampling temperature negative": _with_sampling(1, -1.0),
    "sampling top_p zero": _with_sampling(3, 0.0),
    "sampling temperature nan": _with_sampling(1, math.nan),
    "sampling max_tokens zero": _with_sampling(0, 0),
    "sampling stop id negative": _with_sampling(10, [-1]),
    "cache_salt int": _with(GENERATE, 4, 7),
    "weight bool": _with(GENERATE, 5, True),
    "weight str": _with(GENERATE, 5, "1.0"),
    "weight nil": _with(GENERATE, 5, None),
    "deadline bool": _with(GENERATE, 6, False),
    "trace int value": _with(GENERATE, 7, {"traceparent": 1}),
    "trace not map": _with(GENERATE, 7, ["traceparent"]),
    "abort ids not list": _with(Abort(["a"]), 1, "a"),
    "abort id int": _with(Abort(["a"]), 1, ["a", 2]),
    "hello pid bool": _with(HELLO, 3, True),
    "hello pid float": _with(HELLO, 3, 1234.0),
    "hello model nil": _with(HELLO, 4, None),
    "hello eos bool": _with(HELLO, 9, [False]),
    "hello eos not list": _with(HELLO, 9, 2),
    "stats running bool": _with(STATS, 2, True),
    "stats kv_usage str": _with(STATS, 4, "0.5"),
    "stats timestamp nil": _with(STATS, 12, None),
    "stats timestamp ext": _with(STATS, 12, msgpack.Timestamp(1, 0)),
    "outputs not list": _with(StepOutputs([OUTPUT], 1), 1, {"r": 1}),
    "output not array": _with(StepOutputs([OUTPUT], 1), 1, ["req-1"]),
    "output token bool": _gen_output(new_token_ids=[True]),
    "output cached nil": _gen_output(num_cached_tokens=None),
    "output finish int": _gen_output(finish_reason=1),
    "output logprob str": _gen_output(logprobs=[["-0.1", []]]),
    "output top id float": _gen_output(logprobs=[[-0.1, [[42.0, -0.1]]]]),
    "output error bool": _gen_output(error=True),
    "timings not array": _gen_output(timings={"finished": 1.0}),
    "timings too short": _gen_output(timings=[0.1, 0.2, 0.3]),
    "timings finished nil": _gen_output(timings=[0.1, 0.2, None, []]),
    "timings preempted str": _gen_output(timings=[0.1, 0.2, 0.3, ["0.1"]]),
    "timings scheduled bool": _gen_output(timings=[True, 0.2, 0.3, []]),
    "step tokens nil": _with(StepOutputs([], 1), 2, None),
    "step tokens float": _with(StepOutputs([], 1), 2, 1.5),
    "step tokens missing": _pack(_frame(StepOutputs([], 1))[:2]),
    "error code nil": _with(RequestError("r", "m", "c"), 3, None),
    "goodbye reason list": _with(Goodbye("w", "r"), 2, ["r"]),
    # versions
    "hello newer version": _with(HELLO, 1, PROTOCOL_VERSION + 1),
    "hello version 0": _with(HELLO, 1, 0),
    "hello version str": _with(HELLO, 1, str(PROTOCOL_VERSION)),
    "hello version bool": _with(HELLO, 1, True),
    "hello v2 other arity": _pack([_frame(HELLO)[0], PROTOCOL_VERSION + 1, "w"]),
    "hello no fields": _pack(_frame(HELLO)[:1]),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frame_raises_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_decode_or_none_logs_and_drops(data: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert decode_or_none(data, peer="worker-x") is None
    assert "worker-x" in caplog.text


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids(SAMPLES))
def test_every_truncation_raises_protocol_error(msg: Message) -> None:
    data = encode(msg)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


def test_version_mismatch_message_names_both_versions() -> None:
    with pytest.raises(ProtocolError, match=rf"version.*{PROTOCOL_VERSION + 1}.*{PROTOCOL_VERSION}"):
        decode(_with(HELLO, 1, PROTOCOL_VERSION + 1))


def test_protocol_error_is_a_value_error_and_hides_values() -> None:
    secret = "prompt text that must not be logged"
    with pytest.raises(ValueError) as info:
        decode(_with(GENERATE, 6, secret))
    assert isinstance(info.value, ProtocolError)
    assert "Generate.deadline" in str(info.value) and secret not in str(info.value)


def test_non_bytes_input_is_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode("not bytes")  # type: ignore[arg-type]
    assert decode_or_none(12345) is None  # type: ignore[arg-type]


def test_oversized_frame_is_refused_before_unpacking() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(bytes(MAX_FRAME_BYTES + 1))


def test_good_frame_after_bad_ones_still_decodes() -> None:
    stream = [*MALFORMED.values(), encode(STATS)]
    decoded = [decode_or_none(d) for d in stream]
    assert decoded == [None] * len(MALFORMED) + [STATS]
