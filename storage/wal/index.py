"""The sparse index of a segment: offset -> file position, and timestamp -> file position.

One entry is written for the first batch of a segment and then for the first batch after every
``index.interval.bytes`` of log. An entry holds the batch's offset relative to the segment
base, its byte position, and the largest timestamp of every batch *before* it in the segment.
Both the relative offsets and those running maxima are non-decreasing, so one binary search
answers each of the two questions a reader asks:

* where does offset ``o`` start? the last entry with ``rel <= o - base``; walk headers from it;
* where is the first record with timestamp ``>= t``? the last entry whose running maximum is
  ``< t`` (nothing before it can qualify); walk headers from it.

The index of the active segment lives in memory and is rebuilt from the log on open (the log
is scanned then anyway). When a segment is sealed and its bytes are fsynced, the index is
written next to it as ``<base>.index``::

    entries   n x (uint32 rel_offset, uint32 position, int64 max_timestamp_before)
    trailer   uint32 magic 0x58444953 ("SIDX"), uint32 n, uint32 CRC32C of the entries,
              uint32 size of the .log file the index describes

An index whose trailer does not check out is ignored and rebuilt from the log.
"""

from __future__ import annotations

import bisect
import struct
from array import array

from storage.crc import crc32c

ENTRY = struct.Struct("<IIq")
TRAILER = struct.Struct("<IIII")
INDEX_MAGIC = 0x58444953
NO_TIMESTAMP = -(1 << 63)


class SparseIndex:
    __slots__ = ("_max_ts", "_positions", "_rels", "last_position")

    def __init__(self) -> None:
        self._rels = array("I")
        self._positions = array("I")
        self._max_ts = array("q")
        self.last_position = -1

    def __len__(self) -> int:
        return len(self._rels)

    def add(self, rel_offset: int, position: int, max_ts_before: int) -> None:
        self._rels.append(rel_offset)
        self._positions.append(position)
        self._max_ts.append(max_ts_before)
        self.last_position = position

    def position_for_offset(self, rel_offset: int) -> int:
        """Byte position of an indexed batch at or before ``rel_offset`` (0 if none)."""
        i = bisect.bisect_right(self._rels, rel_offset) - 1
        return self._positions[i] if i >= 0 else 0

    def position_for_timestamp(self, timestamp: int) -> int:
        """Byte position from which to walk to find the first batch with max timestamp >= t."""
        i = bisect.bisect_left(self._max_ts, timestamp) - 1
        return self._positions[i] if i >= 0 else 0

    def truncate_after(self, position: int) -> None:
        """Drop the entries at byte ``position`` and beyond."""
        i = bisect.bisect_left(self._positions, position)
        del self._rels[i:], self._positions[i:], self._max_ts[i:]
        self.last_position = self._positions[-1] if self._positions else -1

    def last_entry(self) -> tuple[int, int]:
        """(rel_offset, position) of the last entry; (0, 0) if empty."""
        if not self._rels:
            return 0, 0
        return self._rels[-1], self._positions[-1]

    def last_max_before(self) -> int:
        """The running maximum timestamp stored with the last entry."""
        return self._max_ts[-1] if self._max_ts else NO_TIMESTAMP

    def to_bytes(self, log_size: int) -> bytes:
        entries = b"".join(
            ENTRY.pack(r, p, t)
            for r, p, t in zip(self._rels, self._positions, self._max_ts, strict=True)
        )
        return entries + TRAILER.pack(INDEX_MAGIC, len(self._rels), crc32c(entries), log_size)

    @classmethod
    def from_bytes(cls, data: bytes, log_size: int) -> SparseIndex | None:
        """The index stored in ``data``, or None if it is damaged or describes another log size."""
        if len(data) < TRAILER.size or (len(data) - TRAILER.size) % ENTRY.size:
            return None
        magic, n, crc, size = TRAILER.unpack_from(data, len(data) - TRAILER.size)
        entries = data[: len(data) - TRAILER.size]
        if magic != INDEX_MAGIC or n * ENTRY.size != len(entries) or size != log_size:
            return None
        if crc32c(entries) != crc:
            return None
        index = cls()
        for r, p, t in ENTRY.iter_unpack(entries):
            if p >= log_size or (len(index) and (r < index._rels[-1] or p <= index.last_position)):
                return None
            index.add(r, p, t)
        return index
