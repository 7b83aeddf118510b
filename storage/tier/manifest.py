"""The segment manifest of a partition: which uploaded segments exist for readers.

It lives in ZooKeeper at ``/topics/<t>/partitions/<p>/segments`` as compact JSON::

    {"v": 1, "epoch": 7, "start": 1200, "end": 5400,
     "segs": [[base, next, epoch, size, data_length, max_timestamp(, aborted)], ...]}

* ``segs`` are contiguous and ascending: ``segs[0][0] == start`` (when non-empty),
  ``segs[i][1] == segs[i+1][0]``, ``segs[-1][1] == end``. ``start`` is the partition's log
  start offset (retention moves it up); ``end`` is where the next committed segment starts.
* ``epoch`` is the largest leader epoch that has written the manifest. A leader commits only
  with the epoch it leads with, only if that epoch is >= ``epoch``, and only in a ZooKeeper
  transaction that also checks the version of the partition's state znode it read (which
  names it leader with that epoch) and the manifest's own version (compare-and-set). A deposed
  leader therefore cannot commit, and two commits of the same segment cannot both succeed.
* ``aborted`` (present only when non-zero) counts the aborted transactions the segment
  object's footer lists (``storage.tier.layout``): readers fetch that footer only then.
* Entries are ~60 bytes, so ZooKeeper's 1 MB znode limit allows ~15,000 segments; a commit
  that would make the manifest larger than ``MAX_MANIFEST_BYTES`` is refused (uploads stall,
  producers get backpressure) — retention and larger segments keep it far below that.

Only committed segments exist for readers: an object in the bucket that is not in the
manifest is an orphan (an upload whose commit never happened, or an expired segment whose
delete failed) and the reconciler removes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from storage.errors import CorruptSegmentError, StorageError
from storage.tier.layout import Footer, segment_key

MAX_MANIFEST_BYTES = 900_000


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    base_offset: int
    next_offset: int
    leader_epoch: int
    size: int  # object size (data + footer)
    data_length: int
    max_timestamp: int
    aborted: int = 0  # aborted transactions listed in the object's footer

    @classmethod
    def of(cls, footer: Footer) -> SegmentEntry:
        """The manifest entry of the segment object this footer ends."""
        return cls(
            footer.base_offset,
            footer.next_offset,
            footer.leader_epoch,
            footer.data_length + footer.footer_length,
            footer.data_length,
            footer.max_timestamp,
            len(footer.aborted),
        )

    def as_list(self) -> list[int]:
        out = [
            self.base_offset,
            self.next_offset,
            self.leader_epoch,
            self.size,
            self.data_length,
            self.max_timestamp,
        ]
        if self.aborted:
            out.append(self.aborted)
        return out

    def key(self, topic: str, topic_id: str, partition: int, prefix: str = "") -> str:
        return segment_key(
            topic,
            topic_id,
            partition,
            self.base_offset,
            self.next_offset,
            self.leader_epoch,
            prefix,
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    epoch: int = -1
    start: int = 0
    end: int = 0
    segments: tuple[SegmentEntry, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def find(self, offset: int) -> SegmentEntry | None:
        """The committed segment holding ``offset`` (None outside ``[start, end)``)."""
        segs = self.segments
        lo, hi = 0, len(segs)
        while lo < hi:
            mid = (lo + hi) // 2
            if segs[mid].next_offset <= offset:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(segs) and segs[lo].base_offset <= offset:
            return segs[lo]
        return None

    def appended(self, entry: SegmentEntry, epoch: int) -> Manifest:
        if entry.base_offset != self.end and self.segments:
            raise StorageError(
                f"segment at {entry.base_offset} does not continue the manifest (end {self.end})"
            )
        start = self.start if self.segments else entry.base_offset
        return Manifest(max(self.epoch, epoch), start, entry.next_offset, (*self.segments, entry))

    def trimmed(self, count: int, epoch: int) -> Manifest:
        """Without the first ``count`` segments; the log start moves to the next one."""
        rest = self.segments[count:]
        start = rest[0].base_offset if rest else self.end
        return Manifest(max(self.epoch, epoch), start, self.end, rest)

    def encode(self) -> bytes:
        data = json.dumps(
            {
                "v": 1,
                "epoch": self.epoch,
                "start": self.start,
                "end": self.end,
                "segs": [s.as_list() for s in self.segments],
            },
            separators=(",", ":"),
        ).encode()
        if len(data) > MAX_MANIFEST_BYTES:
            raise StorageError(
                f"manifest of {len(data)} bytes would exceed {MAX_MANIFEST_BYTES} "
                f"({len(self.segments)} segments): raise segment.bytes or shorten retention"
            )
        return data

    @classmethod
    def decode(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        try:
            raw: Any = json.loads(data)
            if raw.get("v") != 1:
                raise ValueError(f"unknown manifest version {raw.get('v')!r}")
            if any(len(s) not in (6, 7) for s in raw["segs"]):
                raise ValueError("a segment entry has 6 or 7 fields")
            segs = tuple(SegmentEntry(*(int(x) for x in s)) for s in raw["segs"])
            m = cls(int(raw["epoch"]), int(raw["start"]), int(raw["end"]), segs)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptSegmentError(f"unreadable manifest: {exc}", path=where) from None
        prev = m.start
        for s in segs:
            if s.base_offset != prev or s.next_offset <= s.base_offset:
                raise CorruptSegmentError("manifest segments are not contiguous", path=where)
            prev = s.next_offset
        if segs and prev != m.end:
            raise CorruptSegmentError("manifest end does not match its last segment", path=where)
        return m
