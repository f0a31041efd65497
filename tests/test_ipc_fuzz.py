"""Property tests for ipc.codec: arbitrary input never escapes as anything but ProtocolError.

database=None: no .hypothesis/ directory is written into the repository.
"""

from __future__ import annotations

import msgpack
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ipc.codec import ProtocolError, decode, decode_or_none, encode  # noqa: E402
from ipc.messages import Message  # noqa: E402

from tests.test_ipc_codec import SAMPLES  # noqa: E402

_TAGS = sorted({msgpack.unpackb(encode(m))[0] for m in SAMPLES})

# Any msgpack value: scalars of every kind (bool, ints beyond 64 bits excluded by msgpack itself), nested.
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def _decodes_or_protocol_error(data: bytes) -> Message | None:
    try:
        return decode(data)
    except ProtocolError:
        return None


@settings(max_examples=200, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    _decodes_or_protocol_error(data)  # any other exception fails the test
    decode_or_none(data)


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(_TAGS), st.lists(_values, max_size=12))
def test_random_fields_behind_a_valid_tag(tag: int, fields: list[object]) -> None:
    msg = _decodes_or_protocol_error(msgpack.packb([tag, *fields], use_bin_type=True))
    if msg is not None:  # whatever is accepted must be a faithful, re-encodable message (bytes: NaN != NaN)
        assert encode(decode(encode(msg))) == encode(msg)


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_one_corrupted_byte(msg: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    index = data.draw(st.integers(0, len(raw) - 1))
    raw[index] = data.draw(st.integers(0, 255))
    _decodes_or_protocol_error(bytes(raw))
