"""Frames and the stream splitter (storage/protocol/frames.py).

The splitter is fed three ways (STYLE.md point 2): the whole stream at once, one byte at a
time (each frame comes out exactly when its last byte arrives, not before), and with trailing
garbage (every valid frame comes out first; then the garbage gives a typed
``MalformedFrameError``, or ``None`` while it could still be the start of a frame). Then the
boundary between errors that close a connection (framing: size field, header) and errors that
get an error response on an open connection (unknown API key/version, body that does not
parse), and the zero-copy path of record batches.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable
from itertools import accumulate, pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.errors import (
    FrameTooLargeError,
    MalformedFrameError,
    NotLeaderError,
    StrataError,
    UnsupportedVersionError,
)
from storage.protocol import (
    APIS,
    DEFAULT_MAX_FRAME,
    ApiKey,
    FrameSplitter,
    decode_request_body,
    encode_error_response,
    encode_request,
    encode_response,
    parse_request,
    parse_response,
    read_size,
)
from storage.protocol import messages as m
from storage.protocol.frames import SMALL_PART
from storage.protocol.schema import Message
from tests.test_protocol import messages, plain

REQUESTS: list[tuple[ApiKey, Message]] = [
    (ApiKey.API_VERSIONS, m.ApiVersionsRequest()),
    (ApiKey.METADATA, m.MetadataRequest(["orders", "ünïcode"])),
    (
        ApiKey.PRODUCE,
        m.ProduceRequest(
            acks=1,
            timeout_ms=30_000,
            topics=[
                m.ProduceTopic(
                    "orders",
                    [m.ProducePartition(0, bytes(range(256)) * 4), m.ProducePartition(7, b"")],
                )
            ],
        ),
    ),
    (
        ApiKey.FETCH,
        m.FetchRequest(
            replica_id=m.CONSUMER_REPLICA_ID,
            max_wait_ms=500,
            min_bytes=1,
            max_bytes=1 << 20,
            isolation_level=0,
            topics=[m.FetchTopic("orders", [m.FetchPartition(0, 1234, 65536, 3)])],
        ),
    ),
    (
        ApiKey.LIST_OFFSETS,
        m.ListOffsetsRequest(
            [m.ListOffsetsTopic("orders", [m.ListOffsetsPartition(0, m.EARLIEST_TIMESTAMP)])]
        ),
    ),
]


def request_frames() -> list[bytes]:
    """One frame per request, size prefix included; correlation id = index + 100."""
    return [
        b"".join(encode_request(key, 100 + i, f"client-{i}", body))
        for i, (key, body) in enumerate(REQUESTS)
    ]


FRAMES = request_frames()
STREAM = b"".join(FRAMES)
ENDS = list(accumulate(len(f) for f in FRAMES))


def drain(splitter: FrameSplitter) -> list[bytes]:
    out = []
    while (frame := splitter.next_frame()) is not None:
        out.append(frame)
    return out


def check_requests(frames: list[bytes]) -> None:
    """Frames (without size prefix) are exactly REQUESTS, in order, with their header fields."""
    assert [bytes(f) for f in frames] == [f[4:] for f in FRAMES]
    for i, (frame, (key, body)) in enumerate(zip(frames, REQUESTS, strict=True)):
        req = parse_request(frame)
        assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (
            key,
            0,
            100 + i,
            f"client-{i}",
        )
        assert plain(decode_request_body(req)) == plain(body)


# --- round trip --------------------------------------------------------------------------------

API_LIST = list(APIS.values())


@pytest.mark.parametrize("api", API_LIST, ids=lambda a: a.key.name)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_request_and_response_frames_round_trip(api: m.Api, data: st.DataObject) -> None:
    correlation_id = data.draw(st.integers(-(2**31), 2**31 - 1))
    client_id = data.draw(st.one_of(st.none(), st.text(max_size=10)))
    request = data.draw(messages(api.request))
    response = data.draw(messages(api.response))

    splitter = FrameSplitter()
    splitter.feed(b"".join(encode_request(api.key, correlation_id, client_id, request)))
    splitter.feed(b"".join(encode_response(correlation_id, response)))
    req_frame, resp_frame = drain(splitter)
    assert splitter.buffered == 0

    req = parse_request(req_frame)
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (
        api.key,
        0,
        correlation_id,
        client_id,
    )
    assert plain(decode_request_body(req)) == plain(request)

    resp = parse_response(resp_frame)
    assert (resp.correlation_id, resp.error_code, resp.error()) == (correlation_id, 0, None)
    assert plain(api.response.decode(resp.body)) == plain(response)


def test_encode_request_returns_parts_without_copying_records() -> None:
    records = bytes(SMALL_PART + 1)
    req = m.ProduceRequest(1, 0, [m.ProduceTopic("t", [m.ProducePartition(0, records)])])
    parts = encode_request(ApiKey.PRODUCE, 1, None, req)
    assert any(p is records for p in parts)  # for transport.writelines: no join on the way out
    assert read_size(parts[0][:4], DEFAULT_MAX_FRAME) == sum(len(p) for p in parts) - 4
    # the small fields around it are joined: header and fields before, the rest after
    assert len(parts) == 3


def test_a_response_of_small_fields_is_one_buffer() -> None:
    response = m.ApiVersionsResponse(0, [m.ApiVersionRange(k, 0, 0) for k in range(40)])
    (frame,) = encode_response(7, response)
    assert read_size(frame[:4], DEFAULT_MAX_FRAME) == len(frame) - 4
    resp = parse_response(memoryview(frame)[4:])
    assert resp.correlation_id == 7
    assert m.ApiVersionsResponse.decode(resp.body) == response


def test_a_field_out_of_range_is_named_by_its_type() -> None:
    # fixed-width fields in a row are packed by one struct call; the error still names the field
    for bad in (m.ApiVersionRange(3, 0, 40000), m.ApiVersionRange(3, -40000, 0)):
        with pytest.raises(ValueError, match="int16 field cannot hold"):
            encode_response(1, m.ApiVersionsResponse(0, [bad]))


@pytest.mark.parametrize("cut", range(1, 7))
def test_a_body_cut_inside_a_run_of_fixed_fields_is_malformed(cut: int) -> None:
    body = b"".join(m.ApiVersionRange(3, 0, 9).encode())
    assert m.ApiVersionRange.decode(body) == m.ApiVersionRange(3, 0, 9)
    with pytest.raises(MalformedFrameError, match="frame ends inside an int16"):
        m.ApiVersionRange.decode(body[:-cut])


def test_a_bytes_field_given_as_parts_is_the_same_bytes_on_the_wire_without_a_join() -> None:
    first, second = bytes(range(256)) * 20, b"\x07" * (SMALL_PART + 200)  # large: never joined
    joined = m.ProduceRequest(1, 0, [m.ProduceTopic("t", [m.ProducePartition(0, first + second)])])
    split = m.ProduceRequest(1, 0, [m.ProduceTopic("t", [m.ProducePartition(0, [first, second])])])
    parts = encode_request(ApiKey.PRODUCE, 1, None, split)
    assert any(p is first for p in parts) and any(p is second for p in parts)
    assert b"".join(parts) == b"".join(encode_request(ApiKey.PRODUCE, 1, None, joined))


# --- the splitter fed three ways ---------------------------------------------------------------


def test_whole_stream() -> None:
    splitter = FrameSplitter()
    splitter.feed(STREAM)
    check_requests(drain(splitter))
    assert splitter.buffered == 0


def test_one_byte_at_a_time_frames_come_out_exactly_at_their_boundaries() -> None:
    splitter = FrameSplitter()
    got: list[bytes] = []
    for i in range(len(STREAM)):
        splitter.feed(STREAM[i : i + 1])
        frame = splitter.next_frame()
        if i + 1 in ENDS:
            assert frame is not None, f"frame ending at byte {i + 1} did not come out"
            got.append(frame)
            assert splitter.buffered == 0
        else:
            assert frame is None, f"a frame came out at byte {i + 1}, not at a boundary"
    check_requests(got)


@settings(max_examples=100)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=20))
def test_any_chunking(cuts: list[int]) -> None:
    splitter = FrameSplitter()
    got: list[bytes] = []
    bounds = [0, *sorted(cuts), len(STREAM)]
    for a, b in pairwise(bounds):
        splitter.feed(memoryview(STREAM)[a:b])  # any bytes-like, views included
        got.extend(drain(splitter))
    check_requests(got)
    assert splitter.buffered == 0


def test_pipelined_frames_in_one_feed_keep_order_and_correlation_ids() -> None:
    n = 500
    requests = [m.MetadataRequest([f"topic-{i}"]) for i in range(n)]
    responses = [
        m.MetadataResponse([], i, [m.TopicMetadata(0, f"topic-{i}", [])]) for i in range(n)
    ]
    stream = b"".join(
        b"".join(encode_request(ApiKey.METADATA, 10_000 + i, "c", r))
        for i, r in enumerate(requests)
    )
    splitter = FrameSplitter()
    splitter.feed(stream)
    frames = drain(splitter)
    assert [parse_request(f).correlation_id for f in frames] == [10_000 + i for i in range(n)]
    assert [plain(decode_request_body(parse_request(f))) for f in frames] == plain(requests)

    # responses on the client side: matched to requests by correlation id, in order
    back = b"".join(b"".join(encode_response(10_000 + i, r)) for i, r in enumerate(responses))
    splitter = FrameSplitter()
    splitter.feed(back)
    for i, frame in enumerate(drain(splitter)):
        resp = parse_response(frame)
        assert resp.correlation_id == 10_000 + i
        assert m.MetadataResponse.decode(resp.body) == responses[i]


# --- trailing garbage --------------------------------------------------------------------------

LIMIT = 4096


def _frame(payload: bytes) -> bytes:
    return struct.pack("<i", len(payload)) + payload


# name -> (garbage after the valid frames, what the splitter does once the valid frames are out:
# None = waits for more bytes; an exception type = raised by next_frame, or for a garbage frame
# that does split out, by parse_request / decode_request_body)
GARBAGE: dict[str, tuple[bytes, type[StrataError] | None]] = {
    "size-torn": (b"\x10\x00", None),
    "body-torn": (struct.pack("<i", 100) + bytes(10), None),
    "negative-size": (struct.pack("<i", -1) + bytes(8), MalformedFrameError),
    "size-over-limit": (struct.pack("<i", LIMIT + 1) + bytes(8), FrameTooLargeError),
    "ascii-text": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", FrameTooLargeError),
    "empty-frame": (_frame(b""), MalformedFrameError),
    "header-torn": (_frame(struct.pack("<hhi", 1, 0, 5)), MalformedFrameError),
    "client-id-too-long": (_frame(struct.pack("<hhih", 1, 0, 5, 50) + b"abc"), MalformedFrameError),
    "body-garbage": (
        _frame(struct.pack("<hhih", ApiKey.PRODUCE, 0, 5, -1) + b"\xff" * 7),
        MalformedFrameError,
    ),
    "unknown-api": (_frame(struct.pack("<hhih", 99, 0, 5, -1)), UnsupportedVersionError),
}


def _server_side(chunks: Iterable[bytes]) -> tuple[list[bytes], Exception | None, FrameSplitter]:
    """What an agent's read loop sees: frames until the first error (or until the input ends)."""
    splitter = FrameSplitter(max_frame=LIMIT)
    frames: list[bytes] = []
    try:
        for chunk in chunks:
            splitter.feed(chunk)
            while (frame := splitter.next_frame()) is not None:
                decode_request_body(parse_request(frame))
                frames.append(frame)
    except StrataError as exc:
        return frames, exc, splitter
    return frames, None, splitter


@pytest.mark.parametrize("name", list(GARBAGE))
@pytest.mark.parametrize("feeding", ["whole", "bytewise"])
def test_trailing_garbage(name: str, feeding: str) -> None:
    garbage, expected = GARBAGE[name]
    data = STREAM + garbage
    chunks = [data] if feeding == "whole" else [data[i : i + 1] for i in range(len(data))]
    frames, error, splitter = _server_side(chunks)
    check_requests(frames)
    if expected is None:
        assert error is None
        assert splitter.buffered == len(garbage)  # kept, waiting for the rest
    else:
        assert type(error) is expected


@settings(max_examples=200)
@given(garbage=st.binary(min_size=1, max_size=40))
def test_random_trailing_garbage(garbage: bytes) -> None:
    frames, _, _ = _server_side([STREAM + garbage])
    # only StrataErrors escaped (_server_side lets anything else through) and the valid
    # frames all came out first; the garbage may itself happen to be a valid frame
    check_requests(frames[: len(FRAMES)])


# --- bad framing -------------------------------------------------------------------------------


def test_frame_too_large_as_soon_as_the_size_arrives() -> None:
    splitter = FrameSplitter(max_frame=LIMIT)
    prefix = struct.pack("<i", LIMIT + 1)
    for b in prefix[:3]:
        splitter.feed(bytes([b]))
        assert splitter.next_frame() is None
    splitter.feed(prefix[3:])
    with pytest.raises(FrameTooLargeError) as info:
        splitter.next_frame()
    assert (info.value.size, info.value.limit) == (LIMIT + 1, LIMIT)
    assert isinstance(info.value, MalformedFrameError)
    assert splitter.buffered == 4  # nothing was buffered toward the frame
    with pytest.raises(FrameTooLargeError):  # and the splitter stays failed
        splitter.next_frame()


def test_default_limit_refuses_the_largest_int32() -> None:
    splitter = FrameSplitter()
    splitter.feed(struct.pack("<i", 2**31 - 1))
    with pytest.raises(FrameTooLargeError):
        splitter.next_frame()
    assert DEFAULT_MAX_FRAME == 64 << 20


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    splitter = FrameSplitter(max_frame=LIMIT)
    splitter.feed(struct.pack("<i", LIMIT))
    assert splitter.next_frame() is None
    splitter.feed(bytes(LIMIT))
    assert splitter.next_frame() == bytes(LIMIT)


@pytest.mark.parametrize("size", [-1, -2, -(2**31)])
def test_negative_size_is_malformed(size: int) -> None:
    splitter = FrameSplitter()
    splitter.feed(struct.pack("<i", size))
    with pytest.raises(MalformedFrameError, match="negative") as info:
        splitter.next_frame()
    assert type(info.value) is MalformedFrameError
    with pytest.raises(MalformedFrameError, match="negative"):
        read_size(struct.pack("<i", size), LIMIT)


def test_read_size() -> None:
    assert read_size(struct.pack("<i", LIMIT), LIMIT) == LIMIT
    assert read_size(bytes(4), LIMIT) == 0
    with pytest.raises(FrameTooLargeError):
        read_size(struct.pack("<i", LIMIT + 1), LIMIT)
    for short in (b"", b"\x01", b"\x01\x00\x00", bytes(5)):
        with pytest.raises(MalformedFrameError, match="4 bytes"):
            read_size(short, LIMIT)


@pytest.mark.parametrize("index", range(len(REQUESTS)), ids=[k.name for k, _ in REQUESTS])
def test_every_truncated_request_frame_is_malformed(index: int) -> None:
    frame = FRAMES[index][4:]
    for cut in range(len(frame)):
        with pytest.raises(MalformedFrameError):
            decode_request_body(parse_request(frame[:cut]))
    # the same prefixes, size prefix included, are just "incomplete" to the splitter
    splitter = FrameSplitter()
    for b in FRAMES[index][:-1]:
        splitter.feed(bytes([b]))
        assert splitter.next_frame() is None


def test_every_truncated_response_frame_is_malformed() -> None:
    body = m.ProduceResponse(
        [m.ProduceTopicResult("t", [m.ProducePartitionResult(0, 0, None, 10, 0, 1, 2)])]
    )
    frame = b"".join(encode_response(7, body))[4:]
    for cut in range(len(frame)):
        with pytest.raises(MalformedFrameError):
            m.ProduceResponse.decode(parse_response(frame[:cut]).body)


def test_invalid_utf8_client_id_is_malformed() -> None:
    frame = struct.pack("<hhih", ApiKey.METADATA, 0, 1, 2) + b"\xc3\x28" + struct.pack("<i", -1)
    with pytest.raises(MalformedFrameError, match="UTF-8"):
        parse_request(frame)


def test_trailing_bytes_after_a_request_body_are_malformed() -> None:
    frame = FRAMES[1][4:] + b"\x00"
    req = parse_request(frame)  # the header parses: the agent can answer INVALID_REQUEST
    assert req.correlation_id == 101
    with pytest.raises(MalformedFrameError, match="unexpected bytes"):
        decode_request_body(req)


@pytest.mark.parametrize(
    ("api_key", "version"),
    [(99, 0), (-1, 0), (5, 0), (ApiKey.PRODUCE, 1), (ApiKey.FETCH, -1), (ApiKey.METADATA, 32767)],
)
def test_unknown_api_key_or_version(api_key: int, version: int) -> None:
    frame = struct.pack("<hhih", api_key, version, 77, -1) + b"whatever body"
    req = parse_request(frame)
    assert req.correlation_id == 77  # known, so the agent answers on the open connection
    with pytest.raises(UnsupportedVersionError) as info:
        decode_request_body(req)
    assert not isinstance(info.value, MalformedFrameError)
    assert info.value.code == 35


@settings(max_examples=300)
@given(frame=st.binary(max_size=48))
def test_random_request_frames_raise_only_strata_errors(frame: bytes) -> None:
    with contextlib.suppress(StrataError):
        decode_request_body(parse_request(frame))


@settings(max_examples=300)
@given(
    api_key=st.sampled_from([*ApiKey, 5, -1]),
    version=st.sampled_from([0, 1, -1]),
    body=st.binary(max_size=48),
)
def test_random_bodies_behind_a_valid_header_raise_only_strata_errors(
    api_key: int, version: int, body: bytes
) -> None:
    with contextlib.suppress(StrataError):
        decode_request_body(parse_request(struct.pack("<hhih", api_key, version, 1, -1) + body))


@settings(max_examples=300)
@given(frame=st.binary(max_size=24))
def test_random_response_frames_raise_only_strata_errors(frame: bytes) -> None:
    try:
        resp = parse_response(frame)
    except StrataError:
        return
    if resp.error_code:
        with contextlib.suppress(StrataError):
            assert isinstance(resp.error(), StrataError)
        return
    for api in API_LIST:
        with contextlib.suppress(StrataError):
            api.response.decode(resp.body)


# --- error responses ---------------------------------------------------------------------------


def test_error_response_gives_the_typed_exception_with_the_message() -> None:
    frame = b"".join(encode_error_response(9, NotLeaderError.code, "agent 3 leads orders-0"))
    splitter = FrameSplitter()
    splitter.feed(frame)
    (raw,) = drain(splitter)
    resp = parse_response(raw)
    assert (resp.correlation_id, resp.error_code) == (9, 6)
    err = resp.error()
    assert type(err) is NotLeaderError
    assert str(err) == "agent 3 leads orders-0"
    assert err.retriable
    assert (err.leader_id, err.leader_epoch) == (-1, -1)  # hints travel in partition fields


def test_error_response_message_is_bounded() -> None:
    frame = b"".join(encode_error_response(1, 42, "é" * 5000))
    err = parse_response(frame[4:]).error()
    assert err is not None
    assert str(err) == "é" * 1000


def test_error_response_needs_a_non_zero_code() -> None:
    with pytest.raises(ValueError, match="non-zero"):
        encode_error_response(1, 0, "no error")


def test_error_frame_without_a_message() -> None:
    err = parse_response(struct.pack("<ih", 1, 6)).error()
    assert type(err) is NotLeaderError
    assert "error code 6" in str(err)
    err = parse_response(struct.pack("<ihh", 1, 6, -1)).error()  # null message
    assert type(err) is NotLeaderError


@pytest.mark.parametrize(
    "body",
    [b"\x05", struct.pack("<h", 9) + b"abc", struct.pack("<h", 1) + b"ab", b"\xff\xff\x00"],
    ids=["torn-length", "torn-message", "trailing", "trailing-after-null"],
)
def test_torn_error_frame_is_malformed(body: bytes) -> None:
    resp = parse_response(struct.pack("<ih", 1, 6) + body)
    with pytest.raises(MalformedFrameError):
        resp.error()


# --- zero copy ---------------------------------------------------------------------------------


def test_produce_records_are_a_view_into_the_frame() -> None:
    splitter = FrameSplitter()
    splitter.feed(FRAMES[2])
    frame = splitter.next_frame()
    assert frame is not None
    req = decode_request_body(parse_request(frame))
    assert isinstance(req, m.ProduceRequest)
    records = req.topics[0].partitions[0].records
    assert isinstance(records, memoryview)
    assert records.obj is frame
    assert records.readonly
    assert bytes(records) == bytes(range(256)) * 4


def test_fetch_records_are_a_view_into_the_frame() -> None:
    batches = bytes(range(200))
    resp = m.FetchResponse(
        [m.FetchTopicResult("t", [m.FetchPartitionResult(0, 0, 10, 0, 1, 1, batches)])]
    )
    splitter = FrameSplitter()
    splitter.feed(b"".join(encode_response(1, resp)))
    frame = splitter.next_frame()
    assert frame is not None
    records: Any = (
        m.FetchResponse.decode(parse_response(frame).body).topics[0].partitions[0].records
    )
    assert records.obj is frame
    assert bytes(records) == batches
