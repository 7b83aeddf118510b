"""The local write-ahead log as its users rely on it: append, read, roll, index, truncate,
delete, reject bad input, reopen, and group commit (``storage.wal``)."""

from __future__ import annotations

import asyncio
import errno
import itertools
import mmap
import os
import random
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.codec import HEADER_SIZE, check_batch, encode_batch, read_header
from storage.codec.control import encode_marker
from storage.codec.parts import BatchParts
from storage.errors import (
    BatchTooLargeError,
    CorruptBatchError,
    InvalidOffsetError,
    LogClosedError,
    OffsetOutOfRangeError,
    StorageError,
    UnsupportedVersionError,
)
from storage.wal import FlushJob, GroupCommitLog, PartitionLog
from storage.wal.index import ENTRY, SparseIndex
from tests.codec_support import body_buffers, patch, with_crc
from tests.wal_support import T0, Record, config, decode, produce, read_all, snapshot

Opener = Callable[..., PartitionLog]


@pytest.fixture
def open_log() -> Iterator[Opener]:
    """``PartitionLog.open`` that closes every log it opened when the test ends."""
    opened: list[PartitionLog] = []

    def open_(directory: Path, cfg: Any = None, **kwargs: Any) -> PartitionLog:
        log = PartitionLog.open(directory, cfg or config(), **kwargs)
        opened.append(log)
        return log

    yield open_
    for log in opened:
        log.close()


def fill(log: PartitionLog, rng: random.Random, batches: int, **kwargs: Any) -> list[Record]:
    """Append ``batches`` random batches; returns their records."""
    records: list[Record] = []
    for _ in range(batches):
        p = produce(rng, **kwargs)
        info = log.append(p.data, leader_epoch=1)
        records.extend(p.records(info.base_offset))
    return records


def segment_holding(log: PartitionLog, offset: int) -> Any:
    return next(s for s in log.segments if s.base_offset <= offset < s.next_offset)


# ---- append and read ----------------------------------------------------------------------


@pytest.mark.parametrize("index_interval", [0, 512, 1 << 20])
def test_round_trip_across_many_small_segments(
    tmp_path: Path, open_log: Opener, index_interval: int
) -> None:
    start = 1000
    log = open_log(tmp_path, config(index_interval_bytes=index_interval), start_offset=start)
    rng = random.Random(index_interval)
    expected: list[Record] = []
    for _ in range(150):
        p = produce(rng)
        info = log.append(p.data, leader_epoch=1)
        assert info.base_offset == start + len(expected)
        assert info.last_offset == info.base_offset + len(p) - 1
        assert info.size == len(p.data)
        assert info.max_timestamp == max(p.timestamps)
        expected.extend(p.records(info.base_offset))

    assert len(log.segments) >= 20
    assert (log.log_start_offset, log.log_end_offset) == (start, start + len(expected))
    assert [r.offset for r in expected] == list(range(start, log.log_end_offset))

    # every offset reads back as the one batch holding it
    for r in expected:
        s = log.read(r.offset, 1)
        assert s.batch_count == 1
        assert s.first_offset <= r.offset < s.next_offset
        assert decode(s.data) == expected[s.first_offset - start : s.next_offset - start]

    # consecutive reads cover the log exactly, whatever the read size
    for max_bytes in (1, 3000, 1 << 20):
        assert read_all(log, max_bytes=max_bytes) == expected
    chunks = []
    offset = start
    while offset < log.log_end_offset:
        s = log.read(offset, 1 << 20)
        chunks.append(bytes(s.data))
        offset = s.next_offset
    assert decode(b"".join(chunks)) == expected


def test_read_honours_max_bytes(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path)
    records = fill(log, random.Random(2), 80)
    size_of = {}  # base offset -> stored size of the batch
    offset = 0
    while offset < log.log_end_offset:
        s = log.read(offset, 0)
        size_of[s.first_offset] = len(s)
        offset = s.next_offset

    for offset, max_bytes in itertools.product(
        range(0, len(records), 3), (0, 1, 200, 1500, 5000, 9000, 1 << 20)
    ):
        s = log.read(offset, max_bytes)
        assert s.batch_count >= 1
        assert s.first_offset <= offset < s.next_offset
        if s.batch_count > 1:
            assert len(s) <= max_bytes
        # whole batches only, laid end to end from the one holding ``offset``
        bases = [r.offset for r in decode(s.data)]
        batch_bases = sorted({b for b in size_of if s.first_offset <= b < s.next_offset})
        assert len(batch_bases) == s.batch_count and bases[0] == s.first_offset
        assert len(s) == sum(size_of[b] for b in batch_bases)
        # and as many as fit: the next batch of the same segment would not have
        if s.next_offset < segment_holding(log, offset).next_offset:
            assert len(s) + size_of[s.next_offset] > max_bytes

    # a limit met exactly still takes the last batch
    for first in sorted(size_of)[:-2]:
        second = first + len(decode(log.read(first, 0).data))
        if segment_holding(log, first) is segment_holding(log, second):
            s = log.read(first, size_of[first] + size_of[second])
            assert (s.batch_count, len(s)) == (2, size_of[first] + size_of[second])


def test_read_honours_max_offset(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, config(segment_bytes=1 << 20))
    records = fill(log, random.Random(3), 6, count=3)  # batches at 0, 3, 6, 9, 12, 15

    s = log.read(0, 1 << 20, max_offset=9)
    assert (s.first_offset, s.next_offset, s.batch_count) == (0, 9, 3)
    assert decode(s.data) == records[:9]
    s = log.read(0, 1 << 20, max_offset=11)  # the batch 9..11 ends past 11: left out
    assert (s.next_offset, s.batch_count) == (9, 3)
    s = log.read(4, 1 << 20, max_offset=12)
    assert (s.first_offset, s.next_offset, s.batch_count) == (3, 12, 3)
    s = log.read(10, 1 << 20, max_offset=11)  # the batch holding 10 ends past the bound
    assert (len(s), s.batch_count) == (0, 0)
    s = log.read(9, 1 << 20, max_offset=9)
    assert (len(s), s.batch_count, s.next_offset) == (0, 0, 9)
    s = log.read(0, 1 << 20, max_offset=1000)
    assert (s.next_offset, s.batch_count) == (18, 6)


def test_extent_agrees_with_a_walk_of_whole_headers(tmp_path: Path, open_log: Opener) -> None:
    """The read path's lean walk (three header fields) stops where a walk of parsed headers
    would, for every start, bound and byte limit."""
    log = open_log(tmp_path, config(segment_bytes=1 << 20))
    fill(log, random.Random(4), 40)
    seg = log.segments[0]
    starts = [p for _, p in seg.walk(0)]
    for pos, upper, max_bytes in itertools.product(
        starts[::3], range(0, 400, 23), (0, 3000, 1 << 20)
    ):
        stop, next_offset, count = pos, -1, 0
        for h, p in seg.walk(pos):
            if h.next_offset > upper or (count and p + h.size - pos > max_bytes):
                break
            stop, next_offset, count = p + h.size, h.next_offset, count + 1
        assert seg.extent(pos, upper, max_bytes) == (stop, next_offset, count)


def test_extent_refuses_a_length_that_cannot_be_a_batch(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, config(segment_bytes=1 << 20))
    fill(log, random.Random(5), 3)
    seg = log.segments[0]
    second = [p for _, p in seg.walk(0)][1]
    with open(seg.path, "r+b") as f:
        f.seek(second + 8)
        f.write(struct.pack("<i", 4))  # 16 bytes: shorter than a header
    with pytest.raises(CorruptBatchError):
        seg.extent(0, 1 << 40, 1 << 20)


def test_read_at_log_end_is_empty_and_outside_the_log_raises(
    tmp_path: Path, open_log: Opener
) -> None:
    log = open_log(tmp_path, start_offset=100)
    s = log.read(100, 1000)
    assert (len(s), s.batch_count, s.first_offset, s.next_offset) == (0, 0, 100, 100)

    fill(log, random.Random(4), 5)
    end = log.log_end_offset
    s = log.read(end, 1000)
    assert (len(s), s.batch_count, s.first_offset, s.next_offset) == (0, 0, end, end)
    for offset in (99, end + 1, 0, -1):
        with pytest.raises(OffsetOutOfRangeError) as exc:
            log.read(offset, 1000)
        assert (exc.value.offset, exc.value.log_start, exc.value.log_end) == (offset, 100, end)
        assert not exc.value.retriable


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole", "in-parts"])
def test_leader_stamps_base_offset_and_epoch_without_reencoding(
    tmp_path: Path, open_log: Opener, in_parts: bool
) -> None:
    """Also for a batch handed over in pieces (``BatchParts``, the Kafka listener's): the
    file holds exactly the joined bytes, stamped."""
    log = open_log(tmp_path)
    rng = random.Random(5)
    for epoch in (0, 7, 2**31 - 1, 3):
        # whatever the producer left in the stamped fields is replaced
        produced = encode_batch(
            [rng.randbytes(40) for _ in range(3)],
            timestamps=T0,
            base_offset=rng.randrange(1 << 40),
            leader_epoch=rng.randrange(-1, 1 << 20),
        )
        if in_parts:
            cut = rng.randrange(HEADER_SIZE, len(produced))
            view = memoryview(produced)
            parts = BatchParts(
                check_batch(produced), (view[:HEADER_SIZE], view[HEADER_SIZE:cut], view[cut:])
            )
            with pytest.raises(ValueError):
                log.append(parts, leader_epoch=epoch)  # pieces come with their checked header
            marker = encode_marker(7, 0, commit=True, coordinator_epoch=0, timestamp_ms=T0)
            control = BatchParts(check_batch(marker), (memoryview(marker),))
            with pytest.raises(ValueError):  # markers are appended whole
                log.append(control, leader_epoch=epoch, checked=control.header)
            info = log.append(parts, leader_epoch=epoch, checked=parts.header)
        else:
            info = log.append(produced, leader_epoch=epoch)
        stored = bytes(log.read(info.base_offset, 1).data)
        assert len(stored) == len(produced)
        assert stored[0:8] == struct.pack("<q", info.base_offset)
        assert stored[8:12] == produced[8:12]
        assert stored[12:16] == struct.pack("<i", epoch)
        assert stored[16:] == produced[16:]  # not re-encoded: CRC and body as the producer sent
        h = check_batch(stored)
        assert (h.base_offset, h.leader_epoch, h.crc) == (
            info.base_offset,
            epoch,
            read_header(produced).crc,
        )
        assert [r.offset for r in decode(stored)] == [info.base_offset + i for i in range(3)]

    seg = log.active
    on_disk = seg.path.read_bytes()
    assert bytes(log.read(0, 1 << 20).data) == on_disk[: seg.size]


def test_a_reader_at_the_log_end_sees_each_batch_as_it_is_appended(
    tmp_path: Path, open_log: Opener
) -> None:
    """A tail reader asks, after each append, for the offset it has not read yet: answered
    from the newest batch's own header and a ``pread`` (no walk, no new mapping), it must
    be what the log holds, across segment rolls and after a truncation inside a segment."""
    log = open_log(tmp_path, config(segment_bytes=4096, index_interval_bytes=512))
    rng = random.Random(21)
    written: list[Record] = []
    seen: list[Record] = []
    position = 0
    for i in range(60):
        if i == 40:  # cut inside a segment: the reader goes back to the new end
            bases = next(
                b
                for seg in reversed(log.segments)
                if len(b := [h.base_offset for h, _ in seg.walk(0)]) >= 2
            )
            position = bases[1]
            log.truncate_to(position)
            written, seen = written[:position], seen[:position]
            assert log.read(position, 1 << 20).batch_count == 0
        written += fill(log, rng, 1)
        end = log.log_end_offset
        held = log.read(position, 1 << 20, max_offset=end - 1)  # not below the bound yet
        assert (held.batch_count, len(held), held.next_offset) == (0, 0, position)
        s = log.read(position, 1 << 20)
        assert (s.batch_count, s.first_offset, s.next_offset) == (1, position, end)
        seen += decode(s.data)
        position = s.next_offset
    assert seen == written
    assert [r for seg in log.segments for r in decode(log.read(seg.base_offset, 1 << 20).data)] == (
        written
    )
    assert len(log.segments) > 3


def test_read_returns_a_zero_copy_view_of_the_segment_map(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path)
    fill(log, random.Random(6), 4)
    s = log.read(0, 1 << 20)
    assert isinstance(s.data, memoryview)
    assert isinstance(s.data.obj, mmap.mmap)
    assert s.data.readonly
    assert bytes(s.data) == log.active.path.read_bytes()[: len(s)]


# ---- rolling and indexes --------------------------------------------------------------------


def test_roll_by_size(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path)
    rng = random.Random(7)
    for _ in range(40):
        log.append(produce(rng, count=1, value_size=rng.randint(200, 2500)).data, leader_epoch=1)
    segs = log.segments
    assert len(segs) >= 6
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [
        f"{s.base_offset:020d}.log" for s in segs
    ]
    assert all(len(p.name) == len("00000000000000000000.log") for p in tmp_path.iterdir())
    assert segs[0].base_offset == 0
    for a, b in itertools.pairwise(segs):
        assert b.base_offset == a.next_offset
        assert a.sealed and a.size <= 8192
        # rolled only because the next batch would not have fitted
        assert a.size + len(log.read(b.base_offset, 1)) > 8192
    assert not segs[-1].sealed
    assert all(s.path.stat().st_size == s.size for s in segs)

    # a batch bigger than segment.bytes (but within max.message.bytes) gets a segment of its own
    big = produce(rng, count=1, value_size=20_000)
    info = log.append(big.data, leader_epoch=1)
    assert (log.active.base_offset, log.active.size) == (info.base_offset, len(big.data))
    info = log.append(produce(rng, count=1, value_size=10).data, leader_epoch=1)
    assert log.active.base_offset == info.base_offset


def test_roll_by_age_uses_the_injected_clock(tmp_path: Path, open_log: Opener) -> None:
    t = [1024.0]
    cfg = config(segment_ms=60_000, segment_bytes=1 << 20)
    log = open_log(tmp_path, cfg, clock=lambda: t[0])
    rng = random.Random(8)
    t[0] += 3600.0  # an empty segment never rolls, however old
    log.append(produce(rng, count=2).data, leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0]

    t[0] += 59.5  # the segment is 59.5 s old
    log.append(produce(rng, count=2).data, leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0]
    t[0] += 0.5  # 60 s: roll
    log.append(produce(rng, count=2).data, leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0, 4]

    # after a reopen the active segment's age counts from the open
    log.close()
    t[0] += 3600.0
    log = open_log(tmp_path, cfg, clock=lambda: t[0])
    log.append(produce(rng, count=2).data, leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0, 4]
    t[0] += 60.0
    log.append(produce(rng, count=2).data, leader_epoch=1)
    assert [s.base_offset for s in log.segments] == [0, 4, 8]


@pytest.mark.parametrize("flush_every_append", [False, True])
def test_sealed_segments_get_index_files_after_flush(
    tmp_path: Path, open_log: Opener, flush_every_append: bool
) -> None:
    log = open_log(tmp_path, config(index_interval_bytes=300))
    rng = random.Random(9)
    records: list[Record] = []
    while len(log.segments) < 5:
        records += fill(log, rng, 1)
        if flush_every_append:
            log.flush()
    if not flush_every_append:
        assert not list(tmp_path.glob("*.index"))
        log.flush()
    for seg in log.segments[:-1]:
        stored = SparseIndex.from_bytes(seg.index_path.read_bytes(), seg.size)
        assert stored is not None, seg.index_path
        assert stored.to_bytes(seg.size) == seg.index.to_bytes(seg.size)
        assert len(stored) >= 2
    assert not log.active.index_path.exists()

    times = sorted({r.timestamp for r in records})
    answers = [log.offset_for_timestamp(t) for t in times]
    log.close()
    log = open_log(tmp_path, config(index_interval_bytes=300))
    assert read_all(log) == records
    assert [log.offset_for_timestamp(t) for t in times] == answers


@pytest.mark.parametrize("jitter", [40, 100_000])
def test_offset_for_timestamp(tmp_path: Path, open_log: Opener, jitter: int) -> None:
    cfg = config(index_interval_bytes=300)
    log = open_log(tmp_path, cfg)
    assert log.offset_for_timestamp(0) is None
    rng = random.Random(jitter)
    records: list[Record] = []
    for b in range(120):  # timestamps rise batch by batch, out of order within and across
        records += fill(log, rng, 1, ts=T0 + 10 * b, jitter=jitter)
    assert len(log.segments) >= 5
    assert any(a.timestamp > b.timestamp for a, b in itertools.pairwise(records))
    assert log.max_timestamp == max(r.timestamp for r in records)

    def expected(t: int) -> int | None:
        return next((r.offset for r in records if r.timestamp >= t), None)

    targets = sorted({r.timestamp + d for r in records for d in (-1, 0, 1)})
    targets += [targets[0] - 1000, targets[-1] + 1, targets[-1] + 1000]
    for t in targets:
        assert log.offset_for_timestamp(t) == expected(t), t
    log.close()
    log = open_log(tmp_path, cfg)  # sealed segments now answer from their index files
    for t in targets:
        assert log.offset_for_timestamp(t) == expected(t), t


# ---- truncation and deletion ----------------------------------------------------------------


def test_truncate_to_mid_batch_cuts_at_the_batch_base(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, config(segment_bytes=1 << 20))
    rng = random.Random(10)
    records = fill(log, rng, 5, count=4)  # batches at 0, 4, 8, 12, 16
    sizes = [len(log.read(b, 1)) for b in (0, 4)]
    log.flush()

    assert log.truncate_to(10) == 8
    assert log.log_end_offset == 8 and log.flushed_offset <= 8
    assert read_all(log) == records[:8]
    assert log.active.path.stat().st_size == sum(sizes)
    assert log.offset_for_timestamp(T0) == 0
    assert log.truncate_to(8) == 8 and log.truncate_to(1000) == 8  # at or past the end: no-op
    assert log.log_end_offset == 8

    more = fill(log, rng, 2, count=3)
    assert [r.offset for r in more] == list(range(8, 14))
    assert read_all(log) == records[:8] + more


@pytest.mark.parametrize("at_boundary", [False, True])
def test_truncate_across_segments(tmp_path: Path, open_log: Opener, at_boundary: bool) -> None:
    log = open_log(tmp_path)
    rng = random.Random(11)
    records = fill(log, rng, 60, count=3)
    log.flush()
    segs = log.segments
    assert len(segs) >= 6
    k = len(segs) // 2
    target = segs[k].base_offset if at_boundary else segs[k].base_offset + 4
    new_end = target if at_boundary else segs[k].base_offset + 3

    assert log.truncate_to(target) == new_end
    kept = segs[:k] if at_boundary else segs[: k + 1]
    assert [s.base_offset for s in log.segments] == [s.base_offset for s in kept]
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [s.path.name for s in kept]
    assert not any(s.index_path.exists() for s in segs[k:])
    # the segment cut (or, at a boundary, left last) takes appends again: it is no longer sealed
    assert not log.active.sealed and not log.active.index_path.exists()
    assert log.log_end_offset == new_end and log.flushed_offset <= new_end
    assert read_all(log) == records[:new_end]
    with pytest.raises(OffsetOutOfRangeError):
        log.read(new_end + 1, 100)

    more = fill(log, rng, 10, count=3)
    assert [r.offset for r in more] == list(range(new_end, new_end + 30))
    expected = records[:new_end] + more
    assert read_all(log) == expected
    log.close()
    log = open_log(tmp_path)
    assert log.log_end_offset == new_end + 30
    assert read_all(log) == expected


def test_truncate_below_the_log_start_is_invalid(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, start_offset=100)
    fill(log, random.Random(12), 3)
    before, end = snapshot(tmp_path), log.log_end_offset
    with pytest.raises(InvalidOffsetError):
        log.truncate_to(99)
    assert (snapshot(tmp_path), log.log_end_offset) == (before, end)
    assert log.truncate_to(100) == 100  # truncating to the start empties the log
    assert log.log_end_offset == 100 and read_all(log) == []


def test_delete_segments_before(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path)
    records = fill(log, random.Random(13), 60, count=3)
    log.flush()
    segs = log.segments
    assert len(segs) >= 6

    assert log.delete_segments_before(segs[2].base_offset + 1) == [
        segs[0].base_offset,
        segs[1].base_offset,
    ]
    assert log.log_start_offset == segs[2].base_offset
    # a segment goes when all its records are below the offset: exactly at the next base
    assert log.delete_segments_before(segs[3].base_offset) == [segs[2].base_offset]
    start = segs[3].base_offset
    assert log.log_start_offset == start
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [s.path.name for s in segs[3:]]
    assert not any(s.index_path.exists() for s in segs[:3])
    with pytest.raises(OffsetOutOfRangeError):
        log.read(start - 1, 100)
    assert read_all(log) == records[start:]
    with pytest.raises(InvalidOffsetError):
        log.truncate_to(start - 1)

    log.close()
    log = open_log(tmp_path)
    assert (log.log_start_offset, log.log_end_offset) == (start, len(records))
    assert read_all(log) == records[start:]
    # never the active segment, whatever the offset
    assert log.delete_segments_before(10**9) == [s.base_offset for s in segs[3:-1]]
    assert [s.base_offset for s in log.segments] == [segs[-1].base_offset]
    assert read_all(log) == records[segs[-1].base_offset :]


def test_restart_at_drops_everything_and_continues_from_the_offset(
    tmp_path: Path, open_log: Opener
) -> None:
    log = open_log(tmp_path)
    records = fill(log, random.Random(14), 30, count=3)
    log.flush()
    assert len(log.segments) > 2
    end = log.log_end_offset
    with pytest.raises(InvalidOffsetError):
        log.restart_at(end - 1)  # it would lose records the log has
    log.restart_at(end + 500)
    assert (log.log_start_offset, log.log_end_offset) == (end + 500, end + 500)
    assert [p.name for p in tmp_path.glob("*.log")] == [log.active.path.name]
    assert log.epochs == []
    with pytest.raises(OffsetOutOfRangeError):
        log.read(end, 100)
    more = fill(log, random.Random(15), 2)
    assert read_all(log) == more
    assert more[0].offset == end + 500
    log.flush()
    log.close()
    log = open_log(tmp_path)  # reopens where it restarted, nothing of before left
    assert (log.log_start_offset, log.log_end_offset) == (end + 500, end + 500 + len(more))
    assert len(records) == end


def test_delete_segments_before_trims_the_leader_epoch_cache(
    tmp_path: Path, open_log: Opener
) -> None:
    log = open_log(tmp_path)
    rng = random.Random(15)
    for epoch in (0, 0, 0, 3, 3, 3, 5, 5, 8, 8, 8, 8):
        for _ in range(4):
            log.append(produce(rng, count=3, value_size=300).data, leader_epoch=epoch)
    log.flush()
    full = list(log.epochs)
    assert [e for e, _ in full] == [0, 3, 5, 8] and len(log.segments) >= 6
    for seg in log.segments[:-1]:
        log.delete_segments_before(seg.next_offset)
        start = log.log_start_offset
        kept = [e for e in full if e[1] <= start][-1:] + [e for e in full if e[1] > start]
        assert log.epochs == kept
        assert log.epochs[0][1] <= start  # the first remaining batch's epoch is still known
        assert log.end_offset_for_epoch(log.epochs[0][0])[0] == log.epochs[0][0]
    assert log.epochs == [full[-1]]
    assert log.end_offset_for_epoch(9) == (8, log.log_end_offset)
    assert log.end_offset_for_epoch(5) == (-1, log.log_start_offset)


def test_delete_segments_before_keeps_unflushed_segments(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, config(fsync_policy="never"))
    records = fill(log, random.Random(14), 40, count=3)
    sealed = [s.base_offset for s in log.segments[:-1]]
    assert len(sealed) >= 3
    assert log.delete_segments_before(log.log_end_offset) == []

    # a flush job in flight (its fsyncs and index writes run in another thread) pins the
    # files it uses: deleting the segments under it is safe, and it writes no index for them
    job = log.prepare_flush()
    assert job is not None
    assert log.delete_segments_before(log.log_end_offset) == sealed
    job.run()
    log.complete_flush(job)
    assert log.flushed_offset == log.log_end_offset
    assert sorted(p.name for p in tmp_path.iterdir()) == [log.active.path.name]
    assert read_all(log) == records[log.log_start_offset :]


# ---- bad input and I/O errors leave the log as it was -------------------------------------


def _flip(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0x40
    return bytes(out)


def _garbage_with_magic(data: bytes) -> bytes:
    out = bytearray(random.Random(15).randbytes(len(data)))
    out[16:20] = b"\x01\x00\x00\x00"
    return bytes(out)


def _malformed_body_with_valid_crc(data: bytes) -> bytes:
    """A value offset pointing past the value data, CRC recomputed: a buggy producer."""
    pos, length = body_buffers(data)[5]
    assert length
    return with_crc(patch(data, pos + 4, "<i", 1 << 20))


BAD_INPUT: dict[str, tuple[Callable[[bytes], bytes], Any]] = {
    "malformed-body-valid-crc": (_malformed_body_with_valid_crc, CorruptBatchError),
    "crc-body-byte": (lambda b: _flip(b, 100), CorruptBatchError),
    "crc-last-byte": (lambda b: _flip(b, len(b) - 9), CorruptBatchError),
    "crc-field": (lambda b: _flip(b, 21), CorruptBatchError),
    "crc-covered-header": (lambda b: _flip(b, 30), CorruptBatchError),
    "truncated": (lambda b: b[:-8], CorruptBatchError),
    "truncated-header": (lambda b: b[:40], CorruptBatchError),
    "extended": (lambda b: b + bytes(8), CorruptBatchError),
    "two-batches": (lambda b: b + b, CorruptBatchError),
    "length-field": (lambda b: b[:8] + struct.pack("<i", len(b) - 4) + b[12:], CorruptBatchError),
    "unknown-magic": (lambda b: b[:16] + b"\x03" + b[17:], UnsupportedVersionError),
    "empty": (lambda b: b"", CorruptBatchError),
    "garbage": (lambda b: random.Random(16).randbytes(len(b)), UnsupportedVersionError),
    "garbage-with-magic": (_garbage_with_magic, CorruptBatchError),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_leaves_the_log_unchanged(tmp_path: Path, open_log: Opener, case: str) -> None:
    mutate, error = BAD_INPUT[case]
    log = open_log(tmp_path)
    rng = random.Random(17)
    good = produce(rng, count=3, value_size=200)
    records: list[Record] = []
    # fill the active segment so that the next batch of this size rolls
    while not (log.active.size and log.active.size + len(good.data) > 8192):
        records += fill(log, rng, 1, count=3, value_size=200)
    before, end, n_segments = snapshot(tmp_path), log.log_end_offset, len(log.segments)

    bad = mutate(good.data)
    assert bad != good.data
    with pytest.raises(error):
        log.append(bad, leader_epoch=1)
    assert snapshot(tmp_path) == before
    assert (log.log_end_offset, len(log.segments)) == (end, n_segments)
    assert read_all(log) == records

    info = log.append(good.data, leader_epoch=1)  # still fine, and rolls as it should
    assert info.base_offset == end and len(log.segments) == n_segments + 1
    assert read_all(log) == records + good.records(end)


def test_batch_over_max_message_bytes_is_rejected(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path)
    fill(log, random.Random(18), 3)
    before, end = snapshot(tmp_path), log.log_end_offset
    big = encode_batch([bytes(70_000)], timestamps=T0)
    with pytest.raises(BatchTooLargeError) as exc:
        log.append(big, leader_epoch=1)
    assert (exc.value.size, exc.value.limit) == (len(big), 65536)
    assert (snapshot(tmp_path), log.log_end_offset) == (before, end)
    # exactly at the limit is fine
    at_limit = config(max_message_bytes=len(big))
    log.close()
    log = open_log(tmp_path, at_limit)
    assert log.append(big, leader_epoch=1).base_offset == end


def test_failed_write_is_rolled_back(
    tmp_path: Path, open_log: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = open_log(tmp_path)
    rng = random.Random(19)
    records = fill(log, rng, 3)
    before, end = snapshot(tmp_path), log.log_end_offset
    real_pwritev = os.pwritev

    def disk_full(fd: int, buffers: Any, offset: int) -> int:
        real_pwritev(fd, [memoryview(buffers[0])[:10]], offset)  # a torn write, then the error
        raise OSError(errno.ENOSPC, "No space left on device")

    p = produce(rng)
    monkeypatch.setattr(os, "pwritev", disk_full)
    with pytest.raises(StorageError) as exc:
        log.append(p.data, leader_epoch=1)
    monkeypatch.undo()
    assert exc.value.retriable
    assert (snapshot(tmp_path), log.log_end_offset) == (before, end)
    info = log.append(p.data, leader_epoch=1)
    assert info.base_offset == end
    assert read_all(log) == records + p.records(end)


def test_failed_fsync_fences_the_log(
    tmp_path: Path, open_log: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = open_log(tmp_path)
    rng = random.Random(20)
    fill(log, rng, 3)

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(StorageError, match="fenced"):
        log.flush()
    monkeypatch.undo()
    assert log.flushed_offset == 0
    with pytest.raises(StorageError, match="fenced"):
        log.append(produce(rng).data, leader_epoch=1)
    with pytest.raises(StorageError, match="fenced"):
        log.read(0, 100)
    log.close()  # releases the files without trying to flush again


def test_a_failed_fsync_at_a_roll_fences_the_log_instead_of_being_retried(
    tmp_path: Path, open_log: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``always`` a roll fsyncs the segment it seals. A failure there must fence the log:
    the next append would otherwise roll again, fsync again, and take the "success" of an
    fsync whose pages the kernel may already have dropped (fsyncgate)."""
    log = open_log(tmp_path, config(segment_bytes=4096))
    errors: list[StorageError] = []
    log.on_io_error = errors.append
    rng = random.Random(21)
    fill(log, rng, 1, count=1, value_size=1000)
    flushed = log.flush()
    fill(log, rng, 1, count=1, value_size=1000)  # unflushed: the failed fsync covers it
    assert len(log.segments) == 1
    calls = 0
    real_fsync = os.fsync

    def fails_once(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fails_once)
    with pytest.raises(StorageError, match="fenced"):
        while len(log.segments) == 1:
            fill(log, rng, 1, count=1, value_size=1000)
    with pytest.raises(StorageError, match="fenced"):
        fill(log, rng, 1, count=1, value_size=1000)
    assert calls == 1
    assert log.durable_end_at_failure == flushed
    assert len(errors) == 1 and "fenced" in str(errors[0])


def test_disk_errors_are_reported_and_only_failed_fsyncs_fence(
    tmp_path: Path, open_log: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = open_log(tmp_path)
    errors: list[StorageError] = []
    log.on_io_error = errors.append
    rng = random.Random(22)
    fill(log, rng, 2)

    def disk_full(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", disk_full)
    with pytest.raises(StorageError, match="No space"):
        fill(log, rng, 1)
    monkeypatch.undo()
    assert len(errors) == 1 and log.durable_end_at_failure is None
    fill(log, rng, 1)  # still usable: the write was rolled back
    flushed = log.flush()
    fill(log, rng, 1)

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(StorageError, match="fenced"):
        log.truncate_to(log.log_end_offset - 1)  # a truncation ends with an fsync
    assert len(errors) == 2 and log.durable_end_at_failure == flushed


# ---- reopening --------------------------------------------------------------------------


def test_reopen_after_clean_close(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, start_offset=500)
    rng = random.Random(21)
    records = fill(log, rng, 50)
    bases = [s.base_offset for s in log.segments]
    end, max_ts = log.log_end_offset, log.max_timestamp
    log.close()
    for _ in range(2):
        log = open_log(tmp_path)
        assert [s.base_offset for s in log.segments] == bases
        assert (log.log_start_offset, log.log_end_offset) == (500, end)
        assert log.flushed_offset == end and log.max_timestamp == max_ts
        assert read_all(log) == records
        log.close()
    log = open_log(tmp_path)
    more = fill(log, rng, 3)
    assert more[0].offset == end
    assert read_all(log) == records + more


def _damage_index(data: bytes, how: str) -> bytes | None:
    if how == "missing":
        return None
    if how == "empty":
        return b""
    if how == "truncated":
        return data[:-5]
    if how == "entry-byte":
        return _flip(data, 5)
    if how == "entry-offset":  # still well-formed, but points offsets at the wrong batch
        out = bytearray(data)
        (rel,) = struct.unpack_from("<I", out, ENTRY.size)
        struct.pack_into("<I", out, ENTRY.size, rel - 1)
        return bytes(out)
    if how == "magic":
        return _flip(data, len(data) - 16)
    if how == "other-log-size":
        size = struct.unpack_from("<I", data, len(data) - 4)[0]
        return data[:-4] + struct.pack("<I", size + 8)
    assert how == "garbage"
    return random.Random(22).randbytes(len(data))


@pytest.mark.parametrize(
    "how",
    [
        "missing",
        "empty",
        "truncated",
        "entry-byte",
        "entry-offset",
        "magic",
        "other-log-size",
        "garbage",
    ],
)
def test_damaged_or_missing_index_is_rebuilt(tmp_path: Path, open_log: Opener, how: str) -> None:
    cfg = config(index_interval_bytes=300)
    log = open_log(tmp_path, cfg)
    records = fill(log, random.Random(23), 30)
    assert len(log.segments) >= 3
    times = sorted({r.timestamp for r in records})
    answers = [log.offset_for_timestamp(t) for t in times]
    log.close()
    index = tmp_path / f"{0:020d}.index"
    original = index.read_bytes()
    damaged = _damage_index(original, how)
    if damaged is None:
        index.unlink()
    else:
        index.write_bytes(damaged)

    log = open_log(tmp_path, cfg)
    assert read_all(log) == records
    for r in records:
        s = log.read(r.offset, 1)
        assert s.first_offset <= r.offset < s.next_offset
    assert [log.offset_for_timestamp(t) for t in times] == answers
    log.close()  # the rebuilt index is written by the next flush
    assert index.read_bytes() == original
    assert not list(tmp_path.glob("*.quarantined"))


def test_open_removes_leftover_temp_and_orphan_index_files(
    tmp_path: Path, open_log: Opener
) -> None:
    log = open_log(tmp_path)
    records = fill(log, random.Random(24), 30)
    log.close()
    before = snapshot(tmp_path)
    (tmp_path / f"{0:020d}.index.tmp").write_bytes(b"half an index")
    (tmp_path / f"{10**9:020d}.index").write_bytes(b"index of a deleted segment")
    log = open_log(tmp_path)
    assert snapshot(tmp_path) == before
    assert read_all(log) == records


def test_closed_log_raises_log_closed_error(tmp_path: Path) -> None:
    with PartitionLog.open(tmp_path, config()) as log:
        records = fill(log, random.Random(25), 3)
    log.close()  # closing twice is fine
    calls: list[Callable[[], object]] = [
        lambda: log.append(encode_batch([b"x"], timestamps=T0), leader_epoch=1),
        lambda: log.read(0, 100),
        lambda: log.offset_for_timestamp(T0),
        lambda: log.truncate_to(0),
        lambda: log.delete_segments_before(10),
        log.flush,
        log.prepare_flush,
        log.roll,
    ]
    for call in calls:
        with pytest.raises(LogClosedError) as exc:
            call()
        assert exc.value.retriable
    with PartitionLog.open(tmp_path, config()) as log:
        assert read_all(log) == records


# ---- group commit -----------------------------------------------------------------------


def test_group_commit_always_shares_fsyncs(tmp_path: Path) -> None:
    rng = random.Random(26)
    batches = [produce(rng, count=2, value_size=50) for _ in range(200)]

    async def main() -> list[Any]:
        log = PartitionLog.open(tmp_path, config(fsync_policy="always"))
        g = GroupCommitLog(log)
        await g.start()
        try:

            async def one(data: bytes) -> Any:
                info = await g.append(data, leader_epoch=1)
                assert log.flushed_offset > info.last_offset  # on disk when acknowledged
                return info

            infos = await asyncio.gather(*(one(p.data) for p in batches))
            assert 1 <= g.fsyncs < 200
            assert log.flushed_offset == log.log_end_offset == 400
            assert len(log.segments) >= 3
            assert all(s.index_path.exists() for s in log.segments[:-1])
            return infos
        finally:
            await g.close()

    infos = asyncio.run(main())
    assert sorted(i.base_offset for i in infos) == list(range(0, 400, 2))
    expected = [r for i, p in zip(infos, batches, strict=True) for r in p.records(i.base_offset)]
    with PartitionLog.open(tmp_path, config()) as log:
        assert read_all(log) == sorted(expected, key=lambda r: r.offset)


def test_group_commit_appends_during_an_fsync_share_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    real_run = FlushJob.run

    def gated_run(job: FlushJob) -> None:
        started.set()
        if not release.wait(30):
            raise TimeoutError("the test never released the fsync")
        real_run(job)

    monkeypatch.setattr(FlushJob, "run", gated_run)
    rng = random.Random(27)
    batches = [produce(rng, count=1, value_size=20).data for _ in range(51)]

    async def main() -> None:
        log = PartitionLog.open(tmp_path, config(fsync_policy="always"))
        g = GroupCommitLog(log)
        try:
            first = asyncio.create_task(g.append(batches[0], leader_epoch=1))
            assert await asyncio.to_thread(started.wait, 30)
            rest = [asyncio.create_task(g.append(b, leader_epoch=1)) for b in batches[1:]]
            await asyncio.sleep(0)  # one turn: every append is in the log, waiting
            assert log.log_end_offset == 51 and log.flushed_offset == 0
            assert not first.done() and not any(t.done() for t in rest)
            release.set()
            await asyncio.gather(first, *rest)
            assert g.fsyncs == 2  # the one in flight, then one for all 50 latecomers
            assert log.flushed_offset == 51
        finally:
            release.set()
            await g.close()

    asyncio.run(main())


def test_group_commit_interval_ticker_flushes(tmp_path: Path) -> None:
    rng = random.Random(28)

    async def main() -> None:
        log = PartitionLog.open(tmp_path, config(fsync_policy="interval", fsync_interval_ms=10))
        caught_up = asyncio.Event()
        complete_flush = log.complete_flush

        def complete(job: FlushJob, error: BaseException | None = None) -> None:
            complete_flush(job, error)
            if log.flushed_offset == log.log_end_offset:
                caught_up.set()

        log.complete_flush = complete  # type: ignore[method-assign]
        g = GroupCommitLog(log)
        await g.start()
        try:
            for round_ in range(2):
                caught_up.clear()
                for _ in range(20):
                    await g.append(produce(rng).data, leader_epoch=1)
                # appends return at once, before any fsync covers them
                assert log.flushed_offset < log.log_end_offset
                async with asyncio.timeout(10):
                    await caught_up.wait()
                assert log.flushed_offset == log.log_end_offset
                assert g.fsyncs >= round_ + 1
        finally:
            await g.close()

    asyncio.run(main())


def test_group_commit_never_flushes_only_on_flush_and_close(tmp_path: Path) -> None:
    rng = random.Random(29)
    records: list[Record] = []

    async def main() -> PartitionLog:
        # an hour between ticks: the background flush of sealed segments cannot interfere
        log = PartitionLog.open(tmp_path, config(fsync_policy="never", fsync_interval_ms=3_600_000))
        g = GroupCommitLog(log)
        await g.start()
        try:
            for _ in range(30):
                p = produce(rng)
                info = await g.append(p.data, leader_epoch=1)
                records.extend(p.records(info.base_offset))
            for _ in range(10):
                await asyncio.sleep(0)  # turns of the loop: nothing flushes by itself
            assert len(log.segments) >= 2
            assert log.flushed_offset == 0 and g.fsyncs == 0
            await g.flush()
            assert log.flushed_offset == log.log_end_offset and g.fsyncs == 1
            for _ in range(5):
                p = produce(rng)
                info = await g.append(p.data, leader_epoch=1)
                records.extend(p.records(info.base_offset))
            assert log.flushed_offset < log.log_end_offset
        finally:
            await g.close()
        return log

    log = asyncio.run(main())
    assert log.flushed_offset == log.log_end_offset == len(records)
    with PartitionLog.open(tmp_path, config()) as log:
        assert read_all(log) == records


def test_group_commit_fsync_failure_fails_every_waiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(30)
    batches = [produce(rng, count=1, value_size=20).data for _ in range(10)]

    def broken_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def main() -> None:
        log = PartitionLog.open(tmp_path, config(fsync_policy="always"))
        g = GroupCommitLog(log)
        monkeypatch.setattr(os, "fsync", broken_fsync)
        try:
            results = await asyncio.gather(
                *(g.append(b, leader_epoch=1) for b in batches), return_exceptions=True
            )
            assert all(isinstance(r, StorageError) for r in results), results
            with pytest.raises(StorageError, match="fenced"):
                await g.append(batches[0], leader_epoch=1)
        finally:
            await g.close()

    asyncio.run(main())


def test_truncate_while_a_flush_job_runs(tmp_path: Path, open_log: Opener) -> None:
    log = open_log(tmp_path, config(fsync_policy="never"))
    records = fill(log, random.Random(15), 40, count=3)
    assert len(log.segments) >= 3
    job = log.prepare_flush()
    assert job is not None
    cut = log.segments[1].base_offset
    assert log.truncate_to(cut) == cut
    job.run()  # fsyncs the deleted segments' still-open files without error
    log.complete_flush(job)
    assert read_all(log) == records[:cut]
    log.close()
    log = open_log(tmp_path)
    assert log.log_end_offset == cut
    assert read_all(log) == records[:cut]


def test_group_commit_never_flushes_sealed_segments_in_the_background(tmp_path: Path) -> None:
    """Under ``never`` the ticker fsyncs sealed segments and writes their index files, and
    leaves the active segment to the OS."""
    rng = random.Random(31)

    async def main() -> None:
        log = PartitionLog.open(tmp_path, config(fsync_policy="never", fsync_interval_ms=10))
        sealed_flushed = asyncio.Event()
        complete_flush = log.complete_flush

        def complete(job: FlushJob, error: BaseException | None = None) -> None:
            complete_flush(job, error)
            if not log.has_unflushed_sealed_segment:
                sealed_flushed.set()

        log.complete_flush = complete  # type: ignore[method-assign]
        g = GroupCommitLog(log)
        await g.start()
        try:
            while len(log.segments) < 3:
                await g.append(produce(rng).data, leader_epoch=1)
            assert log.has_unflushed_sealed_segment
            async with asyncio.timeout(10):
                await sealed_flushed.wait()
            for seg in log.segments[:-1]:
                assert seg.index_path.exists()
        finally:
            await g.close()

    asyncio.run(main())


def test_waiting_for_records_truncated_away_raises(tmp_path: Path) -> None:
    rng = random.Random(32)

    async def main() -> None:
        log = PartitionLog.open(tmp_path, config(fsync_policy="always"))
        g = GroupCommitLog(log)
        try:
            await g.append(produce(rng).data, leader_epoch=1)
            info = log.append(produce(rng).data, leader_epoch=1)
            log.truncate_to(info.base_offset)
            with pytest.raises(StorageError, match="truncated"):
                await g.wait_durable(info.last_offset + 1)
        finally:
            await g.close()

    asyncio.run(main())


def test_a_header_checked_by_the_caller_is_trusted_only_for_its_own_bytes(
    tmp_path: Path, open_log: Opener
) -> None:
    """``append(checked=...)`` skips the second CRC pass of a batch the caller just verified,
    but a header that does not describe these very bytes (another size) buys no trust."""
    from storage.codec import check_batch

    log = open_log(tmp_path)
    rng = random.Random(33)
    good = produce(rng, count=3, value_size=200)
    header = check_batch(good.data)
    info = log.append(good.data, leader_epoch=1, checked=header)
    assert read_all(log) == good.records(info.base_offset)

    other = produce(rng, count=5, value_size=300).data
    bad = _flip(other, len(other) - 9)
    before = snapshot(tmp_path)
    with pytest.raises(CorruptBatchError):
        log.append(bad, leader_epoch=1, checked=header)  # header of other bytes: checked anyway
    assert snapshot(tmp_path) == before


def test_reads_among_batches_appended_after_the_file_was_mapped(
    open_log: Opener, tmp_path: Path
) -> None:
    """A reader a few batches behind the log end (a consumer, a follower, the delay
    scheduler) walks headers appended since the segment file was last mapped: they are read
    with ``pread`` where the mapping does not reach, and every read returns the batches a
    read of the whole file would; the file is not mapped again for them."""
    rng = random.Random(5)
    log = open_log(tmp_path, config(segment_bytes=1 << 30))  # one segment
    records = fill(log, rng, 20)
    assert log.read(0, 1).batch_count == 1  # maps the file as it is now
    seg = log.active
    mapped = seg._map
    records += fill(log, rng, 60)
    end = log.log_end_offset
    for offset in range(0, end, 3):
        one = log.read(offset, 1)
        first = read_header(one.data)
        assert first.base_offset <= offset < first.base_offset + first.record_count
        rest = log.read(offset, 1 << 30)
        assert rest.next_offset == end
        assert [r.value for r in decode(rest.data)] == [
            r.value for r in records if r.offset >= first.base_offset
        ]
    assert seg._map is mapped
