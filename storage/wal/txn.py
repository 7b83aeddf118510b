"""A partition's transactions: which are open, the last stable offset, and what was aborted.

A transactional producer writes batches with the ``transactional`` attribute bit into several
partitions; the transaction coordinator then writes one marker (a control batch,
``storage.codec.control``) into each of them: commit or abort. Per partition log this module
keeps, updated by every append (a leader's and a follower's alike) and rebuilt from the
batch headers when the log opens:

* **Open transactions**: per producer id, the offset of its first batch since its last
  marker. A producer has at most one open transaction per partition.
* **The last stable offset (LSO)**: the first offset of the oldest transaction that is not
  *stable* — still open, or completed by a marker the high watermark has not passed yet —
  or the high watermark when there is none. ``read_committed`` consumers read below it, and
  the uploader tiers a segment only once the LSO is past its end (so every transaction with
  data in a tiered segment has its outcome known when the segment's footer is written).
* **Aborted transactions**, one list per segment (Kafka's ``.txnindex``), each entry kept in
  the segment that holds its abort marker: ``(producer id, first offset, marker offset,
  LSO after the marker)``. A ``read_committed`` fetch of ``[start, end)`` gets the entries
  that overlap it (``aborted``): the consumer drops the transactional batches of those
  producers inside those ranges, batch by batch, without looking at records. Entries are
  found from the segment holding ``start`` onwards; the search stops at the first entry whose
  LSO is at or past ``end``: every transaction with data below ``end`` had ended by then.
* **Marker tokens**: per producer, the coordinator epoch of the last marker applied. A
  marker whose token is not newer is a retry or a deposed coordinator's late copy.

Memory: open transactions are bounded by the producers writing (one entry each), completed
transactions waiting for the high watermark by the high watermark's lag, aborted entries by
the aborts in the local log (32 bytes each; they go with their segment). Pure bookkeeping: no
I/O; ``storage.wal.log`` feeds it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from storage.codec.control import ControlMarker
from storage.codec.header import BatchHeader


@dataclass(frozen=True, slots=True)
class AbortedTxn:
    producer_id: int
    first_offset: int
    #: the abort marker's offset: the transaction's batches lie in [first_offset, last_offset)
    last_offset: int
    #: the LSO right after the marker (the search for aborted transactions stops at it)
    last_stable_offset: int


class TransactionIndex:
    """Open, completing and aborted transactions of one partition log (module docstring)."""

    __slots__ = ("_aborted", "_bases", "_completing", "ongoing", "tokens")

    def __init__(self) -> None:
        #: producer id -> first offset of its open transaction
        self.ongoing: dict[int, int] = {}
        #: (marker offset, first offset) of completed transactions, in marker order, until the
        #: high watermark passes their marker
        self._completing: deque[tuple[int, int]] = deque()
        #: segment base -> aborted transactions whose marker is in that segment
        self._aborted: dict[int, list[AbortedTxn]] = {}
        self._bases: list[int] = []
        #: producer id -> coordinator epoch of the last marker applied
        self.tokens: dict[int, int] = {}

    # ---- updates --------------------------------------------------------------------------
    def segment_started(self, base: int) -> None:
        """A segment starting at ``base`` exists (appends land in the last one)."""
        if not self._bases or self._bases[-1] < base:
            self._bases.append(base)
            self._aborted[base] = []

    def append(self, h: BatchHeader, marker: ControlMarker | None) -> AbortedTxn | None:
        """Account for a stored batch (``h`` with its offsets; ``marker`` for a control
        batch). Returns the aborted entry an abort marker created."""
        pid = h.producer_id
        if marker is not None:
            self.tokens[pid] = max(marker.coordinator_epoch, self.tokens.get(pid, -1))
            first = self.ongoing.pop(pid, None)
            if first is None:
                return None  # nothing open here: a fencing marker, or a late duplicate
            self._completing.append((h.base_offset, first))
            if marker.commit:
                return None
            lso = min(self.ongoing.values(), default=h.next_offset)
            entry = AbortedTxn(pid, first, h.base_offset, lso)
            self._aborted[self._bases[-1]].append(entry)
            return entry
        if h.is_transactional and pid >= 0 and pid not in self.ongoing:
            self.ongoing[pid] = h.base_offset
        return None

    # ---- questions --------------------------------------------------------------------------
    def forget_stable(self, high_watermark: int) -> None:
        """Forget the completed transactions whose marker is below ``high_watermark`` (a
        follower calls it as its high watermark moves; a leader's LSO question does it)."""
        completing = self._completing
        while completing and completing[0][0] < high_watermark:
            completing.popleft()

    def last_stable_offset(self, high_watermark: int) -> int:
        """The first offset not known stable: below it every transaction has ended and its
        marker is below ``high_watermark`` (forgets completions that became stable)."""
        self.forget_stable(high_watermark)
        completing = self._completing
        lso = high_watermark
        if self.ongoing:
            lso = min(lso, min(self.ongoing.values()))
        for _, first in completing:
            lso = min(lso, first)
        return lso

    def open_since(self, producer_id: int) -> int | None:
        return self.ongoing.get(producer_id)

    def aborted(self, start: int, end: int) -> list[AbortedTxn]:
        """Aborted transactions with batches in ``[start, end)`` (``end`` at most the LSO)."""
        out: list[AbortedTxn] = []
        bases = self._bases
        i = max(bisect.bisect_right(bases, start) - 1, 0)
        for base in bases[i:]:
            for e in self._aborted[base]:
                if e.last_offset >= start and e.first_offset < end:
                    out.append(e)
                if e.last_stable_offset >= end:
                    return out
        return out

    def aborted_in_segment(self, base: int) -> list[AbortedTxn]:
        return list(self._aborted.get(base, ()))

    # ---- segments going away ----------------------------------------------------------------
    def drop_segments(self, bases: Iterable[int]) -> None:
        gone = set(bases)
        if not gone:
            return
        for b in gone:
            self._aborted.pop(b, None)
        self._bases = [b for b in self._bases if b not in gone]
