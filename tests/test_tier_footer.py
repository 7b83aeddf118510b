"""The segment-object footer codec (``storage.tier.layout``), tested the house way.

Whole input, one byte at a time (every prefix and every suffix of a footer is either the
footer or a typed ``CorruptSegmentError``), trailing garbage, a golden vector, and a
Hypothesis round trip over random segments (batch counts, sizes, epochs, timestamps, index
intervals) that also checks the index lookups against a brute-force walk of the batches.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import encode_batch, iter_batches
from storage.errors import CorruptSegmentError
from storage.tier.layout import (
    ENTRY,
    TRAILER_SIZE,
    Footer,
    build_footer,
    decode_footer,
    decode_trailer,
)

T0 = 1_700_000_000_000


def _segment(spec: list[tuple[int, int, int, int]], base: int) -> bytes:
    """Batches of (records, value size, leader epoch, timestamp delta) with offsets from base,
    in record-batch format version 1 (still valid; the golden footer below pins the footer
    codec, so its segment keeps the bytes it was made from)."""
    out = bytearray()
    offset = base
    for i, (n, size, epoch, dt) in enumerate(spec):
        values = [bytes([i % 256]) * size for _ in range(n)]
        ts = [T0 + dt + j for j in range(n)]
        out += encode_batch(
            values, timestamps=ts, base_offset=offset, leader_epoch=epoch, summary=False
        )
        offset += n
    return bytes(out)


GOLDEN_SPEC = [(2, 5, 1, 0), (3, 1, 4, 100), (1, 0, 2, 50)]
GOLDEN_FOOTER = (
    "0000000000000000000000000000008002000000c00000000168e5cf8b01000005000000800100006668e5cf"
    "8b010000535453470100000007000000000000000d0000000000000004000000030000000600000000000000"
    "18020000000000000068e5cf8b0100006668e5cf8b01000003000000010000001f88e17a4877db7a00000000"
    "8009b2c1"
)


def _golden() -> tuple[bytes, bytes]:
    data = _segment(GOLDEN_SPEC, base=7)
    return data, build_footer(data, interval=1)


def test_golden_vector() -> None:
    data, footer = _golden()
    f = decode_footer(footer)
    assert (f.base_offset, f.next_offset, f.leader_epoch) == (7, 13, 4)
    assert (f.batch_count, f.record_count, f.data_length) == (3, 6, len(data))
    assert (f.first_timestamp, f.max_timestamp) == (T0, T0 + 102)
    assert list(f.rels) == [0, 2, 5] and f.positions[0] == 0
    assert list(f.max_ts_before) == [-(1 << 63), T0 + 1, T0 + 102]
    trailer = footer[-TRAILER_SIZE:]
    assert trailer[:8] == b"STSG\x01\x00\x00\x00"
    assert struct.unpack_from("<qqiIq", trailer, 8) == (7, 13, 4, 3, 6)
    assert decode_trailer(footer) == (len(data), 3, 3 * ENTRY.size)
    assert len(footer) == 3 * ENTRY.size + TRAILER_SIZE == 136


def test_golden_bytes_are_stable() -> None:
    # the footer of a fixed segment, byte for byte (changes only with the format or the codec)
    _, footer = _golden()
    assert footer.hex() == GOLDEN_FOOTER
    assert decode_footer(bytes.fromhex(GOLDEN_FOOTER)) == decode_footer(footer)


def test_whole_input_and_with_data_in_front() -> None:
    data, footer = _golden()
    assert decode_footer(footer) == decode_footer(data + footer)  # a whole object decodes too


def test_one_byte_at_a_time() -> None:
    """Every prefix and every proper suffix of a footer raises the typed error."""
    _, footer = _golden()
    whole = decode_footer(footer)
    for k in range(len(footer)):
        with pytest.raises(CorruptSegmentError):
            decode_footer(footer[:k])  # torn at the end: the trailer is never last
        with pytest.raises(CorruptSegmentError):
            decode_footer(footer[k + 1 :])  # torn at the front: the index is incomplete
    assert decode_footer(footer) == whole
    for k in range(TRAILER_SIZE):
        with pytest.raises(CorruptSegmentError):
            decode_trailer(footer[-k:] if k else b"")


@pytest.mark.parametrize("garbage", [b"\0", b"\0" * 8, b"STSG", b"x" * 88, b"\xff" * 1000])
def test_trailing_garbage(garbage: bytes) -> None:
    _, footer = _golden()
    with pytest.raises(CorruptSegmentError):
        decode_footer(footer + garbage)
    with pytest.raises(CorruptSegmentError):
        decode_trailer(footer + garbage)


def test_every_single_bit_flip_is_caught() -> None:
    _, footer = _golden()
    for i in range(len(footer)):
        for bit in (0x01, 0x80):
            bad = bytearray(footer)
            bad[i] ^= bit
            with pytest.raises(CorruptSegmentError):
                decode_footer(bytes(bad))


batches = st.lists(
    st.tuples(
        st.integers(1, 6),  # records
        st.integers(0, 300),  # value size
        st.integers(0, 1000),  # leader epoch
        st.integers(-5000, 5000),  # timestamp delta
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    spec=batches,
    base=st.integers(0, 1 << 40),
    interval=st.sampled_from([1, 64, 512, 4096, 64 * 1024]),
    garbage=st.binary(min_size=1, max_size=40),
)
def test_round_trip(
    spec: list[tuple[int, int, int, int]], base: int, interval: int, garbage: bytes
) -> None:
    data = _segment(spec, base)
    footer = build_footer(data, interval=interval)
    f = decode_footer(data + footer)
    assert f == decode_footer(footer)
    heads = list(iter_batches(data))
    assert f.base_offset == base and f.next_offset == base + sum(n for n, *_ in spec)
    assert f.leader_epoch == max(e for _, _, e, _ in spec)
    assert (f.batch_count, f.record_count, f.data_length) == (
        len(spec),
        f.next_offset - base,
        len(data),
    )
    assert f.max_timestamp == max(h.max_timestamp for h, _ in heads)
    assert f.index_interval == interval and len(footer) == f.footer_length
    _check_lookups(f, heads)
    with pytest.raises(CorruptSegmentError):
        decode_footer(footer + garbage)


def _check_lookups(f: Footer, heads: list[tuple[object, int]]) -> None:
    starts = [pos for _, pos in heads]
    for h, pos in heads:
        for offset in (h.base_offset, h.next_offset - 1):  # type: ignore[attr-defined]
            found = f.position_for_offset(offset)
            assert found in starts and found <= pos  # a batch start at or before the holder
        # every batch with max timestamp >= t is at or after position_for_timestamp(t)
        t = h.max_timestamp  # type: ignore[attr-defined]
        from_pos = f.position_for_timestamp(t)
        assert from_pos in starts
        first = next(p for hh, p in heads if hh.max_timestamp >= t)  # type: ignore[attr-defined]
        assert from_pos <= first
