"""Segment objects in the object tier: their keys and their footer. Pure: bytes in, values out.

A sealed segment is uploaded as one object::

    data      the segment's record batches, byte for byte as in the local ``.log`` file
    index     n x ENTRY (uint32 rel_offset, uint32 position, int64 max_timestamp_before)
    aborted   version 2 only: m x ABORTED (int64 producer_id, int64 first, int64 end)
    trailer   TRAILER, 88 bytes, always last

``index`` has the WAL's sparse-index semantics (``storage.wal.index``): one entry for the
first batch and then one for the first batch after every ``interval`` bytes of data; an
entry's ``max_timestamp_before`` is the largest timestamp of every batch before it. So one
binary search finds where offset ``o`` starts and another where the first record with
timestamp >= ``t`` can start; a reader then range-reads ``data`` from that position.

``aborted`` (footer version 2; a segment without aborted transactions is written as version
1, byte for byte as before transactions existed) lists the aborted transactions with batches
in the segment: their producer id and the range ``[first, end)`` of their offsets *inside
this segment* (clipped to it; ``end`` is the abort marker's offset when the marker is here). A segment is uploaded only once every transaction with data in
it has ended (the partition's last stable offset is past its end), so the list is final and
a reader of this one object — replay, Spark, the agent serving an old offset — drops the
aborted batches (transactional batches of a listed producer inside a listed range) without
looking anywhere else. Control batches (markers) are recognised by their header bit.

A reader that knows ``data_length`` (the manifest says it) fetches index + trailer with one
ranged GET (``bytes=data_length-``); one that knows nothing fetches the last 88 bytes
(``bytes=-88``), then the index. The trailer::

    offset size field
         0    4 magic b"STSG"
         4    2 version (1; 2 with an aborted list)
         6    2 reserved, zero
         8    8 base_offset       first offset in the segment
        16    8 next_offset       last offset + 1
        24    4 leader_epoch      largest leader epoch stamped on a batch of the segment
        28    4 batch_count
        32    8 record_count
        40    8 data_length       bytes of record batches (the index starts here)
        48    8 first_timestamp   first timestamp of the first batch
        56    8 max_timestamp     largest record timestamp of the segment
        64    4 index_count       entries in the index
        68    4 index_interval    bytes of data between index entries (at least)
        72    4 data_crc          CRC32C of data
        76    4 index_crc         CRC32C of the index (version 2: of index + aborted list)
        80    4 aborted_count     version 2: entries in the aborted list; version 1: zero
        84    4 trailer_crc       CRC32C of trailer bytes [0, 84)

All integers little-endian. Every batch keeps its own CRC32C (``docs/format.md``), so a range
read is verified batch by batch; ``data_crc`` covers a whole-object read (Spark, audits).

Keys are deterministic, so a retried upload of the same segment lands on the same key and a
create-only put (``If-None-Match: *``) can tell "already there" from "someone else's"::

    <prefix>topics/<topic>/<topic_id>/<partition>/<base:020d>-<last:020d>-<epoch:010d>.seg

``epoch`` is the trailer's ``leader_epoch`` (a property of the bytes, not of the uploader), so
a new leader re-uploading a segment it inherited produces the same key. ``topic_id`` keeps a
deleted-and-recreated topic from meeting its predecessor's objects.
"""

from __future__ import annotations

import bisect
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from storage.codec import iter_batches
from storage.crc import crc32c
from storage.errors import CorruptSegmentError, StrataError

ENTRY = struct.Struct("<IIq")
ABORTED = struct.Struct("<qqq")
TRAILER = struct.Struct("<4sHHqqiIqqqqIIIIII")
TRAILER_SIZE = TRAILER.size  # 88
MAGIC = b"STSG"
VERSION = 1
#: the footer version with an aborted-transaction list
VERSION_ABORTED = 2
#: at most this many aborted transactions are listed per segment object
MAX_ABORTED = 1 << 20
DEFAULT_INDEX_INTERVAL = 64 * 1024
NO_TIMESTAMP = -(1 << 63)
_CRC_COVERED = TRAILER_SIZE - 4

assert TRAILER_SIZE == 88


@dataclass(frozen=True, slots=True)
class Footer:
    base_offset: int
    next_offset: int
    leader_epoch: int
    batch_count: int
    record_count: int
    data_length: int
    first_timestamp: int
    max_timestamp: int
    index_interval: int
    data_crc: int
    rels: array[int]
    positions: array[int]
    max_ts_before: array[int]
    #: aborted transactions with batches here: (producer id, first offset, end offset), the
    #: range half-open and clipped to the segment, sorted
    aborted: tuple[tuple[int, int, int], ...] = ()

    @property
    def last_offset(self) -> int:
        return self.next_offset - 1

    @property
    def footer_length(self) -> int:
        return len(self.rels) * ENTRY.size + len(self.aborted) * ABORTED.size + TRAILER_SIZE

    def position_for_offset(self, offset: int) -> int:
        """Byte position (in data) of an indexed batch at or before ``offset``."""
        i = bisect.bisect_right(self.rels, offset - self.base_offset) - 1
        return self.positions[i] if i >= 0 else 0

    def position_for_timestamp(self, timestamp: int) -> int:
        """Position from which the first batch with max timestamp >= ``timestamp`` is found."""
        i = bisect.bisect_left(self.max_ts_before, timestamp) - 1
        return self.positions[i] if i >= 0 else 0

    def next_indexed_position(self, position: int) -> int:
        """The first indexed position after ``position`` (``data_length`` if none)."""
        i = bisect.bisect_right(self.positions, position)
        return self.positions[i] if i < len(self.positions) else self.data_length


def build_footer(
    data: Any,
    *,
    interval: int = DEFAULT_INDEX_INTERVAL,
    data_crc: int | None = None,
    aborted: Sequence[tuple[int, int, int]] = (),
) -> bytes:
    """The footer (index + aborted list + trailer) for ``data``, a segment's batches end to end.

    ``aborted``: (producer id, first offset, end offset — the abort marker's) of the aborted
    transactions; those with batches in the segment are clipped to it, sorted, and make the
    footer version 2. Walks the batch
    headers once (no per-record work). Raises ``CorruptBatchError`` if ``data`` is not whole
    batches with contiguous offsets.
    """
    from storage.errors import CorruptBatchError

    entries = bytearray()
    count = 0
    records = 0
    base = next_offset = -1
    epoch = -1
    first_ts = NO_TIMESTAMP
    max_ts = NO_TIMESTAMP
    last_indexed = -1
    size = len(data)
    for h, pos in iter_batches(data):
        if base < 0:
            base = next_offset = h.base_offset
            first_ts = h.first_timestamp
        if h.base_offset != next_offset:
            raise CorruptBatchError(
                f"batch at offset {h.base_offset} where {next_offset} was expected", position=pos
            )
        if last_indexed < 0 or pos - last_indexed >= interval:
            entries += ENTRY.pack(h.base_offset - base, pos, max_ts)
            last_indexed = pos
        count += 1
        records += h.record_count
        epoch = max(epoch, h.leader_epoch)
        max_ts = max(max_ts, h.max_timestamp)
        next_offset = h.next_offset
    if count == 0:
        raise CorruptBatchError("a segment object needs at least one batch")
    clipped = sorted(
        (pid, max(first, base), min(end, next_offset))
        for pid, first, end in aborted
        if max(first, base) < min(end, next_offset)
    )
    if len(clipped) > MAX_ABORTED:
        raise CorruptBatchError(f"{len(clipped)} aborted transactions in one segment")
    index = bytes(entries) + b"".join(ABORTED.pack(*e) for e in clipped)
    head = TRAILER.pack(
        MAGIC,
        VERSION_ABORTED if clipped else VERSION,
        0,
        base,
        next_offset,
        epoch,
        count,
        records,
        size,
        first_ts,
        max_ts,
        len(entries) // ENTRY.size,
        interval,
        crc32c(data) if data_crc is None else data_crc,
        crc32c(index),
        len(clipped),
        0,
    )[:_CRC_COVERED]
    return index + head + struct.pack("<I", crc32c(head))


def decode_trailer(buf: Any, *, where: str = "segment object") -> tuple[int, int, int]:
    """(data_length, index_count, bytes between the data and the trailer) from the last 88
    bytes of an object (the index, and in version 2 the aborted list)."""
    t = _unpack_trailer(buf, where)
    return t[8], t[11], t[11] * ENTRY.size + t[15] * ABORTED.size


def _unpack_trailer(buf: Any, where: str) -> tuple[Any, ...]:
    view = memoryview(buf)
    if view.nbytes < TRAILER_SIZE:
        raise CorruptSegmentError(f"footer of {view.nbytes} bytes is too short", path=where)
    raw = view[view.nbytes - TRAILER_SIZE :]
    try:
        t = TRAILER.unpack(raw)
    except struct.error as exc:  # pragma: no cover - the size is checked above
        raise CorruptSegmentError(f"unreadable trailer: {exc}", path=where) from None
    if t[0] != MAGIC:
        raise CorruptSegmentError(f"bad trailer magic {t[0]!r}", path=where)
    if crc32c(raw[:_CRC_COVERED]) != t[-1]:
        raise CorruptSegmentError("trailer CRC mismatch", path=where)
    if t[1] not in (VERSION, VERSION_ABORTED):
        raise CorruptSegmentError(f"unknown segment object version {t[1]}", path=where)
    if (
        t[3] < 0
        or t[4] <= t[3]
        or t[8] <= 0
        or t[6] <= 0
        or (t[1] == VERSION and t[15] != 0)
        or (t[1] == VERSION_ABORTED and not 0 < t[15] <= MAX_ABORTED)
    ):
        raise CorruptSegmentError("impossible trailer fields", path=where)
    return t


def decode_footer(buf: Any, *, where: str = "segment object") -> Footer:
    """Decode index + trailer given as the tail of an object (extra bytes before are ignored).

    Raises ``CorruptSegmentError`` for anything torn or damaged; never ``struct.error``.
    """
    view = memoryview(buf)
    t = _unpack_trailer(view, where)
    n = t[11]
    index_length = n * ENTRY.size
    body_length = index_length + t[15] * ABORTED.size
    if n == 0 or view.nbytes < body_length + TRAILER_SIZE:
        raise CorruptSegmentError(
            f"footer needs {body_length + TRAILER_SIZE} bytes, got {view.nbytes}", path=where
        )
    start = view.nbytes - TRAILER_SIZE - body_length
    if crc32c(view[start : start + body_length]) != t[14]:
        raise CorruptSegmentError("index CRC mismatch", path=where)
    index = view[start : start + index_length]
    aborted = tuple(ABORTED.iter_unpack(view[start + index_length : start + body_length]))
    if any(
        e[0] < 0 or not t[3] <= e[1] < e[2] <= t[4] or (i and e < aborted[i - 1])
        for i, e in enumerate(aborted)
    ):
        raise CorruptSegmentError("aborted transactions outside the segment", path=where)
    rels, positions, max_ts = array("I"), array("I"), array("q")
    for rel, pos, ts in ENTRY.iter_unpack(index):
        rels.append(rel)
        positions.append(pos)
        max_ts.append(ts)
    if positions[0] != 0 or any(
        positions[i] <= positions[i - 1] or rels[i] < rels[i - 1] for i in range(1, n)
    ):
        raise CorruptSegmentError("index entries out of order", path=where)
    if positions[-1] >= t[8] or rels[-1] >= t[4] - t[3]:
        raise CorruptSegmentError("index entry beyond the data", path=where)
    return Footer(
        base_offset=t[3],
        next_offset=t[4],
        leader_epoch=t[5],
        batch_count=t[6],
        record_count=t[7],
        data_length=t[8],
        first_timestamp=t[9],
        max_timestamp=t[10],
        index_interval=t[12],
        data_crc=t[13],
        rels=rels,
        positions=positions,
        max_ts_before=max_ts,
        aborted=aborted,
    )


def topic_prefix(topic: str, topic_id: str, prefix: str = "") -> str:
    """Every segment object of one incarnation of a topic lives under this prefix."""
    return f"{prefix}topics/{topic}/{topic_id}/"


def segment_prefix(topic: str, topic_id: str, partition: int, prefix: str = "") -> str:
    return f"{topic_prefix(topic, topic_id, prefix)}{partition}/"


def segment_key(
    topic: str,
    topic_id: str,
    partition: int,
    base_offset: int,
    next_offset: int,
    leader_epoch: int,
    prefix: str = "",
) -> str:
    return (
        segment_prefix(topic, topic_id, partition, prefix)
        + f"{base_offset:020d}-{next_offset - 1:020d}-{leader_epoch:010d}.seg"
    )


def parse_key(key: str) -> tuple[int, int, int] | None:
    """(base_offset, next_offset, leader_epoch) of a segment key; None for anything else."""
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(".seg"):
        return None
    parts = name[:-4].split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) + 1, int(parts[2])


def walk_whole_batches(buf: Any, pos: int, end: int) -> Iterator[tuple[Any, int]]:
    """Whole batches in ``buf[pos:end]``; stops (without error) at a batch cut by ``end``."""
    try:
        for h, p in iter_batches(buf, pos, len(buf)):
            if p + h.size > end:
                return
            yield h, p
    except StrataError:
        return
