"""Round trips through encode_batch / check_batch / decode_batch, and what a decoded batch looks like."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import (
    HEADERS_TYPE,
    SCHEMA,
    TAGS_TYPE,
    Compression,
    check_batch,
    decode_batch,
    encode_batch,
    read_header,
    summary,
)
from storage.codec.body import SMALL_BATCH
from storage.codec.header import ENCODINGS
from tests.codec_support import HEADER_SIZE, columns, reference_summary, summary_as_dict

INT64_MAX = 2**63 - 1
binaries = st.binary(max_size=24)
texts = st.text(max_size=8)
timestamps_ms = st.integers(0, 2**53)


@st.composite
def batch_inputs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, SMALL_BATCH + 6))

    def column(elements: st.SearchStrategy[Any]) -> Any:
        return draw(st.lists(elements, min_size=n, max_size=n))

    return {
        "values": column(st.none() | binaries),
        "keys": draw(st.none()) if draw(st.booleans()) else column(st.none() | binaries),
        "timestamps": draw(timestamps_ms) if draw(st.booleans()) else column(timestamps_ms),
        "headers": None
        if draw(st.booleans())
        else column(st.lists(st.tuples(texts, binaries), max_size=3)),
        "tags": None if draw(st.booleans()) else column(st.lists(texts, max_size=3)),
        "compression": draw(st.sampled_from(ENCODINGS)),
        "producer_id": draw(st.integers(-1, INT64_MAX)),
        "producer_epoch": draw(st.integers(-1, 2**15 - 1)),
        "base_sequence": draw(st.integers(-1, 2**31 - 1)),
        "transactional": draw(st.booleans()),
        "control": draw(st.booleans()),
        "base_offset": draw(st.integers(0, 2**62)),
        "leader_epoch": draw(st.integers(-1, 2**31 - 1)),
    }


def expected_columns(inputs: dict[str, Any]) -> dict[str, list[Any]]:
    n = len(inputs["values"])
    ts = inputs["timestamps"]
    base = inputs["base_offset"]
    return {
        "offset": list(range(base, base + n)),
        "timestamp": [ts] * n if isinstance(ts, int) else ts,
        "key": [None] * n if inputs["keys"] is None else inputs["keys"],
        "value": inputs["values"],
        "headers": [[]] * n if inputs["headers"] is None else inputs["headers"],
        "tags": [[]] * n if inputs["tags"] is None else inputs["tags"],
    }


@settings(max_examples=600, deadline=None)
@given(batch_inputs())
def test_round_trip_preserves_records_and_header(inputs: dict[str, Any]) -> None:
    batch = encode_batch(**inputs)
    want = expected_columns(inputs)
    n = len(inputs["values"])

    assert len(batch) % 8 == 0
    h = check_batch(batch)
    assert h == read_header(batch)
    assert (h.base_offset, h.leader_epoch, h.record_count, h.size) == (
        inputs["base_offset"],
        inputs["leader_epoch"],
        n,
        len(batch),
    )
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (
        inputs["producer_id"],
        inputs["producer_epoch"],
        inputs["base_sequence"],
    )
    assert (h.compression, h.is_transactional, h.is_control) == (
        inputs["compression"],
        inputs["transactional"],
        inputs["control"],
    )
    assert (h.first_timestamp, h.max_timestamp) == (want["timestamp"][0], max(want["timestamp"]))
    assert (h.last_offset, h.next_offset) == (want["offset"][-1], want["offset"][-1] + 1)
    assert batch[HEADER_SIZE + h.body_length : h.summary_position] == bytes(
        h.summary_position - HEADER_SIZE - h.body_length
    )
    assert h.summary_position + h.summary_length == len(batch)
    said = summary.of_batch(batch, 0, h)
    assert said is not None
    assert summary_as_dict(said) == reference_summary(n, inputs["tags"], inputs["headers"])
    check_batch(batch, deep=True)  # the leader's check: the summary agrees with the body

    rb = decode_batch(batch)
    assert rb.schema == SCHEMA
    assert columns(rb) == want


@settings(max_examples=400, deadline=None)
@given(batch_inputs())
def test_small_lists_encode_to_the_same_bytes_as_through_arrow(inputs: dict[str, Any]) -> None:
    """Up to ``SMALL_BATCH`` records given as lists of bytes skip pyarrow when encoding; the
    bytes must be exactly those of the Arrow path (reached here by passing Arrow arrays)."""
    through_arrow = dict(inputs)
    through_arrow["values"] = pa.array(inputs["values"], pa.binary())
    if inputs["keys"] is not None:
        through_arrow["keys"] = pa.array(inputs["keys"], pa.binary())
    assert encode_batch(**inputs) == encode_batch(**through_arrow)


def test_timestamps_default_to_now_and_accept_numpy() -> None:
    before = time.time_ns() // 1_000_000
    h = read_header(encode_batch([b"a", b"b"]))
    after = time.time_ns() // 1_000_000
    assert before <= h.first_timestamp == h.max_timestamp <= after

    ts = np.array([30, 10, 20], dtype=np.int64)
    rb = decode_batch(encode_batch([b"a", b"b", b"c"], timestamps=ts))
    assert columns(rb)["timestamp"] == [30, 10, 20]


@pytest.mark.parametrize("compression", list(ENCODINGS))
def test_large_batch_round_trip(compression: Compression) -> None:
    n = 5_000
    values = [bytes([i % 251]) * (i % 97) for i in range(n)]
    keys = [None if i % 7 == 0 else str(i).encode() for i in range(n)]
    batch = encode_batch(values, keys=keys, timestamps=list(range(n)), compression=compression)
    got = columns(decode_batch(batch))
    assert got["value"] == values
    assert got["key"] == keys
    if compression != Compression.NONE:
        assert read_header(batch).body_length < read_header(batch).raw_body_length


# --- pyarrow inputs ----------------------------------------------------------------------------

BINARY_LIKE = [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()]


def test_sliced_arrow_values_and_keys() -> None:
    big = [f"value-{i}".encode() * (i % 3) for i in range(20)]
    big_keys = [None if i % 4 == 0 else f"k{i}".encode() for i in range(20)]
    values = pa.array(big).slice(3, 10)
    keys = pa.array(big_keys).slice(5, 10)
    assert values.offset == 3 and keys.offset == 5
    got = columns(decode_batch(encode_batch(values, keys=keys, timestamps=1)))
    assert got["value"] == big[3:13]
    assert got["key"] == big_keys[5:15]


@settings(max_examples=400, deadline=None)
@given(
    big=st.lists(st.none() | texts, min_size=1, max_size=30),
    big_keys=st.lists(st.none() | texts, min_size=1, max_size=30),
    big_headers=st.lists(st.lists(st.tuples(texts, binaries), max_size=3), min_size=1, max_size=30),
    big_tags=st.lists(st.lists(texts, max_size=3), min_size=1, max_size=30),
    value_type=st.sampled_from(BINARY_LIKE),
    key_type=st.sampled_from(BINARY_LIKE),
    compression=st.sampled_from(ENCODINGS),
    data=st.data(),
)
def test_round_trip_from_sliced_arrow_arrays(
    big: list[str | None],
    big_keys: list[str | None],
    big_headers: list[list[tuple[str, bytes]]],
    big_tags: list[list[str]],
    value_type: pa.DataType,
    key_type: pa.DataType,
    compression: Compression,
    data: st.DataObject,
) -> None:
    n = data.draw(st.integers(1, min(map(len, (big, big_keys, big_headers, big_tags)))))

    def sliced(items: list[Any], type_: pa.DataType) -> tuple[pa.Array, list[Any]]:
        start = data.draw(st.integers(0, len(items) - n))
        return pa.array(items, type=type_).slice(start, n), items[start : start + n]

    def as_bytes(items: list[str | None]) -> list[bytes | None]:
        return [None if s is None else s.encode() for s in items]

    values, want_values = sliced(big, value_type)
    keys, want_keys = sliced(big_keys, key_type)
    headers, want_headers = sliced(big_headers, HEADERS_TYPE)
    tags, want_tags = sliced(big_tags, TAGS_TYPE)
    batch = encode_batch(
        values, keys=keys, headers=headers, tags=tags, timestamps=7, compression=compression
    )
    check_batch(batch)
    got = columns(decode_batch(batch))
    assert got["value"] == as_bytes(want_values)
    assert got["key"] == as_bytes(want_keys)
    assert got["headers"] == want_headers
    assert got["tags"] == want_tags


def test_chunked_arrow_values() -> None:
    values = pa.chunked_array([[b"a", b"bb"], [None], [b"ccc"]])
    keys = pa.chunked_array([[b"k"], [None, b"kk", b""]])
    got = columns(decode_batch(encode_batch(values, keys=keys, timestamps=1)))
    assert got["value"] == [b"a", b"bb", None, b"ccc"]
    assert got["key"] == [b"k", None, b"kk", b""]


# --- what a decoded batch looks like -----------------------------------------------------------


@pytest.mark.parametrize("compression", list(ENCODINGS))
def test_decoded_arrays_are_valid_and_typed(compression: Compression) -> None:
    batch = encode_batch(
        [b"v1", None, b"v3"],
        keys=[None, b"k2", None],
        timestamps=[1_700_000_000_000, 1_700_000_000_001, 1_700_000_000_002],
        headers=[[("h", b"1")], [], [("\u00e9", b"")]],
        tags=[["a", "b"], [], ["\u00e7"]],
        compression=compression,
    )
    rb = decode_batch(batch, verify=True)
    rb.validate(full=True)
    for col in rb.columns:
        col.validate(full=True)
    assert rb.schema == SCHEMA
    assert rb.schema.field("timestamp").type == pa.timestamp("ms", tz="UTC")
    assert rb.column("key").to_pylist() == [None, b"k2", None]
    assert rb.column("key").null_count == 2
    assert rb.column("value").to_pylist() == [b"v1", None, b"v3"]
    assert rb.column("timestamp")[0].value == 1_700_000_000_000


def test_uncompressed_decode_is_zero_copy_and_aligned() -> None:
    batch = encode_batch(
        [b"abc", b"defgh", None], keys=[b"k", None, b"kkk"], tags=[["t"], [], []], timestamps=1
    )
    buf = pa.allocate_buffer(len(batch))  # 64-byte aligned, like a page-aligned mmap
    np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(batch, dtype=np.uint8)
    rb = decode_batch(buf)
    start, end = buf.address, buf.address + buf.size
    for name in ("timestamp", "key", "value", "tags"):
        col = rb.column(name)
        arrays = [col, col.values] if name == "tags" else [col]
        for arr in arrays:
            for b in arr.buffers():
                if b is not None and b.size:
                    assert start <= b.address and b.address + b.size <= end, name
                    assert (b.address - start) % 8 == 0, name


# --- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [[], pa.array([], pa.binary()), pa.array([b"a", b"b"]).slice(1, 0)],
    ids=["list", "array", "empty-slice"],
)
def test_encode_zero_records_is_a_value_error(values: Any) -> None:
    with pytest.raises(ValueError):
        encode_batch(values, timestamps=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keys": [b"k1", b"k2"]},
        {"keys": [b"k1", b"k2", b"k3", b"k4"]},
        {"keys": pa.array([b"k1"])},
        {"timestamps": [1, 2]},
        {"timestamps": np.array([1, 2, 3, 4], dtype=np.int64)},
        {"headers": [[("a", b"b")]]},
        {"tags": [["x"], [], [], []]},
    ],
    ids=["keys-short", "keys-long", "keys-array", "ts-short", "ts-numpy-long", "headers", "tags"],
)
def test_encode_mismatched_column_lengths_is_a_value_error(kwargs: dict[str, Any]) -> None:
    kwargs.setdefault("timestamps", 1)
    with pytest.raises(ValueError):
        encode_batch([b"a", b"b", b"c"], **kwargs)
