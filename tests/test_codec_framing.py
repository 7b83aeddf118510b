"""Splitting a byte stream into batches: BatchFramer (incremental) and iter_batches (in memory).

Each is fed three ways (STYLE.md point 2): the whole input at once, one byte at a time, and
with trailing garbage; a torn tail raises CorruptBatchError at the position of the first byte
that is not part of a whole batch, after every whole batch before it has come out.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import (
    BatchFramer,
    Compression,
    decode_batch,
    decode_batches,
    encode_batch,
    iter_batches,
    read_header,
)
from storage.codec.batch import CrcVerifier
from storage.errors import CorruptBatchError, InvalidRequestError
from tests.codec_support import columns


def _stream_batches() -> list[bytes]:
    out = []
    base = 0
    for i, compression in enumerate(
        [Compression.NONE, Compression.ZSTD, Compression.NONE, Compression.LZ4, Compression.NONE]
    ):
        n = 1 + 3 * i
        out.append(
            encode_batch(
                [f"value {i}.{j}".encode() * (j + 1) for j in range(n)],
                keys=[None if j % 2 else f"key{j}".encode() for j in range(n)],
                timestamps=1_000 + i,
                tags=[[f"t{i}"]] * n,
                compression=compression,
                base_offset=base,
            )
        )
        base += n
    return out


BATCHES = _stream_batches()
STREAM = b"".join(BATCHES)
ENDS = list(accumulate(len(b) for b in BATCHES))
STARTS = [0, *ENDS[:-1]]
LAST = BATCHES[-1]
BEFORE_LAST = STREAM[: -len(LAST)]


def _garbage() -> dict[str, bytes]:
    bad_crc = bytearray(BATCHES[0])
    bad_crc[100] ^= 0x01
    return {
        "short": b"\x00" * 8,
        "zeros": b"\x00" * 100,
        "ones": b"\xff" * 100,
        "text": b"GARBAGE!" * 20,
        "torn-batch": BATCHES[0][:-8],
    }, bytes(bad_crc)


GARBAGE, BAD_CRC_COPY = _garbage()


def one_byte_at_a_time(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def feed_all(
    framer: BatchFramer, chunks: Iterable[bytes], out: list[tuple[int, bytes]] | None = None
) -> list[tuple[int, bytes]]:
    """Feed every chunk, taking out batches after each; (bytes fed so far, batch) per batch.

    Batches are appended to ``out`` as they come, so a caller still has them if a later
    chunk raises.
    """
    out = [] if out is None else out
    fed = 0
    for chunk in chunks:
        framer.feed(chunk)
        fed += len(chunk)
        while (batch := framer.next_batch()) is not None:
            out.append((fed, batch))
    return out


# --- BatchFramer -------------------------------------------------------------------------------


def test_framer_whole_input() -> None:
    framer = BatchFramer()
    out = feed_all(framer, [STREAM])
    assert [b for _, b in out] == BATCHES
    assert framer.buffered == 0
    assert framer.consumed == len(STREAM)
    framer.close()


def test_framer_one_byte_at_a_time_yields_each_batch_at_its_last_byte() -> None:
    framer = BatchFramer()
    out = feed_all(framer, one_byte_at_a_time(STREAM))
    assert out == list(zip(ENDS, BATCHES, strict=True))
    assert framer.buffered == 0
    framer.close()


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(1, len(STREAM) - 1), max_size=40))
def test_framer_any_chunking(cuts: set[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    framer = BatchFramer()
    out = feed_all(framer, [STREAM[a:b] for a, b in pairwise(points)])
    assert [b for _, b in out] == BATCHES
    # a batch comes out with the chunk that completes it, never later
    assert [fed for fed, _ in out] == [min(p for p in points if p >= end) for end in ENDS]
    framer.close()


@pytest.mark.parametrize("feeding", ["whole", "bytewise"])
@pytest.mark.parametrize("garbage", [*GARBAGE.values(), BAD_CRC_COPY], ids=[*GARBAGE, "bad-crc"])
def test_framer_trailing_garbage(garbage: bytes, feeding: str) -> None:
    data = STREAM + garbage
    chunks = [data] if feeding == "whole" else one_byte_at_a_time(data)
    framer = BatchFramer()
    out: list[tuple[int, bytes]] = []
    with pytest.raises(CorruptBatchError) as info:
        feed_all(framer, chunks, out)
        framer.close()
    assert [b for _, b in out] == BATCHES
    assert info.value.position == len(STREAM)


def test_framer_close_with_torn_tail() -> None:
    for cut in range(1, len(LAST)):
        framer = BatchFramer()
        out = feed_all(framer, [BEFORE_LAST + LAST[:cut]])
        assert [b for _, b in out] == BATCHES[:-1], cut
        assert framer.next_batch() is None
        assert framer.buffered == cut
        with pytest.raises(CorruptBatchError) as info:
            framer.close()
        assert info.value.position == len(BEFORE_LAST)


def test_framer_close_with_torn_tail_fed_bytewise() -> None:
    framer = BatchFramer()
    out = feed_all(framer, one_byte_at_a_time(STREAM[:-1]))
    assert [b for _, b in out] == BATCHES[:-1]
    with pytest.raises(CorruptBatchError):
        framer.close()


def test_framer_refuses_an_oversized_length_before_buffering_it() -> None:
    big = encode_batch([b"x" * 1000], timestamps=1)
    framer = BatchFramer(max_batch_size=512)
    framer.feed(big[:12])  # just the length field
    with pytest.raises(InvalidRequestError):
        framer.next_batch()
    framer = BatchFramer(max_batch_size=len(big))
    assert feed_all(framer, [big]) == [(len(big), big)]


def test_framer_output_decodes_to_the_records() -> None:
    framer = BatchFramer()
    out = feed_all(framer, one_byte_at_a_time(STREAM))
    offsets = [o for _, b in out for o in columns(decode_batch(b))["offset"]]
    assert offsets == list(range(len(offsets)))


# --- iter_batches / decode_batches ---------------------------------------------------------------


def test_iter_batches_whole_input() -> None:
    got = list(iter_batches(STREAM))
    assert [pos for _, pos in got] == STARTS
    assert [h for h, _ in got] == [read_header(b) for b in BATCHES]


def test_iter_batches_respects_pos_and_end() -> None:
    got = list(iter_batches(STREAM, STARTS[1], ENDS[2]))
    assert [pos for _, pos in got] == STARTS[1:3]


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_iter_batches_trailing_garbage(garbage: bytes) -> None:
    got = []
    with pytest.raises(CorruptBatchError) as info:
        for _, pos in iter_batches(STREAM + garbage):
            got.append(pos)
    assert got == STARTS
    assert info.value.position == len(STREAM)


def test_iter_batches_truncated_at_every_byte_of_the_last_batch() -> None:
    for cut in range(1, len(LAST)):
        got = []
        with pytest.raises(CorruptBatchError) as info:
            for _, pos in iter_batches(BEFORE_LAST + LAST[:cut]):
                got.append(pos)
        assert got == STARTS[:-1], cut
        assert info.value.position == len(BEFORE_LAST), cut


def test_decode_batches_concatenation() -> None:
    table = decode_batches(STREAM)
    assert table.column("offset").to_pylist() == list(range(table.num_rows))
    assert table.num_rows == sum(read_header(b).record_count for b in BATCHES)
    assert table.column("value").num_chunks == len(BATCHES)


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_decode_batches_trailing_garbage(garbage: bytes) -> None:
    with pytest.raises(CorruptBatchError):
        decode_batches(STREAM + garbage)


# ---- CrcVerifier: the CRCs of a stream of batches checked as it goes by ----------------------


def _feed(verifier: CrcVerifier, data: bytes, cuts: Iterable[int]) -> None:
    points = sorted({0, *(c for c in cuts if 0 < c < len(data)), len(data)})
    for a, b in pairwise(points):
        verifier.feed(memoryview(data)[a:b])


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=40))
def test_crc_verifier_checks_every_batch_however_the_stream_is_cut(cuts: list[int]) -> None:
    v = CrcVerifier(0, 0)
    _feed(v, STREAM, cuts)
    assert v.verified == len(STREAM) and not v.stopped
    assert v.covers(STARTS[1], ENDS[3]) and v.covers(0, len(STREAM))


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=20), which=st.integers(0, 4))
def test_crc_verifier_stops_at_the_first_damaged_batch(cuts: list[int], which: int) -> None:
    damaged = bytearray(STREAM)
    damaged[STARTS[which] + 40] ^= 0x01  # inside the CRC-covered header fields
    v = CrcVerifier(0, 0)
    _feed(v, bytes(damaged), cuts)
    assert v.stopped
    assert v.verified == STARTS[which]  # every batch before it, none from it on
    assert v.covers(0, STARTS[which]) and not v.covers(STARTS[which], ENDS[which])


def test_crc_verifier_starts_mid_stream_at_a_known_boundary_and_stops_at_a_bad_length() -> None:
    # the stream starts inside batch 0 (as a ranged GET from a block does); checking begins
    # at batch 2's start; bytes before it are not looked at
    start = STARTS[0] + 100
    v = CrcVerifier(start, STARTS[2])
    _feed(v, STREAM[start:], [7, 300, 301])
    assert v.verified == len(STREAM)
    assert v.covers(STARTS[2], len(STREAM)) and not v.covers(STARTS[1], len(STREAM))
    torn = bytearray(STREAM)
    torn[STARTS[3] + 8 : STARTS[3] + 12] = (5).to_bytes(4, "little")  # an impossible length
    v = CrcVerifier(0, 0)
    v.feed(bytes(torn))
    assert v.stopped and v.verified == STARTS[3]
    with pytest.raises(ValueError):
        CrcVerifier(100, 99)
