"""The agent WAL (``storage.wal.agent``): one fsync a round whatever the partition count,
power loss and torn tails recovered by replay, a bounded WAL.

The power-loss cases run the real files under ``storage.wal.crashfs`` (which records what
each fsync made durable and can drop the rest, as a power cut would).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from storage.codec import HEADER_SIZE, check_batch
from storage.codec.parts import BatchParts
from storage.errors import CorruptSegmentError
from storage.wal import PartitionLog, crashfs, fileio
from storage.wal.agent import AgentWal, AgentWalConfig, WalPartition, journal, replay
from storage.wal.agent.format import FRAME, MAGIC, file_name, read_frames
from storage.wal.agent.journal import WAL_DIRECTORY
from storage.wal.fileio import FileSystem
from storage.wal.partition_meta import write_topic_id
from tests.wal_support import Record, config, produce, read_all


class CountingFileSystem(FileSystem):
    """The real file system, counting fsyncs per file name (a wrapper, not a fake)."""

    def __init__(self, inner: FileSystem) -> None:
        self.inner = inner
        self.fsyncs: dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        if name in ("inner", "fsyncs", "fsync"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "inner"), name)

    def fsync(self, fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        kind = "wal" if name.endswith(".wal") else "partition"
        self.fsyncs[kind] = self.fsyncs.get(kind, 0) + 1
        self.inner.fsync(fd)


class NoFsync(FileSystem):
    """The real file system without fsyncs (for loops that check logic, not durability)."""

    def __init__(self, inner: FileSystem) -> None:
        self.inner = inner

    def __getattribute__(self, name: str) -> Any:
        if name in ("inner", "fsync", "fsync_dir"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "inner"), name)

    def fsync(self, fd: int) -> None:
        return None

    def fsync_dir(self, path: Path) -> None:
        return None


def open_logs(data: Path, n: int, policy: str = "always") -> list[PartitionLog]:
    logs = []
    for i in range(n):
        d = data / f"t-{i}"
        log = PartitionLog.open(d, config(fsync_policy=policy, segment_bytes=1 << 16))
        write_topic_id(d, "id-t")
        logs.append(log)
    return logs


async def produce_round(
    fronts: list[WalPartition], rng: random.Random, expected: dict[int, list[Record]]
) -> None:
    """One batch to every partition at once, each acknowledged as the policy says."""

    async def one(i: int, front: WalPartition) -> None:
        b = produce(rng, count=2, value_size=100)
        if i % 2:  # as the Kafka listener appends: the batch in pieces, never joined
            info = front.log.append(b.data, leader_epoch=1)
        else:
            parts = in_parts(b.data, rng)
            info = front.log.append(parts, leader_epoch=1, checked=parts.header)
        await front.wait_acknowledgeable(info.last_offset + 1)
        expected[i].extend(b.records(info.base_offset))

    await asyncio.gather(*(one(i, f) for i, f in enumerate(fronts)))


def in_parts(batch: bytes, rng: random.Random) -> BatchParts:
    """``batch`` cut in three at random points past its header."""
    a = rng.randint(HEADER_SIZE, len(batch))
    b = rng.randint(a, len(batch))
    view = memoryview(batch)
    return BatchParts(check_batch(batch), (view[:a], view[a:b], view[b:]))


def test_one_fsync_covers_a_round_over_every_partition(tmp_path: Path) -> None:
    counting = CountingFileSystem(fileio.fs)
    old = fileio.set_file_system(counting)
    try:

        async def main() -> tuple[int, int, int]:
            wal = AgentWal(tmp_path / WAL_DIRECTORY)
            wal.open()
            logs = open_logs(tmp_path, 256)
            fronts = [await wal.register(log, "id-t") for log in logs]
            counting.fsyncs.clear()
            rng = random.Random(1)
            expected: dict[int, list[Record]] = {i: [] for i in range(256)}
            for _ in range(5):
                await produce_round(fronts, rng, expected)
            got = dict(counting.fsyncs)
            for f in fronts:
                await f.close()
            await wal.close()
            return got.get("wal", 0), got.get("partition", 0), wal.fsyncs

        wal_fsyncs, partition_fsyncs, counted = asyncio.run(main())
    finally:
        fileio.set_file_system(old)
    # 5 rounds of 256 partitions, each acknowledged only after an fsync: a handful of WAL
    # fsyncs (one per round, or one more when a round straddles one), no partition fsync
    assert wal_fsyncs == counted
    assert 5 <= wal_fsyncs <= 10
    assert partition_fsyncs == 0
    assert not list((tmp_path / WAL_DIRECTORY).glob("*.wal")), "a graceful close leaves no WAL"


def build_history(
    data: Path, rng: random.Random, *, rounds: int, wal_config: AgentWalConfig | None = None
) -> tuple[dict[int, list[Record]], AgentWal]:
    """Appends (always), truncations and a restart over 6 partitions, every one acknowledged;
    the process then "dies": nothing is closed."""

    async def main() -> tuple[dict[int, list[Record]], AgentWal]:
        wal = AgentWal(data / WAL_DIRECTORY, wal_config)
        wal.open()
        fronts = [await wal.register(log, "id-t") for log in open_logs(data, 6)]
        expected: dict[int, list[Record]] = {i: [] for i in range(6)}
        for r in range(rounds):
            await produce_round(fronts, rng, expected)
            if r % 7 == 3:  # a follower cutting its divergent tail
                f = fronts[r % 6]
                cut = expected[r % 6][len(expected[r % 6]) // 2].offset
                cut = f.log.truncate_to(cut)
                expected[r % 6] = [x for x in expected[r % 6] if x.offset < cut]
            if r == rounds // 2:  # a follower restarted past its leader's log start
                f = fronts[5]
                f.log.restart_at(f.log.log_end_offset + 10)
                expected[5] = []
            if wal_config is not None and r % 5 == 4 and r < rounds - 3:
                await wal.checkpoint()
        await wal.sync()
        return expected, wal

    return asyncio.run(main())


def test_power_loss_keeps_everything_acknowledged(tmp_path: Path) -> None:
    data, journal = tmp_path / "data", tmp_path / "journal"
    data.mkdir()
    crashfs.start_recording(data, journal)
    old = fileio.set_file_system(crashfs.RecordingFileSystem(journal))
    try:
        # small files and checkpoints on: replay starts from a checkpoint's anchors
        expected, _ = build_history(
            data,
            random.Random(7),
            rounds=40,
            wal_config=AgentWalConfig(segment_bytes=8192, max_bytes=1 << 20),
        )
    finally:
        fileio.set_file_system(old)
    crashfs.drop_unsynced(journal)  # the power cut: every unsynced byte of every file is gone
    result = replay(data / WAL_DIRECTORY, data)
    assert result.batches_appended > 0, "the partition files lost data only the WAL held"
    for i, records in expected.items():
        with PartitionLog.open(data / f"t-{i}", config()) as log:
            got = read_all(log)
            assert got == records, f"partition {i}"
            offsets = [r.offset for r in got]
            assert offsets == list(range(log.log_start_offset, log.log_end_offset))
    assert not list((data / WAL_DIRECTORY).glob("*.wal")), "replayed WAL is removed"


def wal_files(data: Path) -> list[Path]:
    return sorted((data / WAL_DIRECTORY).glob("*.wal"))


def test_a_torn_wal_tail_is_cut_at_every_byte_of_its_last_frame(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    rng = random.Random(3)
    expected, wal = build_history(base, rng, rounds=6)

    # one more round in its own frame: 6 partitions, one batch each
    async def last_round() -> list[tuple[int, bytes, int]]:
        logs = [PartitionLog.open(base / f"t-{i}", config()) for i in range(6)]
        wal2 = AgentWal(base / WAL_DIRECTORY)
        wal2._seq = wal._seq  # continue the same file sequence, as a restart would not
        wal2._fd = os.open(wal_files(base)[-1], os.O_RDWR)
        wal2._file_size = os.fstat(wal2._fd).st_size
        fronts = [await wal2.register(log, "id-t") for log in logs]
        await wal2.sync()
        out = []
        for i, f in enumerate(fronts[:2]):
            b = produce(rng, count=1, value_size=8)
            info = f.log.append(b.data, leader_epoch=2)
            out.append((i, b.data, info.base_offset))
        await wal2.sync()
        return out

    asyncio.run(last_round())
    path = wal_files(base)[-1]
    whole = path.read_bytes()
    frames, end, error = read_frames(whole)
    assert error is None and end == len(whole)
    last = frames[-1]
    assert last.position + last.size == len(whole)
    # (every byte: hundreds of replays, each fsyncing what it writes; the fsyncs are not
    # what this test checks, so the loop runs on a file system that skips them)
    old = fileio.set_file_system(NoFsync(fileio.fs))
    try:
        for cut in range(last.position, len(whole)):
            check_cut(tmp_path, base, path, whole, cut, last.position, expected)
    finally:
        fileio.set_file_system(old)


def check_cut(
    tmp_path: Path,
    base: Path,
    path: Path,
    whole: bytes,
    cut: int,
    frame_start: int,
    expected: dict[int, list[Record]],
) -> None:
    work = tmp_path / f"cut-{cut}"
    shutil.copytree(base, work)
    (work / WAL_DIRECTORY / path.name).write_bytes(whole[:cut])
    # the partition files lost the last round too (it never reached their disk)
    for i in range(6):
        with PartitionLog.open(work / f"t-{i}", config()) as log:
            keep = expected[i][-1].offset + 1 if expected[i] else log.log_start_offset
            if log.log_end_offset > keep:
                log.truncate_to(max(keep, log.log_start_offset))
    result = replay(work / WAL_DIRECTORY, work)
    assert result.torn_bytes == cut - frame_start
    for i in range(6):
        with PartitionLog.open(work / f"t-{i}", config()) as log:
            assert read_all(log) == expected[i], (cut, i)
    shutil.rmtree(work)


def test_damage_before_the_last_file_is_corruption_not_a_tail(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    build_history(data, random.Random(5), rounds=12, wal_config=AgentWalConfig(segment_bytes=4096))
    files = wal_files(data)
    assert len(files) >= 2
    raw = bytearray(files[0].read_bytes())
    assert int.from_bytes(raw[4:6], "little") == MAGIC
    raw[FRAME.size + 2] ^= 0xFF  # inside the first frame's table
    files[0].write_bytes(bytes(raw))
    with pytest.raises(CorruptSegmentError):
        replay(data / WAL_DIRECTORY, data)


def test_replay_skips_deleted_partitions_and_other_incarnations(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    expected, _ = build_history(data, random.Random(9), rounds=5)
    shutil.rmtree(data / "t-0")  # the topic was deleted...
    shutil.rmtree(data / "t-1")
    with PartitionLog.open(data / "t-1", config()):  # ...and t-1 created again, empty
        write_topic_id(data / "t-1", "id-new")
    for i in (2, 3):  # the other partitions lost their files' tails
        with PartitionLog.open(data / f"t-{i}", config()) as log:
            log.truncate_to(log.log_start_offset)
    result = replay(data / WAL_DIRECTORY, data)
    assert sorted(result.skipped) == ["t-0", "t-1"]
    assert not (data / "t-0").exists()
    with PartitionLog.open(data / "t-1", config()) as log:
        assert log.log_end_offset == 0
    for i in (2, 3):
        with PartitionLog.open(data / f"t-{i}", config()) as log:
            assert read_all(log) == expected[i]


def test_the_wal_stays_under_its_cap_and_a_checkpoint_empties_it(tmp_path: Path) -> None:
    cap = 256 << 10

    async def main() -> tuple[int, int, int, int]:
        wal = AgentWal(
            tmp_path / WAL_DIRECTORY,
            AgentWalConfig(segment_bytes=32 << 10, max_bytes=cap, fsync_interval_ms=5),
        )
        wal.open()
        ticker = asyncio.create_task(wal.run())
        fronts = [await wal.register(log, "id-t") for log in open_logs(tmp_path, 16)]
        rng = random.Random(2)
        expected: dict[int, list[Record]] = {i: [] for i in range(16)}
        largest = 0
        for _ in range(300):
            await produce_round(fronts, rng, expected)
            largest = max(largest, wal.size_bytes)
            if wal._checkpointing is not None:
                await asyncio.shield(wal._checkpointing)
        checkpoints = wal.checkpoints
        await wal.checkpoint()
        after = wal.size_bytes
        ticker.cancel()
        for f in fronts:
            await f.close()
        await wal.close()
        return largest, checkpoints, after, wal.bytes_written

    largest, checkpoints, after, written = asyncio.run(main())
    assert written > 6 * cap
    assert checkpoints >= written // cap - 1
    # a checkpoint starts at the cap; what arrives while it runs is bounded by one round
    assert largest <= cap + (64 << 10)
    assert after < 32 << 10, "after a checkpoint only the new file's few entries remain"


def test_recover_after_kill_without_power_loss_loses_nothing_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    """A process crash keeps the page cache: partition files already hold everything; replay
    must leave them exactly as they are (no duplicate, no gap)."""
    data = tmp_path / "data"
    data.mkdir()
    expected, _ = build_history(data, random.Random(11), rounds=20)
    replay(data / WAL_DIRECTORY, data)
    for i, records in expected.items():
        with PartitionLog.open(data / f"t-{i}", config()) as log:
            assert read_all(log) == records


def test_replay_keeps_what_the_files_hold_past_the_wals_last_frame(tmp_path: Path) -> None:
    """A reply can leave in the loop turn that appended, before that turn's frame is written;
    a process crash then leaves the batch in the partition's files only. Replay keeps it."""
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(13)
    expected, _ = build_history(data, rng, rounds=8)
    with PartitionLog.open(data / "t-0", config()) as log:  # appended, its frame never written
        b = produce(rng, count=3, value_size=40)
        info = log.append(b.data, leader_epoch=1)
        expected[0].extend(b.records(info.base_offset))
    result = replay(data / WAL_DIRECTORY, data)
    assert result.batches_appended == 0, "the files had every batch the WAL had"
    for i, records in expected.items():
        with PartitionLog.open(data / f"t-{i}", config()) as log:
            assert read_all(log) == records, f"partition {i}"


def test_a_round_past_a_frames_bounds_is_written_as_several_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader refuses a frame of more than MAX_ENTRIES entries as damaged; one loop turn of
    more appends than that goes out as several frames, in order."""
    monkeypatch.setattr(journal, "MAX_ENTRIES", 8)
    rng = random.Random(17)

    async def main() -> dict[int, list[Record]]:
        wal = AgentWal(tmp_path / WAL_DIRECTORY)
        wal.open()
        fronts = [await wal.register(log, "id-t") for log in open_logs(tmp_path, 3)]
        await wal.sync()
        expected: dict[int, list[Record]] = {i: [] for i in range(3)}
        for _ in range(10):  # 30 appends in one loop turn
            for i, f in enumerate(fronts):
                b = produce(rng, count=1, value_size=20)
                info = f.log.append(b.data, leader_epoch=1)
                expected[i].extend(b.records(info.base_offset))
        await wal.sync()
        for f in fronts:  # the files lose everything past the OPEN anchors: only the WAL has it
            f.log.journal = None
            f.log.truncate_to(0)
        return expected

    expected = asyncio.run(main())
    frames, _, error = read_frames(wal_files(tmp_path)[-1].read_bytes())
    assert error is None
    assert len(frames) >= 4 and all(len(f.entries) <= 8 for f in frames)
    replay(tmp_path / WAL_DIRECTORY, tmp_path)
    for i, records in expected.items():
        with PartitionLog.open(tmp_path / f"t-{i}", config()) as log:
            assert read_all(log) == records


def test_frame_name(tmp_path: Path) -> None:
    assert file_name(12) == "00000000000000000012.wal"
