"""A filtered pass over stored batches: what a filtered fetch sends, and how far it looked.

:class:`FilterScan` is sans-IO: the agent feeds it whole batches laid end to end as it reads
them (zero-copy views of a segment's mmap, or of the object tier's cache), from the batch
holding the fetch offset on, and takes out what to send. Each batch is classified from its
summary (``Filter.classify``) without touching its body:

* ``SKIP`` — left out; nothing of it is sent;
* ``WHOLE`` — sent as stored (a view of the same bytes; no copy);
* ``DECODE`` (a mixed batch, or one without a summary) — decoded (CRC checked) and the filter
  evaluated with Arrow kernels; a batch where nothing matches is left out, one where
  everything does is sent whole, and any other is sent whole *with a selection*: a bitmap of
  its records (LSB first, one bit per record) that says which ones match. The batch is never
  re-encoded: its bytes, CRC and offsets stay the producer's, and the consumer applies the
  bitmap after decoding (``selection_mask``).

Control batches are always sent (a read-committed consumer will need them). In a first batch
that starts below the fetch offset, records below it are never selected (a consumer skips
them anyway).

``next_offset`` is the first offset the scan has not looked at: the consumer's position moves
there once it has the records before it, so skipped records are consumed too (lag and
commits see them) and a sparse filter does not fetch the same range again. The scan stops
when what it would send reaches ``max_bytes`` (soft: the first matching batch goes whatever
its size; a later one only if it fits, else it is left for the next fetch) or when it has
looked at ``max_scan_bytes`` of batches (after the batch that crosses it) or at
``max_batches`` batches, which bounds the work of one fetch over a long range that matches
nothing: in bytes read, and in Python work per batch (about 15 us a batch here, so tiny
batches of a linger-0 producer would otherwise cost seconds of the agent's event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from storage.codec import decode_batch, iter_batches
from storage.codec.header import BatchHeader
from storage.codec.summary import of_batch
from storage.errors import CorruptBatchError
from storage.filters.evaluate import Filter, Verdict

#: a filtered pass looks at no more batches than this (see the module docstring)
MAX_SCAN_BATCHES = 2048


@dataclass(frozen=True, slots=True)
class Selection:
    """The matching records of a mixed batch: bit i (LSB first) is record base_offset + i."""

    base_offset: int
    bitmap: bytes


def selection_bitmap(mask: np.ndarray) -> bytes:
    return np.packbits(mask, bitorder="little").tobytes()


def selection_mask(bitmap: Any, n: int) -> np.ndarray:
    """The boolean mask of a selection bitmap over ``n`` records (``CorruptBatchError`` if the
    bitmap does not have ``ceil(n / 8)`` bytes)."""
    raw = np.frombuffer(bitmap, dtype=np.uint8)
    if len(raw) != (n + 7) // 8:
        raise CorruptBatchError(f"a selection of {len(raw)} bytes for a batch of {n} records")
    return np.unpackbits(raw, count=n, bitorder="little").astype(bool)


def classify(filt: Filter, buf: Any, pos: int, h: BatchHeader) -> Verdict:
    """What ``filt`` makes of the batch at ``buf[pos:]`` from its summary alone."""
    return filt.classify(of_batch(buf, pos, h, headers=filt.uses_headers))


def matching(filt: Filter, buf: Any, pos: int, h: BatchHeader) -> pa.RecordBatch | None:
    """The matching records of the batch at ``buf[pos:]`` (decoded only when its summary
    cannot decide; CRC checked), or None when none match."""
    verdict = classify(filt, buf, pos, h)
    if verdict is Verdict.SKIP:
        return None
    rb = decode_batch(buf, pos)
    if verdict is Verdict.WHOLE:
        return rb
    rb = filt.filter(rb)
    return rb if rb.num_rows else None


@dataclass
class FilterScan:
    filter: Filter
    start_offset: int
    max_bytes: int
    max_scan_bytes: int
    max_batches: int = MAX_SCAN_BATCHES
    next_offset: int = field(init=False)
    parts: list[Any] = field(default_factory=list)
    selections: list[Selection] = field(default_factory=list)
    bytes: int = 0  # of the parts
    scanned: int = 0  # bytes of batches looked at
    looked: int = 0  # batches looked at
    full: bool = False  # max_bytes reached: the next batch that matches did not fit
    skipped_batches: int = 0
    whole_batches: int = 0
    decoded_batches: int = 0

    def __post_init__(self) -> None:
        self.next_offset = self.start_offset

    @property
    def done(self) -> bool:
        """Nothing more to do in this fetch: full, or ``max_scan_bytes`` or ``max_batches``
        looked at."""
        return self.full or self.scanned >= self.max_scan_bytes or self.looked >= self.max_batches

    def feed(self, data: Any) -> None:
        """Look at the whole batches in ``data`` (laid end to end, from a batch boundary)
        until done; batches that end at or below ``next_offset`` are passed over."""
        view = memoryview(data)
        for h, pos in iter_batches(view):
            if self.done:
                return
            if h.next_offset <= self.next_offset:
                continue
            self._one(view, pos, h)

    def _one(self, view: memoryview, pos: int, h: BatchHeader) -> None:
        self.scanned += h.size
        self.looked += 1
        bitmap: bytes | None = None
        verdict = Verdict.WHOLE if h.is_control else classify(self.filter, view, pos, h)
        if verdict is Verdict.DECODE:
            self.decoded_batches += 1
            rb = decode_batch(view, pos)
            mask = self.filter.mask(rb)
            if h.base_offset < self.start_offset:
                mask[: self.start_offset - h.base_offset] = False
            if not mask.any():
                verdict = Verdict.SKIP
            elif mask.all():
                verdict = Verdict.WHOLE
            else:
                bitmap = selection_bitmap(mask)
        if verdict is Verdict.SKIP:
            self.skipped_batches += 1
            self.next_offset = h.next_offset
            return
        if self.parts and self.bytes + h.size > self.max_bytes:
            self.full = True
            self.scanned -= h.size  # looked at again by the next fetch
            self.looked -= 1
            return
        self.parts.append(view[pos : pos + h.size])
        self.bytes += h.size
        if bitmap is not None:
            self.selections.append(Selection(h.base_offset, bitmap))
        elif verdict is Verdict.WHOLE:
            self.whole_batches += 1
        self.next_offset = h.next_offset
