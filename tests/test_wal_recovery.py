"""Crash safety of the write-ahead log: torn tails are cut, corruption is quarantined (never
skipped), a writer killed mid-append loses nothing it acknowledged, and random operation
sequences agree with a list-of-records model."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.codec import decode_batches, iter_batches
from storage.config import LogConfig
from storage.errors import CorruptSegmentError, InvalidOffsetError
from storage.wal import PartitionLog, crashfs, fileio
from tests import wal_writer
from tests.wal_support import T0, Record, config, decode, produce, read_all

WRITER = Path(__file__).with_name("wal_writer.py")


def build(
    directory: Path, seed: int, batches: int, **kwargs: Any
) -> tuple[list[Record], list[Any]]:
    """A closed log (fsync always) of ``batches`` random batches: its records and AppendInfos."""
    rng = random.Random(seed)
    records: list[Record] = []
    infos = []
    with PartitionLog.open(directory, config()) as log:
        for _ in range(batches):
            p = produce(rng, **kwargs)
            info = log.append(p.data, leader_epoch=1)
            log.flush()
            records.extend(p.records(info.base_offset))
            infos.append(info)
    return records, infos


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(data)


# ---- torn tail ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["cut", "zeros", "random"])
def test_torn_last_batch_is_cut_back_at_every_byte(tmp_path: Path, damage: str) -> None:
    original = tmp_path / "original"
    rng = random.Random(1)
    with PartitionLog.open(original, config()) as log:
        records: list[Record] = []
        for _ in range(14):
            p = produce(rng, count=3, value_size=rng.randint(100, 700))
            records += p.records(log.append(p.data, leader_epoch=1).base_offset)
        last = produce(rng, count=3, value_size=40)
        info = log.append(last.data, leader_epoch=1)
        assert len(log.segments) >= 3 and log.active.size > len(last.data)
    segment = segment_files(original)[-1]
    good = segment.read_bytes()
    start = len(good) - len(last.data)
    stored_last = good[start:]
    assert 200 <= len(stored_last) <= 400

    work = tmp_path / "work"
    for k in range(len(stored_last)):
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(original, work)
        path = work / segment.name
        if damage == "cut":
            os.truncate(path, start + k)
            torn = True
        else:
            if damage == "zeros":
                tail = bytes(len(stored_last) - k)
            else:
                tail = bytearray(rng.randbytes(len(stored_last) - k))
                tail[0] = stored_last[k] ^ rng.randint(1, 255)
            with open(path, "r+b") as f:
                f.seek(start + k)
                f.write(tail)
            torn = tail != stored_last[k:]  # zeros over the padding change nothing

        with PartitionLog.open(work, config()) as log:
            if torn:
                assert log.log_end_offset == info.base_offset, k
                assert path.read_bytes() == good[:start], k
                assert read_all(log) == records, k
                assert log.append(last.data, leader_epoch=1).base_offset == info.base_offset
            else:
                assert log.log_end_offset == info.last_offset + 1, k
                assert read_all(log) == records + last.records(info.base_offset), k
        assert not list(work.glob("*.quarantined")), k


# ---- corruption is quarantined, never skipped -------------------------------------------


def assert_quarantined(directory: Path, segment: Path, exc: CorruptSegmentError) -> None:
    quarantined = segment.with_name(segment.name + ".quarantined")
    assert exc.path == str(quarantined)
    assert quarantined.exists() and not segment.exists()
    assert not segment.with_suffix(".index").exists()
    assert not exc.retriable
    # and on every later open too, whatever the options
    for verify_all in (False, True):
        with pytest.raises(CorruptSegmentError):
            PartitionLog.open(directory, config(), verify_all=verify_all)
    assert quarantined.exists()


@pytest.mark.parametrize("where", [16, 20, 24, 100, -1])
def test_corrupt_batch_in_the_middle_of_the_active_segment(tmp_path: Path, where: int) -> None:
    _, infos = build(tmp_path, seed=2, batches=40, count=2, value_size=150)
    segments = segment_files(tmp_path)
    assert len(segments) >= 3
    active = segments[-1]
    base = int(active.name[:-4])
    in_active = [i for i in infos if i.base_offset >= base]
    assert len(in_active) >= 3
    victim = in_active[1]  # a batch with valid batches after it
    position = in_active[0].size
    flip(active, position + (where if where >= 0 else victim.size + where))
    damaged = active.read_bytes()

    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config())
    assert exc.value.position == position
    assert active.with_name(active.name + ".quarantined").read_bytes() == damaged
    assert_quarantined(tmp_path, active, exc.value)
    assert all(s.exists() for s in segments[:-1])


def test_corrupt_sealed_segment_is_found_by_verify_all(tmp_path: Path) -> None:
    build(tmp_path, seed=3, batches=40, count=2, value_size=150)
    sealed = segment_files(tmp_path)[1]
    assert sealed.with_suffix(".index").exists()
    flip(sealed, 300)  # inside the CRC region of the segment's first or second batch
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config(), verify_all=True)
    assert_quarantined(tmp_path, sealed, exc.value)


def test_corrupt_sealed_segment_without_index_is_scanned(tmp_path: Path) -> None:
    build(tmp_path, seed=4, batches=40, count=2, value_size=150)
    sealed = segment_files(tmp_path)[1]
    sealed.with_suffix(".index").unlink()
    flip(sealed, 300)
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config())
    assert_quarantined(tmp_path, sealed, exc.value)


@pytest.mark.parametrize("field", [0, 9, 16])
def test_damaged_header_past_the_last_index_entry_of_a_sealed_segment(
    tmp_path: Path, field: int
) -> None:
    # the index is trusted, but the headers after its last entry are walked: a damaged one
    # (base offset, length, magic) is corruption like any other
    build(tmp_path, seed=5, batches=40, count=2, value_size=150)
    sealed = segment_files(tmp_path)[1]
    position = [p for _, p in iter_batches(sealed.read_bytes())][-1]
    assert position > 0
    flip(sealed, position + field)
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config())
    assert_quarantined(tmp_path, sealed, exc.value)


def test_torn_sealed_segment_is_corruption_not_a_tail(tmp_path: Path) -> None:
    build(tmp_path, seed=6, batches=40, count=2, value_size=150)
    sealed = segment_files(tmp_path)[1]
    os.truncate(sealed, sealed.stat().st_size - 30)
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config())
    assert_quarantined(tmp_path, sealed, exc.value)


def test_missing_segment_in_the_middle_is_corruption(tmp_path: Path) -> None:
    build(tmp_path, seed=7, batches=40, count=2, value_size=150)
    segments = segment_files(tmp_path)
    segments[1].unlink()
    segments[1].with_suffix(".index").unlink()
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config())
    assert_quarantined(tmp_path, segments[2], exc.value)


# ---- a torn tail across segments (policies that do not fsync at a roll) ---------------


@pytest.mark.parametrize("policy", ["interval", "never"])
def test_power_loss_mid_flush_with_rolls_behind_it_cuts_the_tail_not_the_partition(
    tmp_path: Path, policy: str
) -> None:
    # Found by tests/test_power_loss.py in CI: a flush job fsyncs the segments it snapshotted,
    # then the directory. Segments rolled while it ran are in that directory fsync by name,
    # without their predecessor's unsynced end. After the power loss the log must open at
    # the last fsynced record, not quarantine the segment past the gap.
    data, journal = tmp_path / "data", tmp_path / "journal"
    crashfs.start_recording(data, journal)
    previous = fileio.set_file_system(crashfs.RecordingFileSystem(journal))
    rng = random.Random(11)
    records: list[Record] = []
    try:
        log = PartitionLog.open(data / "p-0", config(fsync_policy=policy))
        for _ in range(60):
            p = produce(rng, count=2, value_size=150)
            records.extend(p.records(log.append(p.data, leader_epoch=1).base_offset))
        job = log.prepare_flush()
        assert job is not None
        durable = job.end_offset
        while len(log.segments) < len(job.segments) + 3:  # rolls while the job "runs"
            p = produce(rng, count=2, value_size=150)
            records.extend(p.records(log.append(p.data, leader_epoch=1).base_offset))
        job.run()
        log.complete_flush(job)
        assert log.flushed_offset == durable < log.log_end_offset
    finally:
        fileio.set_file_system(previous)
    crashfs.drop_unsynced(journal)  # the power loss (the log object is simply abandoned)

    with PartitionLog.open(data / "p-0", config(fsync_policy=policy)) as log:
        assert log.log_end_offset >= durable
        assert read_all(log) == records[: log.log_end_offset]
        end = log.log_end_offset
        p = produce(rng, count=2, value_size=150)  # and it takes writes after them
        assert log.append(p.data, leader_epoch=2).base_offset == end
    assert not list((data / "p-0").glob("*.quarantined"))


def cut_tail_across_segments(directory: Path, keep_index_of_next: bool) -> tuple[int, Path]:
    """Give ``directory`` a power loss's shape: the last three segments lose their index
    files, the first of them is cut after its first batch and the next one is emptied.
    Returns the offset where the cut segment now ends and the emptied segment."""
    segments = segment_files(directory)
    assert len(segments) >= 4
    short, emptied = segments[-3], segments[-2]
    for seg in segments[-3:]:
        seg.with_suffix(".index").unlink(missing_ok=True)
    (header, _), (_, second) = list(iter_batches(short.read_bytes()))[:2]
    os.truncate(short, second)
    emptied.write_bytes(b"")
    if keep_index_of_next:
        emptied.with_suffix(".index").write_bytes(b"")
    return header.next_offset, emptied


def test_segments_past_a_torn_tail_are_removed(tmp_path: Path) -> None:
    records, _ = build(tmp_path, seed=12, batches=60, count=2, value_size=150)
    end, emptied = cut_tail_across_segments(tmp_path, keep_index_of_next=False)
    with PartitionLog.open(tmp_path, config(fsync_policy="interval")) as log:
        assert log.log_end_offset == end
        assert read_all(log) == records[:end]
        assert [s.path for s in log.segments] == segment_files(tmp_path)
        assert not emptied.exists() and log.segments[-1].path.stat().st_size > 0
    with PartitionLog.open(tmp_path, config()) as log:  # the next open finds nothing to cut
        assert log.log_end_offset == end


def test_the_last_segment_keeps_its_torn_tail_cut_even_with_a_stale_index(tmp_path: Path) -> None:
    # a sealed segment whose successor could not be created is reopened as the active one
    # with its index file still there; appends go on, and its torn tail is still a tail
    records, _ = build(tmp_path, seed=14, batches=60, count=2, value_size=150)
    active = segment_files(tmp_path)[-1]
    active.with_suffix(".index").write_bytes(
        segment_files(tmp_path)[-2].with_suffix(".index").read_bytes()
    )
    with active.open("ab") as f:
        f.write(b"\x00" * 20)  # bytes of an append that never completed
    with PartitionLog.open(tmp_path, config(fsync_policy="interval")) as log:
        assert read_all(log) == records
    assert not list(tmp_path.glob("*.quarantined"))


def test_a_short_segment_before_an_indexed_one_is_corruption(tmp_path: Path) -> None:
    # an index is written only after an fsync covered its segment and every one before it:
    # a short segment before an indexed one was not torn by a crash
    build(tmp_path, seed=13, batches=60, count=2, value_size=150)
    _, emptied = cut_tail_across_segments(tmp_path, keep_index_of_next=True)
    with pytest.raises(CorruptSegmentError) as exc:
        PartitionLog.open(tmp_path, config(fsync_policy="interval"))
    assert_quarantined(tmp_path, emptied, exc.value)


# ---- a writer killed with SIGKILL --------------------------------------------------------


@pytest.mark.parametrize("acks", [25, 150, 300])
def test_writer_killed_mid_append_loses_nothing_acknowledged(tmp_path: Path, acks: int) -> None:
    directory = tmp_path / "log"
    with open(tmp_path / "stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(directory)], stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        assert proc.stdout is not None
        acked = -1
        for _ in range(acks):
            line = proc.stdout.readline()
            if not line.endswith(b"\n"):
                pytest.fail(f"writer exited ({proc.wait()}): {(tmp_path / 'stderr').read_text()}")
            acked = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        for line in proc.stdout:  # what it acknowledged between our last read and the kill
            if line.endswith(b"\n"):
                acked = int(line)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    writer_config = LogConfig.parse(wal_writer.CONFIG)
    with PartitionLog.open(directory, writer_config) as log:
        end = log.log_end_offset
        assert log.log_start_offset == 0 and end > acked
        got = [(r.offset, r.timestamp, r.key, r.value) for r in read_all(log)]
        assert got == wal_writer.expected_records(end)
    assert not list(directory.glob("*.quarantined"))
    offsets: list[int] = []
    for path in segment_files(directory):  # only whole, valid batches are left on disk
        offsets += decode_batches(path.read_bytes(), verify=True).column("offset").to_pylist()
    assert offsets == list(range(end))
    with PartitionLog.open(directory, writer_config) as log:  # and it stays that way
        assert log.log_end_offset == end


# ---- random operations against a model ----------------------------------------------------


class LogMachine(RuleBasedStateMachine):
    """Appends, rolls, flushes, truncations, deletions and reopens against a list of records."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="wal-model-"))
        self.config = config(segment_bytes=4096, index_interval_bytes=256)
        self.log = PartitionLog.open(self.directory, self.config, start_offset=10)
        self.records: list[Record] = []
        self.bases: list[int] = []  # base offsets of the batches in the model
        self.start = self.end = 10
        self.seed = 0

    def teardown(self) -> None:
        self.log.close()
        shutil.rmtree(self.directory)

    @rule(count=st.integers(1, 6), size=st.integers(0, 900), ts=st.integers(-50, 50))
    def append(self, count: int, size: int, ts: int) -> None:
        self.seed += 1
        p = produce(random.Random(self.seed), count=count, value_size=size, ts=T0 + ts, jitter=5)
        info = self.log.append(p.data, leader_epoch=1)
        assert info.base_offset == self.end
        self.bases.append(self.end)
        self.records += p.records(self.end)
        self.end += count

    @rule()
    def roll(self) -> None:
        self.log.roll()

    @rule()
    def flush(self) -> None:
        assert self.log.flush() == self.end

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(max(0, self.start - 2), self.end + 2), label="offset")
        if offset < self.start:
            with pytest.raises(InvalidOffsetError):
                self.log.truncate_to(offset)
            return
        if offset < self.end:
            event("truncate inside the log")
            self.end = max(b for b in self.bases if b <= offset)
            self.bases = [b for b in self.bases if b < self.end]
            self.records = self.records[: self.end - self.start]
        segments = len(self.log.segments)
        assert self.log.truncate_to(offset) == self.end
        if len(self.log.segments) < segments:
            event("truncate deleted segments")

    @rule(data=st.data())
    def delete_before(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.start, self.end + 2), label="offset")
        if data.draw(st.booleans(), label="flush first"):
            self.log.flush()
        deleted = self.log.delete_segments_before(offset)
        start = self.log.log_start_offset
        if deleted:
            event("deleted segments")
            assert deleted[0] == self.start and start <= offset
            assert start in self.bases or start == self.end
        else:
            assert start == self.start
        self.records = self.records[start - self.start :]
        self.bases = [b for b in self.bases if b >= start]
        self.start = start

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self.log = PartitionLog.open(self.directory, self.config)

    @precondition(lambda self: self.end > self.start)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.start, self.end - 1), label="offset")
        max_bytes = data.draw(st.integers(0, 10_000), label="max_bytes")
        s = self.log.read(offset, max_bytes)
        assert s.batch_count >= 1 and s.first_offset in self.bases
        assert s.first_offset <= offset < s.next_offset
        assert s.batch_count == 1 or len(s) <= max_bytes
        assert (
            decode(s.data) == self.records[s.first_offset - self.start : s.next_offset - self.start]
        )

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert (self.log.log_start_offset, self.log.log_end_offset) == (self.start, self.end)
        assert read_all(self.log) == self.records
        event(f"segments: {min(len(self.log.segments), 4)}")


LogMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_operations_agree_with_a_model = LogMachine.TestCase
