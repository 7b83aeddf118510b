"""One segment file of a partition's log: batches laid end to end, plus its sparse index.

A segment is named by the offset of its first record, ``<base:020d>.log``. Batches are
appended with ``pwritev`` (the leader's 16 stamped bytes, then the producer's bytes as they
came), and read back as ``memoryview`` slices of a read-only ``mmap`` of the file: a reader
gets the stored bytes without a copy. The map is widened lazily when a read reaches past it.

Only the partition log (``storage.wal.log``) changes a segment; the rest of the process
reads it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage.codec.batch import check_batch
from storage.codec.header import HEADER_SIZE, MAGIC, MAGIC_V1, BatchHeader, read_header
from storage.errors import CorruptBatchError, CorruptSegmentError, StorageError, StrataError
from storage.wal import fileio
from storage.wal.fileio import storage_error, storage_errors
from storage.wal.index import NO_TIMESTAMP, SparseIndex

#: the header fields a read's walk needs (``storage.codec.header``): base offset and batch
#: length at byte 0, record count at byte 28
_BASE_AND_LENGTH = struct.Struct("<qi")
_RECORD_COUNT = struct.Struct("<i")

#: a read this short past the mapped part of the file is a ``pread``, not a new mapping
TAIL_READ_BYTES = 256 << 10
#: bytes of batch headers read at once past a segment file's mapping (``_HeaderReader``)
HEADER_CHUNK = 16 << 10

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
QUARANTINE_SUFFIX = ".quarantined"


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a verifying scan of a segment found."""

    valid_size: int
    next_offset: int
    max_timestamp: int
    index: SparseIndex
    error: StrataError | None
    valid_batch_after_error: bool


class Segment:
    __slots__ = (
        "_bytes_since_index",
        "_last",
        "_map",
        "base_offset",
        "created_at",
        "deleted",
        "directory",
        "dirty",
        "fd",
        "index",
        "index_interval",
        "max_timestamp",
        "next_offset",
        "pins",
        "sealed",
        "size",
    )

    def __init__(self, directory: Path, base_offset: int, fd: int, index_interval: int) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.fd = fd
        self.index_interval = index_interval
        self.size = 0
        self.next_offset = base_offset
        self.max_timestamp = NO_TIMESTAMP
        self.index = SparseIndex()
        self.sealed = False
        #: bytes appended since the last fsync (or, for a sealed segment, index not yet written)
        self.dirty = False
        self._map: mmap.mmap | None = None
        #: the last batch appended (or found by ``scan``) and its position: where a reader at
        #: the log end asks next, answered without a walk or a new mapping
        self._last: tuple[BatchHeader, int] | None = None
        self._bytes_since_index = 0
        #: wall-clock seconds when this segment started taking appends (for segment.ms)
        self.created_at = 0.0
        #: flush jobs (running in another thread) that still use ``fd``; see ``delete``
        self.pins = 0
        self.deleted = False

    # ---- paths -------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.directory / (segment_name(self.base_offset) + LOG_SUFFIX)

    @property
    def index_path(self) -> Path:
        return self.directory / (segment_name(self.base_offset) + INDEX_SUFFIX)

    # ---- lifecycle ---------------------------------------------------------------------
    @classmethod
    def create(cls, directory: Path, base_offset: int, index_interval: int) -> Segment:
        path = directory / (segment_name(base_offset) + LOG_SUFFIX)
        with storage_errors(f"cannot create segment {path}"):
            fd = fileio.fs.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        # not dirty: an empty file has no bytes to fsync; its name (and so the empty file) is
        # durable with its directory's fsync, which the log owes for it (``_dir_dirty``)
        return cls(directory, base_offset, fd, index_interval)

    @classmethod
    def open_existing(cls, path: Path, index_interval: int) -> Segment:
        base = int(path.name[: -len(LOG_SUFFIX)])
        with storage_errors(f"cannot open segment {path}"):
            fd = fileio.fs.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
        seg = cls(path.parent, base, fd, index_interval)
        seg.size = size
        return seg

    def close(self) -> None:
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def delete(self) -> None:
        """Remove the files. A flush job still holding the fd keeps it open until ``unpin``."""
        self.deleted = True
        for p in (self.path, self.index_path):
            with storage_errors(f"cannot delete {p}"):
                fileio.fs.unlink(p, missing_ok=True)
        if not self.pins:
            self.close()

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if not self.pins and self.deleted:
            self.close()

    def quarantine(self, error: StrataError, position: int | None) -> CorruptSegmentError:
        """Move the segment aside so no reader ever skips over it; return the error to raise."""
        self.close()
        target = self.path.with_name(self.path.name + QUARANTINE_SUFFIX)
        with storage_errors(f"cannot quarantine {self.path}"):
            fileio.fs.replace(self.path, target)
            fileio.fs.unlink(self.index_path, missing_ok=True)
        return CorruptSegmentError(
            f"corrupt record batch ({error}); segment quarantined",
            path=str(target),
            position=position,
        )

    # ---- writing -----------------------------------------------------------------------
    def append(self, parts: list[Any], header: BatchHeader, size: int) -> int:
        """Write one stamped batch at the end; returns its position. Leaves the file unchanged on error."""
        position = self.size
        try:
            fileio.fs.pwrite(self.fd, parts, position)
        except OSError as exc:
            with storage_errors(f"cannot roll back a failed append to {self.path}"):
                fileio.fs.ftruncate(self.fd, position)
            raise storage_error(f"append to {self.path} failed", exc) from exc
        self._note_batch(header, position)
        self.size = position + size
        self.dirty = True
        return position

    def _note_batch(self, h: BatchHeader, position: int) -> None:
        if position == 0 or self._bytes_since_index >= self.index_interval:
            self.index.add(h.base_offset - self.base_offset, position, self.max_timestamp)
            self._bytes_since_index = 0
        self._bytes_since_index += h.size
        if h.max_timestamp > self.max_timestamp:
            self.max_timestamp = h.max_timestamp
        self.next_offset = h.next_offset
        self._last = (h, position)

    def fsync(self) -> None:
        try:
            fileio.fs.fsync(self.fd)
        except OSError as exc:
            raise storage_error(f"fsync of {self.path} failed", exc) from exc

    def truncate(self, position: int) -> None:
        """Cut the file at ``position`` (a batch boundary) and rebuild the in-memory state."""
        with storage_errors(f"cannot truncate {self.path}"):
            fileio.fs.ftruncate(self.fd, position)
            fileio.fs.fsync(self.fd)
            fileio.fs.unlink(self.index_path, missing_ok=True)
        self._map = None
        self.size = position
        self.index.truncate_after(position)
        self.sealed = False
        self.scan(verify=False)

    # ---- reading -----------------------------------------------------------------------
    def buffer(self, need: int | None = None) -> Any:
        """A read-only buffer (an mmap) covering at least ``need`` bytes (default: all written)."""
        if self.size == 0:
            return b""
        m = self._map
        if m is None or len(m) < (self.size if need is None else need):
            with storage_errors(f"cannot map {self.path}"):
                m = self._map = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
        return m

    def view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)``: a view of the mapping, or, for a range in the file's last
        ``TAIL_READ_BYTES`` and past what is mapped (a reader at the log end, after each
        append), a copy read with ``pread`` rather than the file mapped again (a new mapping
        costs about 13 µs and its page faults)."""
        m = self._map
        if self.size - start <= TAIL_READ_BYTES and (m is None or len(m) < end):
            try:
                data = os.pread(self.fd, end - start, start)
            except OSError as exc:
                raise storage_error(f"cannot read {self.path}", exc) from exc
            if len(data) != end - start:
                raise StorageError(f"{self.path} ends before byte {end}")
            return memoryview(data)
        return memoryview(self.buffer(end))[start:end]

    def walk(self, position: int, end: int | None = None) -> Iterator[tuple[BatchHeader, int]]:
        """Yield (header, position) of the batches from ``position`` (headers only, no CRC)."""
        reader = _HeaderReader(self)
        end = self.size if end is None else end
        while position < end:
            b, at = reader.at(position, HEADER_SIZE)
            try:
                h = read_header(b, at)
            except CorruptBatchError as exc:
                raise CorruptBatchError(exc.reason, position=position) from None
            yield h, position
            position += h.size

    def extent(self, position: int, upper: int, max_bytes: int) -> tuple[int, int, int]:
        """What a read from the batch at ``position`` returns: the whole batches that end at or
        below offset ``upper``, at least one, then while they fit ``max_bytes`` from
        ``position``; as (end position, next offset, count), count 0 if the first one does not
        end below ``upper``.

        Reads three fields of each header (length, base offset, record count) and builds no
        ``BatchHeader``: the batches were checked when they were appended or recovered, and
        this walk is a fetch's cost per batch (a keyed topic of many partitions holds many
        small ones). A length that cannot be a batch still raises ``CorruptBatchError``.
        """
        last = self._last
        if last is not None and last[1] == position:  # the newest batch, from its own header
            h = last[0]
            if h.next_offset > upper:
                return position, -1, 0
            return position + h.size, h.next_offset, 1
        reader = _HeaderReader(self)
        mapped = reader.buf
        within = len(mapped) - 32  # headers starting at or below this are in the mapping
        end = self.size
        stop, next_offset, count = position, -1, 0
        while stop < end:
            if stop <= within:
                b, at = mapped, stop
            else:
                b, at = reader.at(stop, 32)
                mapped = reader.buf
                within = len(mapped) - 32
            base, length = _BASE_AND_LENGTH.unpack_from(b, at)
            size = length + 12
            if size < HEADER_SIZE or stop + size > end:
                raise CorruptBatchError(f"batch length field says {size} bytes", position=stop)
            after = base + _RECORD_COUNT.unpack_from(b, at + 28)[0]
            if after > upper or (count and stop + size - position > max_bytes):
                break
            stop, next_offset, count = stop + size, after, count + 1
        return stop, next_offset, count

    def position_of(self, offset: int) -> tuple[BatchHeader, int] | None:
        """(header, position) of the batch holding ``offset``, or None past the end."""
        last = self._last
        if last is not None and last[0].base_offset <= offset < last[0].next_offset:
            return last
        pos = self.index.position_for_offset(offset - self.base_offset)
        for h, p in self.walk(pos):
            if h.next_offset > offset:
                return h, p
        return None

    # ---- recovery ----------------------------------------------------------------------
    def scan(self, *, verify: bool) -> ScanResult:
        """Walk every batch from the start, rebuilding the index; with ``verify``, check CRCs.

        Stops at the first batch that fails; the result says where, and whether any valid batch
        lies after the failure (which tells corruption in the middle from a torn tail).
        """
        self.index = SparseIndex()
        self.max_timestamp = NO_TIMESTAMP
        self.next_offset = self.base_offset
        self._last = None
        self._bytes_since_index = 0
        buf = self.buffer()
        pos = 0
        size = self.size
        error: StrataError | None = None
        while pos < size:
            try:
                h = check_batch(buf, pos, exact=False) if verify else read_header(buf, pos)
                if pos + h.size > size:
                    raise CorruptBatchError(
                        f"truncated batch: {size - pos} of {h.size} bytes", position=pos
                    )
                if h.base_offset != self.next_offset:
                    raise CorruptBatchError(
                        f"batch at offset {h.base_offset} where {self.next_offset} was expected",
                        position=pos,
                    )
            except StrataError as exc:
                error = exc
                break
            self._note_batch(h, pos)
            pos += h.size
        return ScanResult(
            valid_size=pos,
            next_offset=self.next_offset,
            max_timestamp=self.max_timestamp,
            index=self.index,
            error=error,
            valid_batch_after_error=error is not None and _valid_batch_after(buf, pos, size),
        )


def _valid_batch_after(buf: Any, position: int, size: int) -> bool:
    """Is there any CRC-valid batch at an 8-aligned position after ``position``?

    Batches are 8-aligned, so candidates are the aligned positions whose magic byte is right and
    whose reserved bytes are zero; numpy finds them without a Python loop over the bytes.
    """
    start = position + 8
    if size - start < HEADER_SIZE:
        return False
    arr = np.frombuffer(buf, dtype=np.uint8, count=size - start, offset=start)
    usable = (len(arr) - HEADER_SIZE) // 8 + 1
    magic = arr[16 : 16 + 8 * usable : 8]
    zeros = (
        arr[17 : 17 + 8 * usable : 8]
        | arr[18 : 18 + 8 * usable : 8]
        | arr[19 : 19 + 8 * usable : 8]
    )
    n = min(len(magic), len(zeros))
    candidates = np.flatnonzero(((magic[:n] == MAGIC) | (magic[:n] == MAGIC_V1)) & (zeros[:n] == 0))
    for c in candidates:
        try:
            h = check_batch(buf, start + 8 * int(c), exact=False)
        except StrataError:
            continue
        if start + 8 * int(c) + h.size <= size:
            return True
    return False


class _HeaderReader:
    """A segment's bytes for a walk over its batch headers: the file's mapping as it is,
    however much was appended since it was made; past its end, within ``TAIL_READ_BYTES`` of
    the file's end, chunks of ``HEADER_CHUNK`` bytes read with ``pread``; further back, the
    file mapped again. A reader a few batches behind the log end (a consumer, a follower, the
    delay scheduler) used to map the file again after every append to read a few headers:
    about 13 us and page faults each time, a tenth of an agent's busy time with the delay
    levels' one-record batches."""

    __slots__ = ("buf", "chunk", "chunk_at", "seg")

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.buf: Any = seg._map if seg._map is not None else seg.buffer()
        self.chunk = b""
        self.chunk_at = 0

    def at(self, position: int, size: int) -> tuple[Any, int]:
        """(a buffer, where in it) holding the file's bytes ``[position, position + size)``."""
        if position + size <= len(self.buf):
            return self.buf, position
        at = position - self.chunk_at
        if at >= 0 and at + size <= len(self.chunk):
            return self.chunk, at
        seg = self.seg
        if seg.size - position > TAIL_READ_BYTES:
            self.buf = seg.buffer()
            return self.buf, position
        try:
            data = os.pread(seg.fd, max(size, min(HEADER_CHUNK, seg.size - position)), position)
        except OSError as exc:
            raise storage_error(f"cannot read {seg.path}", exc) from exc
        if len(data) < size:
            raise CorruptBatchError(f"{seg.path} ends inside a batch", position=position)
        self.chunk, self.chunk_at = data, position
        return data, 0
