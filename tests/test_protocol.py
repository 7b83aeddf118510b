"""Message bodies of the wire protocol (storage/protocol/schema.py, messages.py).

* Hypothesis round trip of every request and response type in ``APIS`` and every type nested
  in them: ``decode(encode(x)) == x`` (bytes fields compared as bytes) and re-encoding the
  decoded value gives the same bytes. The strategies are derived from each ``SCHEMA``, so a
  field added later is covered without touching this file.
* Bad input: every truncation, trailing bytes, impossible lengths and array counts, invalid
  UTF-8, and random or mutated bytes. The only exception a decoder may raise is a
  ``StrataError`` (``MalformedFrameError`` for a body that does not parse) — never
  ``struct.error``, ``IndexError`` or ``UnicodeDecodeError``, and never a huge allocation.
* Golden vectors for one ProduceRequest and one MetadataResponse frame, byte for byte.

Frames and the stream splitter are in test_protocol_frames.py, error codes in
test_protocol_errors.py.
"""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.errors import MalformedFrameError, StrataError
from storage.protocol import (
    APIS,
    ApiKey,
    decode_request_body,
    encode_request,
    encode_response,
    parse_request,
    parse_response,
)
from storage.protocol import messages as m
from storage.protocol.schema import (
    BYTES,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    Array,
    Message,
    Struct,
    WireType,
)

# --- every message type, found by walking the schemas ------------------------------------------


def _nested(cls: type[Message]) -> list[type[Message]]:
    found: list[type[Message]] = []

    def walk(t: WireType) -> None:
        if isinstance(t, Array):
            walk(t.item)
        elif isinstance(t, Struct) and t.cls not in found:
            found.append(t.cls)
            for _, ft in t.schema:
                walk(ft)

    walk(cls.wire())
    return found


TOP_LEVEL: list[type[Message]] = [c for api in APIS.values() for c in (api.request, api.response)]
ALL_MESSAGES: list[type[Message]] = list(dict.fromkeys(n for c in TOP_LEVEL for n in _nested(c)))


def test_walk_reaches_every_message_type_in_messages_py() -> None:
    defined = {
        v
        for v in vars(m).values()
        if isinstance(v, type) and issubclass(v, Message) and v is not Message
    }
    assert set(ALL_MESSAGES) == defined
    assert set(APIS) == set(ApiKey)


# --- strategies derived from the schemas -------------------------------------------------------

_INT_WIDTHS = {INT8: 8, INT16: 16, INT32: 32, INT64: 64}


def _int_range(bits: int) -> st.SearchStrategy[int]:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # the edges and -1 (the protocol's "none / unknown / latest") are drawn often
    return st.one_of(st.sampled_from([lo, hi, -1, 0, 1]), st.integers(lo, hi))


def strategy_for(t: WireType) -> st.SearchStrategy[Any]:
    if t in _INT_WIDTHS:
        return _int_range(_INT_WIDTHS[t])
    if t is STRING:
        # st.text() draws from all of Unicode (no surrogates), so non-ASCII, multi-byte and
        # astral characters come up; "" and None must stay distinct
        return st.one_of(st.none(), st.just(""), st.text(max_size=12))
    if t is BYTES:
        return st.one_of(st.none(), st.just(b""), st.binary(max_size=40))
    if isinstance(t, Array):
        return st.one_of(st.none(), st.just([]), st.lists(strategy_for(t.item), max_size=3))
    if isinstance(t, Struct):
        return messages(t.cls)
    raise AssertionError(f"no strategy for wire type {t!r}")


def messages(cls: type[Message]) -> st.SearchStrategy[Any]:
    return st.builds(cls, *(strategy_for(t) for _, t in cls.SCHEMA))


def plain(value: Any) -> Any:
    """A comparable form: dataclasses as (name, fields), every bytes-like as bytes."""
    if isinstance(value, Message):
        return (type(value).__name__, *(plain(getattr(value, n)) for n, _ in value.SCHEMA))
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return ("bytes", bytes(value))
    return value


def encoded(msg: Message) -> bytes:
    return b"".join(msg.encode())


def _bytes_fields(value: Any) -> list[Any]:
    """Every value of a BYTES field in a decoded message (None included)."""
    out: list[Any] = []
    if isinstance(value, Message):
        for name, t in value.SCHEMA:
            v = getattr(value, name)
            if t is BYTES:
                out.append(v)
            out.extend(_bytes_fields(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(_bytes_fields(v))
    return out


# --- round trip --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(messages(cls))
    wire = encoded(msg)
    assert len(wire) >= cls.wire().min_size
    back = cls.decode(wire)
    assert type(back) is cls
    assert plain(back) == plain(msg)
    assert encoded(back) == wire  # decode loses nothing: re-encoding is byte-identical
    for v in _bytes_fields(back):
        assert v is None or isinstance(v, memoryview)


def test_null_and_empty_stay_distinct() -> None:
    for topics in (None, [], [""], ["ü→𝄞"]):
        assert m.MetadataRequest.decode(encoded(m.MetadataRequest(topics))).topics == topics
    for records in (None, b""):
        req = m.ProduceRequest(1, 0, [m.ProduceTopic("t", [m.ProducePartition(0, records)])])
        got = m.ProduceRequest.decode(encoded(req)).topics[0].partitions[0].records
        assert got is None if records is None else bytes(got) == b""


def test_non_ascii_strings_are_utf8_on_the_wire() -> None:
    wire = encoded(m.AgentInfo(1, "hôte-𝄞", 2))
    host = "hôte-𝄞".encode()
    assert wire == struct.pack("<ih", 1, len(host)) + host + struct.pack("<i", 2)


def test_defaults_match_the_conventions() -> None:
    assert m.MetadataRequest().topics is None  # all topics
    assert m.FetchPartition(0, 0, 1).current_leader_epoch == -1  # do not check
    assert (m.LATEST_TIMESTAMP, m.EARLIEST_TIMESTAMP, m.CONSUMER_REPLICA_ID) == (-1, -2, -1)


@pytest.mark.parametrize(
    ("msg", "what"),
    [
        (m.ApiVersionRange(1 << 15, 0, 0), "int16"),
        (m.AgentInfo(-(1 << 31) - 1, "h", 1), "int32"),
        (m.ListOffsetsPartition(0, 1 << 63), "int64"),
        (m.FetchRequest(-1, 0, 0, 0, 128, []), "int8"),
        (m.AgentInfo(1, "x" * 32768, 1), "32767"),
        (m.AgentInfo(1, "é" * 16384, 1), "32767"),  # 16384 characters but 32768 bytes
    ],
)
def test_encode_refuses_values_that_do_not_fit(msg: Message, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        msg.encode()


def test_longest_string_fits() -> None:
    name = "x" * 32767
    assert m.AgentInfo.decode(encoded(m.AgentInfo(1, name, 1))).host == name


# --- bad input ---------------------------------------------------------------------------------


def _sample(cls: type[Message]) -> Message:
    """A value of cls with every array holding two elements, every string and bytes non-empty."""

    def value(t: WireType, i: int) -> Any:
        if t in _INT_WIDTHS:
            return -i - 2
        if t is STRING:
            return f"s{i}-é"
        if t is BYTES:
            return bytes(range(i, i + 5))
        if isinstance(t, Array):
            return [value(t.item, i), value(t.item, i + 1)]
        assert isinstance(t, Struct)
        return t.cls(*(value(ft, i + k) for k, (_, ft) in enumerate(t.schema)))

    return value(cls.wire(), 1)  # type: ignore[no-any-return]


SAMPLES = {cls: encoded(_sample(cls)) for cls in ALL_MESSAGES}


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_truncation_is_malformed(cls: type[Message]) -> None:
    wire = SAMPLES[cls]
    assert plain(cls.decode(wire)) == plain(_sample(cls))
    for cut in range(len(wire)):
        with pytest.raises(MalformedFrameError):
            cls.decode(wire[:cut])


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("extra", [b"\x00", b"\xff" * 9])
def test_trailing_bytes_are_malformed(cls: type[Message], extra: bytes) -> None:
    with pytest.raises(MalformedFrameError, match="unexpected bytes"):
        cls.decode(SAMPLES[cls] + extra)
    # exact=False is for a caller that parses a longer buffer field by field
    assert plain(cls.decode(SAMPLES[cls] + extra, exact=False)) == plain(_sample(cls))


def _zero_prefix(cls: type[Message], upto: int) -> bytes:
    """The encoding of the fields before ``upto`` with 0 / null values (-1 lengths)."""
    out: list[Any] = []
    for _, t in cls.SCHEMA[:upto]:
        t.encode(0 if t in _INT_WIDTHS else None, out)
    return b"".join(out)


LENGTH_FIELDS = [
    (cls, i, name, t)
    for cls in ALL_MESSAGES
    for i, (name, t) in enumerate(cls.SCHEMA)
    if t is STRING or t is BYTES or isinstance(t, Array)
]


@pytest.mark.parametrize(
    ("cls", "index", "name", "t"),
    LENGTH_FIELDS,
    ids=[f"{c.__name__}.{n}" for c, _, n, _ in LENGTH_FIELDS],
)
def test_impossible_lengths_are_malformed_without_allocating(
    cls: type[Message], index: int, name: str, t: WireType
) -> None:
    fmt = "<h" if t is STRING else "<i"
    prefix = _zero_prefix(cls, index)
    biggest = 32767 if t is STRING else 2**31 - 1
    for length in (biggest, 17, -2, -(2 ** (8 * struct.calcsize(fmt) - 1))):
        # a length or count far beyond the 16 bytes that follow
        wire = prefix + struct.pack(fmt, length) + bytes(16)
        tracemalloc.start()
        try:
            with pytest.raises(MalformedFrameError, match="does not fit"):
                cls.decode(wire)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024, f"{name}: decoding {len(wire)} bytes allocated {peak} bytes"


def test_array_count_2_31_in_a_20_byte_frame() -> None:
    """The brief's case: a Metadata request frame of 20 bytes claiming 2**31 - 1 topics."""
    frame = (
        struct.pack("<hhih", ApiKey.METADATA, 0, 1, -1) + struct.pack("<i", 2**31 - 1) + bytes(6)
    )
    assert len(frame) == 20
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrameError, match="array of 2147483647 elements"):
            decode_request_body(parse_request(frame))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\x80", b"\xf4\x90\x80\x80"],
    ids=["ff", "torn-2-byte", "overlong", "surrogate", "stray-continuation", "above-10ffff"],
)
def test_invalid_utf8_is_malformed(bad: bytes) -> None:
    wire = struct.pack("<ih", 1, len(bad)) + bad + struct.pack("<i", 2)
    with pytest.raises(MalformedFrameError, match="UTF-8"):
        m.AgentInfo.decode(wire)


def _decodes_or_raises_typed(cls: type[Message], data: bytes) -> None:
    try:
        value = cls.decode(data)
    except StrataError:
        return
    assert encoded(value) == data  # whatever does decode is a canonical encoding


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=100)
@given(data=st.binary(max_size=64))
def test_random_bytes_raise_only_strata_errors(cls: type[Message], data: bytes) -> None:
    _decodes_or_raises_typed(cls, data)


@pytest.mark.parametrize("cls", [c for c in TOP_LEVEL if SAMPLES[c]], ids=lambda c: c.__name__)
@settings(max_examples=100)
@given(data=st.data())
def test_mutated_encodings_raise_only_strata_errors(
    cls: type[Message], data: st.DataObject
) -> None:
    """Random bytes rarely get past the first length; damage to a valid encoding does."""
    wire = bytearray(SAMPLES[cls])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(wire) - 1))
        wire[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(wire)))
    _decodes_or_raises_typed(cls, bytes(wire[:cut]))


# --- golden vectors ----------------------------------------------------------------------------
# Written by hand from the layouts in frames.py and schema.py (little-endian; string = int16
# length + UTF-8; bytes = int32 length + raw; array = int32 count + elements).

GOLDEN_PRODUCE_REQUEST = bytes.fromhex(
    "2d000000"  # size 45 = 8 header + 5 client_id + 32 body
    "0200"  # api_key 2 (PRODUCE)
    "0000"  # api_version 0
    "2a000000"  # correlation_id 42
    "0300"
    "73646b"  # client_id "sdk"
    "ffff"  # acks -1 (all)
    "dc050000"  # timeout_ms 1500
    "01000000"  # 1 topic
    "0100"
    "74"  # name "t"
    "01000000"  # 1 partition
    "03000000"  # partition 3
    "03000000"
    "010203"  # records: 3 bytes
    "ffff"  # topic_id null (by name only)
    "ffff"  # transactional_id null
)
GOLDEN_PRODUCE = m.ProduceRequest(
    acks=-1, timeout_ms=1500, topics=[m.ProduceTopic("t", [m.ProducePartition(3, b"\x01\x02\x03")])]
)

GOLDEN_METADATA_RESPONSE = bytes.fromhex(
    "55000000"  # size 85
    "2a000000"  # correlation_id 42
    "0000"  # error_code 0
    "01000000"  # 1 agent
    "01000000"
    "0200"
    "6131"
    "84230000"  # agent 1, host "a1", port 9092
    "01000000"  # controller_id 1
    "01000000"  # 1 topic
    "0000"
    "0100"
    "74"  # error_code 0, name "t"
    "01000000"  # 1 partition
    "0000"  # error_code 0
    "00000000"  # partition 0
    "01000000"  # leader_id 1
    "05000000"  # leader_epoch 5
    "02000000"
    "01000000"
    "02000000"  # replicas [1, 2]
    "01000000"
    "01000000"  # isr [1]
    "002cb15707000000"  # delay_max_ms: one year
    "0200"
    "6162"  # topic_id "ab"
)
GOLDEN_METADATA = m.MetadataResponse(
    agents=[m.AgentInfo(1, "a1", 9092)],
    controller_id=1,
    topics=[
        m.TopicMetadata(
            0, "t", [m.PartitionMetadata(0, 0, 1, 5, [1, 2], [1])], 31_536_000_000, "ab"
        )
    ],
)


def test_golden_produce_request() -> None:
    assert (
        b"".join(encode_request(ApiKey.PRODUCE, 42, "sdk", GOLDEN_PRODUCE))
        == GOLDEN_PRODUCE_REQUEST
    )
    frame = parse_request(GOLDEN_PRODUCE_REQUEST[4:])
    assert (frame.api_key, frame.api_version, frame.correlation_id, frame.client_id) == (
        2,
        0,
        42,
        "sdk",
    )
    assert plain(decode_request_body(frame)) == plain(GOLDEN_PRODUCE)


def test_golden_metadata_response() -> None:
    assert b"".join(encode_response(42, GOLDEN_METADATA)) == GOLDEN_METADATA_RESPONSE
    frame = parse_response(GOLDEN_METADATA_RESPONSE[4:])
    assert (frame.correlation_id, frame.error_code, frame.error()) == (42, 0, None)
    assert m.MetadataResponse.decode(frame.body) == GOLDEN_METADATA
