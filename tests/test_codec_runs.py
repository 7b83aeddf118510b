"""decode_run: many small plain batches (headers and tags included) as one Arrow record batch,
equal to decoding them one by one; it stops before whatever it does not take (a non-plain,
torn, corrupt or forged batch) and leaves that batch to ``decode_batch``."""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import Compression, decode_batch, decode_batches, encode_batch, stamp
from storage.codec.control import encode_marker
from storage.codec.runs import RUN_BATCH_RECORDS, decode_run
from storage.errors import CorruptBatchError
from tests.codec_support import HEADER_SIZE, body_buffers, with_crc


def small(base: int, n: int, **kw: Any) -> bytes:
    return encode_batch(
        [b"value-%d" % (base + i) for i in range(n)],
        keys=[b"k%d" % i for i in range(n)],
        base_offset=base,
        timestamps=1000 + base,
        **kw,
    )


def marker(base: int) -> bytes:
    out = bytearray(encode_marker(1, 0, commit=True, coordinator_epoch=0, timestamp_ms=1000))
    prefix = stamp(base, len(out) - 12, 0)
    out[: len(prefix)] = prefix
    return bytes(out)


def table(rb: pa.RecordBatch) -> pa.Table:
    return pa.Table.from_batches([rb])


@st.composite
def plain_batches(draw: st.DrawFn) -> list[bytes]:
    out = []
    base = draw(st.integers(0, 1 << 40))
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 6))
        maybe = st.one_of(st.none(), st.binary(max_size=12))
        keys = draw(st.one_of(st.none(), st.lists(maybe, min_size=n, max_size=n)))
        values = draw(st.lists(maybe, min_size=n, max_size=n))
        stamps = draw(st.lists(st.integers(0, 2**50), min_size=n, max_size=n))
        pair = st.tuples(st.text(max_size=6), st.binary(max_size=6))
        headers = draw(
            st.one_of(st.none(), st.lists(st.lists(pair, max_size=3), min_size=n, max_size=n))
        )
        tags = draw(
            st.one_of(
                st.none(),
                st.lists(
                    st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
                    min_size=n,
                    max_size=n,
                ),
            )
        )
        out.append(
            encode_batch(
                values,
                keys=keys,
                timestamps=stamps,
                base_offset=base,
                headers=headers,
                tags=tags,
                summary=draw(st.booleans()),
            )
        )
        base += n + draw(st.sampled_from([0, 0, 1, 7]))  # gaps, as after a compaction
    return out


@settings(max_examples=150, deadline=None)
@given(plain_batches())
def test_a_run_decodes_to_what_the_batches_decode_to_one_by_one(batches: list[bytes]) -> None:
    buf = b"".join(batches)
    got = decode_run(buf)
    assert got is not None
    rb, end, next_offset = got
    assert end == len(buf)
    assert table(rb).equals(decode_batches(buf))
    assert next_offset == decode_batch(batches[-1]).column(0)[-1].as_py() + 1
    unchecked = decode_run(buf, verify=False)
    assert unchecked is not None and table(unchecked[0]).equals(table(rb))


def test_a_run_starts_at_a_position_and_stops_at_an_end() -> None:
    batches = [small(10 * i, 3) for i in range(4)]
    buf = b"".join(batches)
    start, stop = len(batches[0]), len(batches[0]) + len(batches[1]) + len(batches[2])
    got = decode_run(buf, start, stop)
    assert got is not None
    rb, end, next_offset = got
    assert end == stop and next_offset == 23
    assert rb.column(0).to_pylist() == [10, 11, 12, 20, 21, 22]
    assert decode_run(buf, len(buf)) is None


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda base: small(base, 3, compression=Compression.ZSTD), id="compressed"),
        pytest.param(lambda base: small(base, RUN_BATCH_RECORDS + 1), id="large"),
        pytest.param(lambda base: marker(base), id="control"),
    ],
)
def test_the_run_stops_before_a_batch_that_is_not_plain(other: Any) -> None:
    before = small(0, 2) + small(2, 2)
    odd = other(4)
    buf = before + odd + small(100, 2)
    got = decode_run(buf)
    assert got is not None
    rb, end, next_offset = got
    assert (end, next_offset, rb.num_rows) == (len(before), 4, 4)
    assert decode_run(buf, len(before)) is None  # decoded alone, by decode_batch


def test_a_torn_tail_is_left_out_at_every_cut() -> None:
    whole = small(0, 2) + small(2, 3)
    last = small(5, 2)
    for cut in range(len(last)):
        got = decode_run(whole + last[:cut])
        assert got is not None
        rb, end, _ = got
        assert (end, rb.num_rows) == (len(whole), 5)
        assert decode_run(last[:cut]) is None


def test_trailing_garbage_is_left_out() -> None:
    whole = small(0, 2) + small(2, 3)
    for garbage in (b"\x00" * 200, b"\xff" * 7, bytes(range(256))):
        got = decode_run(whole + garbage)
        assert got is not None
        assert got[1] == len(whole) and got[0].num_rows == 5


def test_a_corrupt_batch_ends_the_run_and_is_refused_alone() -> None:
    first, second = small(0, 2), bytearray(small(2, 3))
    second[HEADER_SIZE + 80] ^= 0x01  # inside the body: the CRC no longer matches
    buf = first + bytes(second) + small(5, 1)
    got = decode_run(buf)
    assert got is not None and got[1] == len(first)
    assert decode_run(buf, len(first)) is None
    with pytest.raises(CorruptBatchError):
        decode_batch(buf, len(first))


def test_offsets_that_do_not_start_at_zero_end_the_run() -> None:
    """A batch that passes its checks but whose value offsets start past 0 (no encoder writes
    that) is decoded alone, where Arrow reads it as it is."""
    plain = small(0, 2)
    forged = bytearray(small(2, 2))
    buffers = body_buffers(bytes(forged))
    offsets_at, _ = buffers[5]
    data_at, data_len = buffers[6]
    first_len = struct.unpack_from("<i", forged, offsets_at + 4)[0]
    struct.pack_into("<i", forged, offsets_at, 1)  # the first value loses its first byte
    assert first_len > 1 and data_len > first_len and data_at
    forged_batch = with_crc(forged)
    buf = plain + forged_batch
    got = decode_run(buf)
    assert got is not None and got[1] == len(plain)
    alone = decode_batch(forged_batch)
    assert alone.column("value")[0].as_py() == b"alue-2"


def test_headers_and_tags_join_the_run() -> None:
    """Records with headers and tags (what the delay scheduler and the retry router write, one
    per batch) decode in one run, beside batches without."""
    batches = [
        small(0, 2),
        small(2, 1, headers=[[("strata.retry.group", b"g"), ("trace", b"\x00\xff")]]),
        small(3, 3, tags=[["a"], None, ["b", "c"]], headers=[[], [("h", b"")], []]),
        small(6, 1, summary=True, tags=[["tag"]]),
    ]
    buf = b"".join(batches)
    got = decode_run(buf)
    assert got is not None
    rb, end, next_offset = got
    assert (end, next_offset) == (len(buf), 7)
    assert table(rb).equals(decode_batches(buf))
    assert rb.column("headers")[2].as_py() == [
        {"key": "strata.retry.group", "value": b"g"},
        {"key": "trace", "value": b"\x00\xff"},
    ]
    assert rb.column("tags").to_pylist()[3:7] == [["a"], [], ["b", "c"], ["tag"]]


def test_a_forged_header_key_that_is_not_utf8_is_refused_alone() -> None:
    """A header key whose bytes are not UTF-8 (its CRC made to match) is not taken into a run:
    the run is not used, and the batch decoded alone raises the typed error."""
    plain = small(0, 2)
    forged = bytearray(small(2, 1, headers=[[("ab", b"v")]]))
    key_data_at, key_data_len = body_buffers(bytes(forged))[9]
    assert key_data_len == 2
    forged[key_data_at] = 0xFF
    bad = with_crc(forged)
    buf = plain + bad
    assert decode_run(buf) is None
    assert decode_batch(buf).num_rows == 2  # what the consumer does then: the first alone
    assert decode_run(buf, len(plain)) is None
    with pytest.raises(CorruptBatchError):
        decode_batch(buf, len(plain))


def test_header_list_offsets_that_do_not_match_their_pairs_end_the_run() -> None:
    plain = small(0, 2)
    forged = bytearray(small(2, 2, headers=[[("a", b"1")], [("b", b"2")]]))
    lists_at, lists_len = body_buffers(bytes(forged))[7]
    assert lists_len == 12
    struct.pack_into("<i", forged, lists_at + 8, 1)  # claims 1 pair where there are 2
    buf = plain + with_crc(forged)
    got = decode_run(buf)
    assert got is not None and got[1] == len(plain)
    assert decode_run(buf, len(plain)) is None
