"""msgpack codec for ``ipc.messages`` (never pickle).

A frame is one msgpack array: ``[tag, field_1, ..., field_n]`` with the fields in dataclass declaration order.
Nested values (``RequestOutputMsg``, ``EngineTimings``, ``SamplingParams``) are plain arrays of their fields
(no tag: their position already says what they are).

Decoding trusts nothing: every frame comes off a socket any process on the network may write to. It checks
the tag, the arity and the type of every field down to list elements (``bool`` is not accepted as ``int``),
and turns every failure into one exception type, ``ProtocolError``, so receive loops have one thing to catch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

import msgpack

from ipc.messages import (
    PROTOCOL_VERSION,
    Abort,
    Drain,
    EngineTimings,
    Generate,
    Goodbye,
    Hello,
    Message,
    PromptLogprob,
    Refused,
    RequestError,
    RequestOutputMsg,
    Shutdown,
    Stats,
    StepOutputs,
    TokenLogprobs,
)
from ipc.sampling import SamplingParams

# Refuse frames above this size before unpacking them. A 1M-token prompt is ~5 MiB of msgpack, so this only
# stops abuse; transport.py sets the same cap as ZMQ_MAXMSGSIZE so such a peer is cut off at the socket.
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

T = TypeVar("T")
# A field decoder checks one decoded msgpack value and returns it in its Python form (e.g. int -> float,
# [a, b] -> (a, b)); ``where`` names the field for the error message.
FieldDecoder = Callable[[object, str], Any]


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version (malformed, unknown, truncated)."""


def _bad(where: str, expected: str, got: object) -> ProtocolError:
    # Name the type, never the value: values may be prompt tokens or other tenant data.
    return ProtocolError(f"{where}: expected {expected}, got {type(got).__name__}")


# --------------------------------------------------------------------------------------------------
# field decoders
# --------------------------------------------------------------------------------------------------


def _int(v: object, where: str) -> int:
    if type(v) is not int:  # `type() is` on purpose: isinstance would let True/False through as 1/0
        raise _bad(where, "int", v)
    return v


def _float(v: object, where: str) -> float:
    # msgpack writers may encode a whole-number float as an int; accept it, but never a bool.
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _bad(where, "float", v)


def _str(v: object, where: str) -> str:
    if type(v) is not str:
        raise _bad(where, "str", v)
    return v


def _opt(inner: Callable[[object, str], T]) -> Callable[[object, str], T | None]:
    def decode(v: object, where: str) -> T | None:
        return None if v is None else inner(v, where)

    return decode


def _array(v: object, where: str, arity: int | None = None) -> list[object]:
    # raw msgpack arrays always decode to list (use_list=True), so anything else is a type error
    if type(v) is not list:
        raise _bad(where, "array", v)
    if arity is not None and len(v) != arity:
        raise ProtocolError(f"{where}: expected {arity} elements, got {len(v)}")
    return v


def _list(inner: Callable[[object, str], T]) -> Callable[[object, str], list[T]]:
    def decode(v: object, where: str) -> list[T]:
        return [inner(x, f"{where}[{i}]") for i, x in enumerate(_array(v, where))]

    return decode


def _int_list(v: object, where: str) -> list[int]:
    # Fast path for prompts and token lists (can be 100k long): one pass, index only on failure.
    items = _array(v, where)
    if all(type(x) is int for x in items):
        return items  # type: ignore[return-value]  # just checked every element
    bad = next(i for i, x in enumerate(items) if type(x) is not int)
    raise _bad(f"{where}[{bad}]", "int", items[bad])


def _str_dict(v: object, where: str) -> dict[str, str]:
    if type(v) is not dict:
        raise _bad(where, "map", v)
    for key, value in v.items():
        _str(key, f"{where} key")
        _str(value, f"{where}[{key!r}]")
    return v


def _logit_bias(v: object, where: str) -> list[tuple[int, float]]:
    """[[token id, bias], ...]: SamplingParams checks the ranges."""
    return [(_int(p[0], f"{where}[{i}]"), _float(p[1], f"{where}[{i}]"))
            for i, p in enumerate(_array(x, f"{where}[{j}]", 2) for j, x in enumerate(_array(v, where)))]


def _bool(v: object, where: str) -> bool:
    if type(v) is not bool:
        raise _bad(where, "bool", v)
    return v


def _sampling(v: object, where: str) -> SamplingParams:
    fields = _decode_fields(_SAMPLING_SPEC, _array(v, where), where)
    try:
        return SamplingParams(*fields)  # its own range checks: the worker's one validation of these values
    except ValueError as exc:
        raise ProtocolError(f"{where}: {exc}") from exc


def _top_logprob(v: object, where: str) -> tuple[int, float]:
    token_id, logprob = _array(v, where, 2)
    return _int(token_id, f"{where}[0]"), _float(logprob, f"{where}[1]")


def _top_logprobs(v: object, where: str) -> list[tuple[int, float]]:
    # Fast path, as _int_list's: a step's prompt logprobs are up to its token budget x 21 pairs, and checking each
    # pair through the generic decoders (a `where` string each) kept the gateway's event loop busy ~5x longer
    items = _array(v, where)
    if all(type(x) is list and len(x) == 2 and type(x[0]) is int and type(x[1]) is float
           for x in items):
        return [(x[0], x[1]) for x in items]  # type: ignore[index]  # just checked every pair
    return [_top_logprob(x, f"{where}[{i}]") for i, x in enumerate(items)]


def _token_logprobs(v: object, where: str) -> TokenLogprobs:
    sampled, top = _array(v, where, 2)
    return _float(sampled, f"{where}[0]"), _top_logprobs(top, f"{where}[1]")


def _prompt_logprob(v: object, where: str) -> PromptLogprob:
    lp, rank, top = _array(v, where, 3)
    return _float(lp, f"{where}[0]"), _int(rank, f"{where}[1]"), _top_logprobs(top, f"{where}[2]")


def _engine_timings(v: object, where: str) -> EngineTimings:
    return EngineTimings(*_decode_fields(_TIMINGS_SPEC, _array(v, where), where))


def _request_output(v: object, where: str) -> RequestOutputMsg:
    return RequestOutputMsg(*_decode_fields(_OUTPUT_SPEC, _array(v, where), where))


# --------------------------------------------------------------------------------------------------
# message table
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    tag: int
    cls: type[Any]
    names: tuple[str, ...]  # dataclass field names, in declaration order (= wire order)
    decoders: tuple[FieldDecoder, ...]  # one per field


def _spec(tag: int, cls: type[Any], decoders: tuple[FieldDecoder, ...]) -> _Spec:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if len(names) != len(decoders):  # a field added to messages.py without a decoder here: fail at import
        raise TypeError(f"{cls.__name__} has {len(names)} fields but {len(decoders)} decoders")
    return _Spec(tag, cls, names, decoders)


# Tag 0 is unused: nested values are never frames of their own.
_TIMINGS_SPEC: Final = _spec(0, EngineTimings, (_opt(_float), _opt(_float), _float, _list(_float)))
_OUTPUT_SPEC: Final = _spec(
    0, RequestOutputMsg,
    (_str, _int_list, _opt(_str), _int, _opt(_list(_token_logprobs)), _opt(_str), _opt(_engine_timings), _opt(_str),
     _opt(_list(_prompt_logprob)))
)
# SamplingParams, field by field: max_tokens, temperature, top_k, top_p, min_p, seed, presence_penalty,
# frequency_penalty, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, logprobs, structured,
# prompt_logprobs, logit_bias.
_SAMPLING_SPEC: Final = _spec(
    0, SamplingParams,
    (_opt(_int), _float, _int, _float, _float, _opt(_int), _float, _float, _float, _int, _int_list, _bool,
     _opt(_int), _opt(_str), _opt(_int), _logit_bias)
)
_NESTED: Final[Mapping[type[Any], _Spec]] = MappingProxyType({EngineTimings: _TIMINGS_SPEC,
                                                              RequestOutputMsg: _OUTPUT_SPEC,
                                                              SamplingParams: _SAMPLING_SPEC})

# Tags are small ints so a frame's first byte says what it is: 1.. gateway->worker, 16.. worker->gateway.
# Never reuse or renumber a tag; retire it and bump PROTOCOL_VERSION instead.
_SPECS: Final[tuple[_Spec, ...]] = (
    _spec(1, Generate, (_str, _int_list, _sampling, _opt(_str), _float, _opt(_float), _opt(_str_dict), _int,
                        _opt(_str))),
    _spec(2, Abort, (_list(_str),)),
    _spec(3, Drain, ()),
    _spec(4, Shutdown, ()),
    _spec(5, Refused, (_str,)),
    _spec(16, Hello, (_int, _str, _int, _str, _int, _int, _int, _int, _int_list, _int, _int)),
    _spec(17, StepOutputs, (_list(_request_output), _int)),
    _spec(18, Stats, (_str, _int, _int, _float, _int, _int, _int, _int, _int, _int, _int, _float, _int,
                       _opt(_float), _list(_str), _int, _int, _int, _int_list, _int)),
    _spec(19, RequestError, (_str, _str, _str)),
    _spec(20, Goodbye, (_str, _str)),
)
_BY_TAG: Final[Mapping[int, _Spec]] = MappingProxyType({s.tag: s for s in _SPECS})
_BY_TYPE: Final[Mapping[type[Any], _Spec]] = MappingProxyType({s.cls: s for s in _SPECS})
_HELLO_TAG: Final = _BY_TYPE[Hello].tag


def _decode_fields(spec: _Spec, values: list[object], where: str) -> list[Any]:
    if len(values) != len(spec.decoders):
        expected = len(spec.decoders)
        raise ProtocolError(f"{where}: {spec.cls.__name__} needs {expected} fields, got {len(values)}")
    return [dec(val, f"{where}.{name}") for dec, val, name in zip(spec.decoders, values, spec.names)]


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def _pack_default(obj: object) -> object:
    # msgpack calls this for types it does not know; nested dataclasses (RequestOutputMsg, EngineTimings)
    # travel as plain arrays of their fields.
    spec = _NESTED.get(type(obj))
    if spec is not None:
        return [getattr(obj, name) for name in spec.names]
    raise TypeError(f"cannot encode {type(obj).__name__} in an ipc message")


def encode(msg: Message) -> bytes:
    """Serialize a message to one msgpack frame. Raises TypeError for a non-message or unencodable field."""
    spec = _BY_TYPE.get(type(msg))
    if spec is None:
        raise TypeError(f"not an ipc message: {type(msg).__name__}")
    frame = [spec.tag, *(getattr(msg, name) for name in spec.names)]
    packed: bytes = msgpack.packb(frame, use_bin_type=True, default=_pack_default)
    return packed


def _unpack(data: bytes | bytearray | memoryview) -> object:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(data).__name__}")
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        # raw=False: strings must be valid UTF-8; strict_map_key: only str/bytes keys; msgpack's own limits
        # (derived from len(data)) stop a short frame from announcing a huge array, and its stack limit stops
        # deep nesting. Trailing bytes after the array are an error (ExtraData), not silently ignored.
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises ValueError subclasses, TypeError, StackError...: all untrusted
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc


def _show(value: object) -> str:
    # Ints are safe and useful to log; anything else is peer-controlled and possibly huge: its type only.
    return repr(value) if type(value) is int else type(value).__name__


def _check_version(frame: list[object]) -> None:
    # Done before the arity check: a Hello of another version may have other fields, and "wrong version"
    # is the diagnosis an operator needs, not "wrong field count".
    version = frame[1] if len(frame) > 1 else None
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: peer speaks {_show(version)}, we speak {PROTOCOL_VERSION}"
        )


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one frame. Raises ProtocolError for anything that is not a valid message."""
    frame = _array(_unpack(data), "frame")
    if not frame:
        raise ProtocolError("frame: empty array, no type tag")
    tag = frame[0]
    spec = _BY_TAG.get(tag) if type(tag) is int else None
    if spec is None:
        raise ProtocolError(f"frame: unknown message tag {_show(tag)}")
    if tag == _HELLO_TAG:
        _check_version(frame)
    msg: Message = spec.cls(*_decode_fields(spec, frame[1:], spec.cls.__name__))
    return msg


def _size(data: object) -> int | str:
    return len(data) if isinstance(data, (bytes, bytearray, memoryview)) else "?"


def decode_or_none(
    data: bytes | bytearray | memoryview, *, peer: str = "?", logger: logging.Logger | None = None
) -> Message | None:
    """decode(), but log and return None for a bad frame, so a receive loop never dies on one peer's bug."""
    try:
        return decode(data)
    except ProtocolError as exc:
        (logger or logging.getLogger(__name__)).warning(
            "dropping malformed ipc frame from %s (%s bytes): %s", peer, _size(data), exc
        )
        return None
