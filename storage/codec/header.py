"""The record-batch header: 72 bytes, little-endian, in front of every batch.

A batch is the unit a producer encodes once and every later stage (leader WAL, follower,
object tier, consumer, Spark) stores or ships as the same bytes. Layout (format versions 1
and 2; they differ only in the summary)::

    offset size field              notes
    0      8    base_offset        int64, stamped by the partition leader   } outside the CRC:
    8      4    batch_length       int32, bytes after this field            } rewritten without
    12     4    leader_epoch       int32, stamped by the partition leader   } re-encoding
    16     1    magic              uint8, format version: 1 or 2
    17     3    reserved           zero
    20     4    crc                uint32, CRC32C of bytes [24, end of batch)
    24     2    attributes         uint16: bits 0-2 compression (0 none, 1 zstd, 2 lz4;
                                   3: the body is a Kafka batch, ``kafka_body``), bit 4
                                   transactional, bit 5 control; other bits zero
    26     2    summary_length     uint16: bytes of the summary (version 2: >= 8, a multiple
                                   of 8; version 1: reserved, zero)
    28     4    record_count       int32 > 0; records take offsets base_offset + [0, count)
    32     8    first_timestamp    int64, ms since the epoch
    40     8    max_timestamp      int64, ms since the epoch
    48     8    producer_id        int64, -1 without an idempotent producer
    56     2    producer_epoch     int16, -1 without
    58     2    reserved           zero
    60     4    base_sequence      int32, -1 without
    64     4    body_length        int32, stored body bytes (compressed size if compressed)
    68     4    raw_body_length    int32, body bytes after decompression
    72     -    body               see :mod:`storage.codec.body`
    72+body_length  0..7  padding  zero, up to a multiple of 8
    then   summary_length  summary version 2 only: the batch's tags and headers in brief,
                                   never compressed (see :mod:`storage.codec.summary`)

The whole batch is a multiple of 8 bytes long: ``padded(72 + body_length) + summary_length``.
The summary lets a reader that filters by tag or header (the agent serving a filtered fetch)
skip a batch, or take it whole, without decompressing or decoding the body; a version 1
batch (written before summaries existed, or by an encoder told not to) has none and is
decoded to be filtered. Readers accept both versions.

Batches are laid end to end in segment files and objects; because every batch length is a
multiple of 8 and segments start page-aligned, every batch (and every buffer inside an
uncompressed body) is 8-byte aligned in memory, so Arrow arrays can point straight into an
mmap of the file.

The functions here are pure: bytes in, values out. A header that cannot be parsed raises
:class:`~storage.errors.CorruptBatchError` (or ``UnsupportedVersionError``), never
``struct.error``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from storage.errors import CorruptBatchError, UnsupportedVersionError

#: the format version an encoder writes (with a summary); ``MAGIC_V1`` batches have none
MAGIC = 2
MAGIC_V1 = 1
MAGICS = frozenset({MAGIC_V1, MAGIC})
HEADER_SIZE = 72
ALIGNMENT = 8
#: bytes of the header covered by the CRC start here
CRC_START = 24
#: smallest possible batch: a header and an empty body directory is still 72 + 64
MIN_BATCH_SIZE = HEADER_SIZE
#: a version 2 batch's summary is at least its fixed part (``storage.codec.summary``)
MIN_SUMMARY = 8
#: hard ceiling regardless of configuration (positions in a segment are 32-bit)
MAX_BATCH_SIZE = 1 << 30

#                      base  len  epoch magic res crc  attrs summ count first max  pid  pep res seq  blen rawlen
HEADER = struct.Struct(
    "<q    i    i     B     3x  I    H     H    i     q     q    q    h   2x  i    i    i".replace(
        " ", ""
    )
)
assert HEADER.size == HEADER_SIZE
CRC_OFFSET = 20
CRC_FIELD = struct.Struct("<I")
#: the part a leader rewrites when it stamps a batch: base_offset, batch_length, leader_epoch
STAMP = struct.Struct("<qii")
_LENGTH_OFFSET = 8
_RESERVED_AFTER_MAGIC = struct.Struct("<3s")
_MAX_INT64 = (1 << 63) - 1


class Compression(enum.IntEnum):
    """How the body is stored: the columnar body plain or compressed as one block, or (3)
    a Kafka v2 record batch kept as its producer sent it (``storage.codec.kafka_body``)."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2
    KAFKA = 3


#: what ``encode_batch`` can write (a Kafka body is only ever kept, never encoded)
ENCODINGS = (Compression.NONE, Compression.ZSTD, Compression.LZ4)
#: a Kafka body holds at least a Kafka batch header
_MIN_KAFKA_BODY = 61


ATTR_COMPRESSION_MASK = 0x07
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
_ATTR_KNOWN = ATTR_COMPRESSION_MASK | ATTR_TRANSACTIONAL | ATTR_CONTROL


#: idempotent producers' sequence numbers count records per partition modulo 2**31
SEQUENCE_MASK = 0x7FFFFFFF
#: a partition leader recognises retries of a producer's last this many batches, so a
#: producer keeps at most this many batches of a partition in flight
DEDUP_WINDOW = 5


def padded(n: int) -> int:
    """``n`` rounded up to the batch alignment."""
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


@dataclass(frozen=True, slots=True)
class BatchHeader:
    base_offset: int
    batch_length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    summary_length: int
    record_count: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    body_length: int
    raw_body_length: int

    @property
    def size(self) -> int:
        """Total bytes of the batch, header and padding included."""
        return self.batch_length + 12

    @property
    def summary_position(self) -> int:
        """Where the summary starts, from the start of the batch (the end of the padded body)."""
        return padded(HEADER_SIZE + self.body_length)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.record_count - 1

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count

    @property
    def compression(self) -> Compression:
        return Compression(self.attributes & ATTR_COMPRESSION_MASK)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)


_unpack_from = HEADER.unpack_from


def read_header(buf: Any, pos: int = 0) -> BatchHeader:
    """Parse and sanity-check the header at ``buf[pos:]`` (no CRC check: see ``check_batch``).

    Raises ``CorruptBatchError`` if fewer than 72 bytes remain or a field is impossible, and
    ``UnsupportedVersionError`` for an unknown magic.
    """
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptBatchError(
            f"truncated batch header: {len(buf) - pos} of {HEADER_SIZE} bytes", position=pos
        )
    fields = _unpack_from(buf, pos)
    h = BatchHeader(*fields)
    size = h.batch_length + 12
    if size < HEADER_SIZE or size % ALIGNMENT:
        # framing first (as BatchFramer does): a zero-filled or torn tail is corrupt, not a new version
        raise CorruptBatchError(f"batch length field says {size} bytes", position=pos)
    if h.magic not in MAGICS:
        raise UnsupportedVersionError(f"unknown record batch magic {h.magic} at byte {pos}")
    if h.magic == MAGIC:
        bad_summary = h.summary_length < MIN_SUMMARY or h.summary_length % ALIGNMENT
    else:
        bad_summary = h.summary_length != 0  # reserved in version 1
    if (
        bad_summary
        or size > MAX_BATCH_SIZE
        or _RESERVED_AFTER_MAGIC.unpack_from(buf, pos + 17)[0] != b"\0\0\0"  # outside the CRC
        or h.body_length < 0
        or h.raw_body_length < 0
        or padded(HEADER_SIZE + h.body_length) + h.summary_length != size
        or h.record_count <= 0
        or h.attributes & ~_ATTR_KNOWN
        or (h.attributes & ATTR_COMPRESSION_MASK) > Compression.KAFKA
        or (
            h.attributes & ATTR_COMPRESSION_MASK == Compression.KAFKA
            and (
                h.magic != MAGIC
                or h.attributes & ATTR_CONTROL
                or h.raw_body_length != h.body_length
                or h.body_length < _MIN_KAFKA_BODY
            )
        )
        or h.max_timestamp < h.first_timestamp
        or h.base_offset < 0
        or h.base_offset > _MAX_INT64 - h.record_count  # next_offset must fit an int64
    ):
        raise CorruptBatchError(f"impossible record batch header {h}", position=pos)
    return h


def peek_size(buf: Any, pos: int = 0) -> int | None:
    """The total size the batch at ``pos`` claims, or None if its length field is not complete yet."""
    if len(buf) - pos < 12:
        return None
    return int.from_bytes(buf[pos + _LENGTH_OFFSET : pos + 12], "little", signed=True) + 12


def stamp(base_offset: int, batch_length: int, leader_epoch: int) -> bytes:
    """The first 16 bytes of a batch as a leader rewrites them (outside the CRC)."""
    return STAMP.pack(base_offset, batch_length, leader_epoch)
