"""Bad input to the codec: every failure is a typed StrataError, never IndexError/struct.error.

Regions of a batch and what damage to each must do (storage/codec/header.py):

* bytes 0-7 base_offset and 12-15 leader_epoch are stamped by the leader outside the CRC: a
  change is not an error (the batch now claims other offsets / another epoch) unless it makes
  the header impossible (a negative base offset);
* bytes 8-11 batch_length: the batch no longer frames -> CorruptBatchError;
* byte 16 magic -> UnsupportedVersionError;
* bytes 17-19 reserved (outside the CRC, must be zero) and everything from byte 20 on
  (CRC field, CRC-covered header, body, padding) -> CorruptBatchError.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.codec import (
    BatchFramer,
    Compression,
    check_batch,
    decode_batch,
    decode_batches,
    encode_batch,
    iter_batches,
    read_header,
    stamp,
)
from storage.errors import (
    BatchTooLargeError,
    CorruptBatchError,
    StrataError,
    UnsupportedVersionError,
)
from tests.codec_support import HEADER_SIZE, body_buffers, columns, patch, with_crc


def small_batch(compression: Compression = Compression.NONE) -> bytes:
    return encode_batch(
        [b"first", None, b"third value"],
        keys=[b"k1", None, b""],
        timestamps=[1_700_000_000_000, 1_700_000_000_005, 1_700_000_000_002],
        headers=[[("trace", b"t-1")], [], [("a", b""), ("b", b"2")]],
        tags=[["red"], [], ["blue", "green"]],
        producer_id=77,
        producer_epoch=2,
        base_sequence=9,
        compression=compression,
        base_offset=1000,
        leader_epoch=4,
    )


SMALL = small_batch()


def decodes_or_raises_typed(buf: Any) -> pa.RecordBatch | None:
    """decode_batch, where any StrataError is an acceptable answer and anything else fails."""
    try:
        rb = decode_batch(buf)
    except StrataError:
        return None
    rb.validate(full=True)
    return rb


# --- every byte flipped ---------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD], ids=["none", "zstd"])
def test_flip_every_byte(compression: Compression, mask: int) -> None:
    batch = small_batch(compression)
    original = columns(decode_batch(batch))
    for i in range(len(batch)):
        flipped = bytearray(batch)
        flipped[i] ^= mask
        flipped_bytes = bytes(flipped)
        if i < 8:  # base_offset: not covered by the CRC
            new_base = struct.unpack_from("<q", flipped_bytes)[0]
            if new_base < 0:
                for fn in (check_batch, decode_batch):
                    with pytest.raises(CorruptBatchError):
                        fn(flipped_bytes)
            else:
                assert check_batch(flipped_bytes).base_offset == new_base
                got = columns(decode_batch(flipped_bytes))
                assert got["offset"] == [new_base + k for k in range(3)]
                assert {**got, "offset": None} == {**original, "offset": None}
        elif 12 <= i < 16:  # leader_epoch: not covered by the CRC, any value is legal
            new_epoch = struct.unpack_from("<i", flipped_bytes, 12)[0]
            assert check_batch(flipped_bytes).leader_epoch == new_epoch
            assert columns(decode_batch(flipped_bytes)) == original
        else:
            expected = UnsupportedVersionError if i == 16 else CorruptBatchError
            for fn in (check_batch, decode_batch):
                with pytest.raises(expected):
                    fn(flipped_bytes)


def test_stamp_rewrites_offset_and_epoch_without_breaking_the_crc() -> None:
    restamped = stamp(5_000, len(SMALL) - 12, 9) + SMALL[16:]
    h = check_batch(restamped)
    assert (h.base_offset, h.leader_epoch, h.crc) == (5_000, 9, read_header(SMALL).crc)
    assert columns(decode_batch(restamped))["offset"] == [5_000, 5_001, 5_002]


@pytest.mark.parametrize("magic", [0, 3, 0x7F, 0xFF])
def test_unknown_magic_is_unsupported_version(magic: int) -> None:
    bad = bytes(patch(SMALL, 16, "<B", magic))
    for fn in (read_header, check_batch, decode_batch):
        with pytest.raises(UnsupportedVersionError):
            fn(bad)
    framer = BatchFramer()
    framer.feed(bad)
    with pytest.raises(UnsupportedVersionError):
        framer.next_batch()


def test_a_version_change_without_its_summary_is_corrupt() -> None:
    # version 2 -> 1: a summary where version 1 has reserved zero bytes; 1 -> 2: no summary
    v1 = encode_batch([b"old"], tags=[["t"]], summary=False)
    for batch, other in ((SMALL, 1), (v1, 2)):
        bad = with_crc(patch(batch, 16, "<B", other))
        for fn in (read_header, check_batch, decode_batch):
            with pytest.raises(CorruptBatchError):
                fn(bad)


@pytest.mark.parametrize("pos", [17, 18, 19])
def test_reserved_bytes_after_magic_must_be_zero(pos: int) -> None:
    # outside the CRC, so only this check notices damage here
    bad = bytes(patch(SMALL, pos, "<B", 1))
    for fn in (read_header, check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(bad)


def test_next_offset_must_fit_in_int64() -> None:
    n = read_header(SMALL).record_count
    last_ok = stamp(2**63 - 1 - n, len(SMALL) - 12, 0) + SMALL[16:]
    assert columns(decode_batch(last_ok))["offset"][-1] == 2**63 - 2
    overflowing = stamp(2**63 - n, len(SMALL) - 12, 0) + SMALL[16:]
    for fn in (read_header, check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(overflowing)


# --- size and length ----------------------------------------------------------------------------


def test_oversized_batch() -> None:
    big = encode_batch([b"x" * 1000], timestamps=1)
    with pytest.raises(BatchTooLargeError) as info:
        check_batch(big, max_size=512)
    assert (info.value.size, info.value.limit) == (len(big), 512)
    assert not info.value.retriable
    assert check_batch(big, max_size=len(big)).size == len(big)
    with pytest.raises(BatchTooLargeError):
        check_batch(big, max_size=len(big) - 1)


def test_length_field_inconsistent_with_buffer() -> None:
    size = len(SMALL)
    with pytest.raises(CorruptBatchError):
        check_batch(SMALL + bytes(8))  # one batch was promised, more bytes came
    assert check_batch(SMALL + bytes(8), exact=False).size == size
    for cut in (8, 1):
        for fn in (check_batch, decode_batch):
            with pytest.raises(CorruptBatchError):
                fn(SMALL[:-cut])
        with pytest.raises(CorruptBatchError):
            check_batch(SMALL[:-cut], exact=False)
    for delta in (-8, 8, 4, -size):
        # batch_length is outside the CRC; a wrong value must still be caught
        bad = bytes(patch(SMALL, 8, "<i", size - 12 + delta)) + bytes(max(delta, 0))
        for fn in (read_header, check_batch, decode_batch):
            with pytest.raises(CorruptBatchError):
                fn(bad)


@pytest.mark.parametrize("cut", [0, 1, 11, 12, 16, 71])
def test_truncated_header(cut: int) -> None:
    for fn in (read_header, check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(SMALL[:cut])


@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_filler_bytes_are_corrupt_not_a_new_version(fill: int) -> None:
    # a zero-filled tail (preallocated file, torn write) has no batch in it, whatever its magic
    for fn in (read_header, check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(bytes([fill]) * 200)


# --- a valid CRC over a malformed batch (a buggy or hostile producer) ----------------------------


def _buffer(batch: bytes, index: int) -> tuple[int, int]:
    pos, length = body_buffers(batch)[index]
    assert length, f"buffer {index} of the test batch is empty"
    return pos, length


def _set_directory(batch: bytes, changes: dict[int, int]) -> bytearray:
    lengths = list(struct.unpack_from("<16I", batch, HEADER_SIZE))
    for slot, length in changes.items():
        lengths[slot] = length
    return patch(batch, HEADER_SIZE, "<16I", *lengths)


def _directory_slot(slot: int, delta: int) -> Callable[[bytes], bytearray]:
    return lambda b: _set_directory(b, {slot: body_buffers(b)[slot][1] + delta})


def _int32_at(index: int, entry: int, value: int) -> Callable[[bytes], bytearray]:
    return lambda b: patch(b, _buffer(b, index)[0] + 4 * entry, "<i", value)


def _byte_at(index: int, value: int) -> Callable[[bytes], bytearray]:
    return lambda b: patch(b, _buffer(b, index)[0], "<B", value)


# buffers: 2 key offsets, 5 value offsets, 7 header list offsets, 8 header key offsets,
# 9 header key data, 12 tag list offsets, 13 tag offsets, 14 tag data
BODY_CONTENT_DAMAGE = {
    "value-offsets-not-monotonic": _int32_at(5, 1, 9),
    "value-offsets-past-data": _int32_at(5, 3, 4096),
    "value-offsets-negative": _int32_at(5, 0, -4),
    "key-offsets-past-data": _int32_at(2, 3, 64),
    "header-list-negative": _int32_at(7, 0, -1),
    "header-list-past-pairs": _int32_at(7, 3, 4),
    "header-list-not-monotonic": _int32_at(7, 1, 3),
    "header-key-offsets-past-data": _int32_at(8, 3, 99),
    "header-key-invalid-utf8": _byte_at(9, 0xFF),
    "tag-list-past-tags": _int32_at(12, 3, 4),
    "tag-list-negative-end": _int32_at(12, 3, -1),
    "tag-offsets-past-data": _int32_at(13, 3, 1000),
    "tag-invalid-utf8": _byte_at(14, 0xC3),
    # lengths that still add up to the body length, so only the decoder can tell
    "key-validity-wrong-size": lambda b: _set_directory(b, {1: 2}),
    "key-offsets-wrong-size": lambda b: _set_directory(b, {2: 12, 3: 4}),
}

DIRECTORY_DAMAGE = {
    "directory-slot-15-nonzero": lambda b: _set_directory(b, {15: 8}),
    "directory-longer-than-body": _directory_slot(6, 8),
    "directory-shorter-than-body": _directory_slot(6, -8),
    "timestamps-not-8-per-record": lambda b: _set_directory(
        b, {0: body_buffers(b)[0][1] - 8, 1: body_buffers(b)[1][1] + 8}
    ),
    "record-count-plus-one": lambda b: patch(b, 28, "<i", read_header(b).record_count + 1),
    "raw-length-differs": lambda b: patch(b, 68, "<i", read_header(b).raw_body_length + 8),
    "first-after-max-timestamp": lambda b: patch(b, 32, "<q", read_header(b).max_timestamp + 1),
    "unknown-attribute-bit": lambda b: patch(b, 24, "<H", 0x08),
    "unknown-compression": lambda b: patch(b, 24, "<H", 4),
    "columnar-body-said-kafka": lambda b: patch(b, 24, "<H", 3),
    "record-count-zero": lambda b: patch(b, 28, "<i", 0),
    "body-length-negative": lambda b: patch(b, 64, "<i", -8),
}


@pytest.mark.parametrize(
    "damage", list(BODY_CONTENT_DAMAGE.values()), ids=list(BODY_CONTENT_DAMAGE)
)
def test_valid_crc_malformed_body(damage: Callable[[bytes], bytearray]) -> None:
    bad = with_crc(damage(SMALL))
    assert bad != SMALL
    with pytest.raises(CorruptBatchError):
        decode_batch(bad)


@pytest.mark.parametrize("damage", list(DIRECTORY_DAMAGE.values()), ids=list(DIRECTORY_DAMAGE))
def test_valid_crc_inconsistent_header_or_directory(damage: Callable[[bytes], bytearray]) -> None:
    bad = with_crc(damage(SMALL))
    for fn in (check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(bad)


def test_nonzero_padding_is_corrupt() -> None:
    for i in range(40):
        batch = encode_batch([b"p" * i], timestamps=1, compression=Compression.ZSTD)
        h = read_header(batch)
        if h.summary_position > HEADER_SIZE + h.body_length:
            break
    else:
        pytest.fail("no test batch with padding")
    bad = with_crc(patch(batch, h.summary_position - 1, "<B", 1))
    for fn in (check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(bad)


# --- compressed bodies ---------------------------------------------------------------------------

COMPRESSED = [Compression.ZSTD, Compression.LZ4]


@pytest.mark.parametrize("compression", COMPRESSED, ids=["zstd", "lz4"])
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_compressed_body_replaced_with_garbage(compression: Compression, fill: int) -> None:
    batch = small_batch(compression)
    h = read_header(batch)
    bad = bytearray(batch)
    bad[HEADER_SIZE : HEADER_SIZE + h.body_length] = bytes([fill]) * h.body_length
    with pytest.raises(CorruptBatchError):
        decode_batch(with_crc(bad))


@pytest.mark.parametrize("compression", COMPRESSED, ids=["zstd", "lz4"])
@pytest.mark.parametrize("delta", [-8, -1, 1, 8, 4096])
def test_compressed_raw_length_wrong(compression: Compression, delta: int) -> None:
    batch = small_batch(compression)
    bad = with_crc(patch(batch, 68, "<i", read_header(batch).raw_body_length + delta))
    with pytest.raises(CorruptBatchError):
        decode_batch(bad)


@pytest.mark.parametrize("compression", COMPRESSED, ids=["zstd", "lz4"])
def test_compressed_raw_length_over_the_decoder_limit(compression: Compression) -> None:
    bad = with_crc(patch(small_batch(compression), 68, "<i", 2**31 - 1))
    for fn in (check_batch, decode_batch):
        with pytest.raises(CorruptBatchError):
            fn(bad)


@pytest.mark.parametrize("compression", COMPRESSED, ids=["zstd", "lz4"])
def test_compressed_body_flipped_with_crc_recomputed(compression: Compression) -> None:
    # codecs without a content checksum cannot catch every flip; what is decoded must be sound
    batch = small_batch(compression)
    h = read_header(batch)
    caught = 0
    for i in range(HEADER_SIZE, HEADER_SIZE + h.body_length):
        bad = bytearray(batch)
        bad[i] ^= 0xFF
        caught += decodes_or_raises_typed(with_crc(bad)) is None
    assert caught > h.body_length // 2


# --- random input: only typed errors escape --------------------------------------------------

GARBAGE_SETTINGS = settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _all_entry_points(buf: bytes) -> None:
    for fn in (read_header, check_batch, decode_batches, decodes_or_raises_typed):
        with contextlib.suppress(StrataError):
            fn(buf)
    with contextlib.suppress(StrataError):
        for _ in iter_batches(buf):
            pass


@GARBAGE_SETTINGS
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_typed_errors(buf: bytes) -> None:
    _all_entry_points(buf)


@GARBAGE_SETTINGS
@given(
    st.sampled_from([SMALL, small_batch(Compression.ZSTD), small_batch(Compression.LZ4)]),
    st.lists(
        st.tuples(st.integers(0, len(SMALL) - 1), st.integers(0, 255)), min_size=1, max_size=6
    ),
    st.booleans(),
)
def test_damaged_batches_raise_only_typed_errors(
    batch: bytes, damage: list[tuple[int, int]], fix_crc: bool
) -> None:
    bad = bytearray(batch)
    for pos, value in damage:
        if pos < len(bad):
            bad[pos] = value
    _all_entry_points(with_crc(bad) if fix_crc else bytes(bad))


@GARBAGE_SETTINGS
@given(
    st.sampled_from([SMALL, small_batch(Compression.LZ4)]),
    st.lists(st.tuples(st.integers(HEADER_SIZE, len(SMALL) - 1), st.integers(-(2**31), 2**31 - 1))),
)
def test_damaged_body_words_raise_only_typed_errors(
    batch: bytes, damage: list[tuple[int, int]]
) -> None:
    # aligned int32 overwrites hit offsets and directory entries, where the parser is busiest
    bad = bytearray(batch)
    h = read_header(batch)
    for pos, value in damage:
        pos &= ~3
        if pos + 4 <= HEADER_SIZE + h.body_length:
            struct.pack_into("<i", bad, pos, value)
    decodes_or_raises_typed(with_crc(bad))


#: batches without headers and tags, whose deep check takes the fast path (few records, many)
FLAT = [
    encode_batch([b"first", None, b"third value"], keys=[b"k1", None, b""], timestamps=1),
    encode_batch([b"v%d" % i for i in range(70)], keys=[b"k"] * 70, timestamps=1),
]


@given(
    st.sampled_from(FLAT),
    st.lists(
        st.tuples(st.integers(HEADER_SIZE, 2000), st.integers(-(2**31), 2**31 - 1)), max_size=4
    ),
)
def test_the_deep_check_of_a_flat_body_agrees_with_arrows_full_validation(
    batch: bytes, damage: list[tuple[int, int]]
) -> None:
    """``check_batch(deep=True)`` skips Arrow for bodies without headers and tags; it must
    refuse exactly what decoding with Arrow's full validation refuses."""
    bad = bytearray(batch)
    h = read_header(batch)
    for pos, value in damage:
        pos = HEADER_SIZE + (pos - HEADER_SIZE) % h.body_length & ~3
        struct.pack_into("<i", bad, pos, value)
    damaged = with_crc(bad)
    try:
        check_batch(damaged, deep=True)
        fast_ok = True
    except StrataError:
        fast_ok = False
    assert fast_ok == (decodes_or_raises_typed(damaged) is not None)


@GARBAGE_SETTINGS
@given(
    st.binary(max_size=300),
    st.binary(max_size=300),
    st.lists(st.integers(1, 64), max_size=20),
)
def test_framer_raises_only_typed_errors(prefix: bytes, garbage: bytes, sizes: list[int]) -> None:
    data = prefix + SMALL + garbage
    framer = BatchFramer(max_batch_size=4096)
    pos = 0
    with contextlib.suppress(StrataError):
        for size in [*sizes, len(data)]:
            framer.feed(data[pos : pos + size])
            pos += size
            while (batch := framer.next_batch()) is not None:
                check_batch(batch)
        framer.close()


def _rebuild(batch: bytes, buffers: dict[int, bytes]) -> bytes:
    """The batch with some body buffers replaced (directory, lengths and CRC recomputed; the
    summary kept as it was)."""
    h = read_header(batch)
    parts = [batch[p : p + n] for p, n in body_buffers(batch)]
    for i, data in buffers.items():
        parts[i] = data
    body = struct.pack("<16I", *[len(p) for p in parts], 0) + b"".join(
        p + bytes(-len(p) % 8) for p in parts
    )
    header = bytearray(batch[:HEADER_SIZE])
    struct.pack_into("<i", header, 8, HEADER_SIZE + len(body) + h.summary_length - 12)
    struct.pack_into("<ii", header, 64, len(body), len(body))
    return with_crc(bytes(header) + body + batch[h.summary_position :])


@pytest.mark.parametrize("count_slot,child_slots", [(7, (8, 10)), (12, (13,))])
def test_a_tiny_batch_cannot_claim_millions_of_header_pairs_or_tags(
    count_slot: int, child_slots: tuple[int, ...]
) -> None:
    """Omitted offsets mean "all empty" only for top-level columns (bounded by the timestamps);
    a child count must be backed by its offsets, or a 200-byte batch could demand gigabytes."""
    batch = encode_batch([b"v"], headers=[[("", b"")]], tags=[[""]], timestamps=1)
    hostile = _rebuild(
        batch,
        {count_slot: struct.pack("<ii", 0, 4_000_000), **{s: b"" for s in child_slots}},
    )
    assert len(hostile) < 512
    check_batch(hostile)  # the O(1) check passes: the CRC and directory are consistent
    with pytest.raises(CorruptBatchError, match="offsets missing"):
        decode_batch(hostile)
    with pytest.raises(CorruptBatchError):
        check_batch(hostile, deep=True)
