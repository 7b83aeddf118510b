"""Hosting many partitions at once (``PartitionManager.apply`` run concurrently).

New partition directories share the data directory's fsync, and their ``partition.metadata``
and first segment are made durable by one fsync of the new directory (``docs/format.md``).
Checked under the power-loss model: after every unsynced byte and name is dropped, each
partition that was hosted has its directory, its ``partition.metadata`` and an empty log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from broker_agents.partitions import PartitionManager
from storage.config import FsyncPolicy
from storage.metadata import PartitionState
from storage.metadata.models import TopicSpec
from storage.wal import PartitionLog, crashfs, fileio
from storage.wal.agent import AgentWal, WalPartition
from storage.wal.agent.journal import WAL_DIRECTORY
from storage.wal.partition_meta import read_topic_id

TOPIC = "many"
PARTITIONS = 64


class CountingFileSystem(crashfs.RecordingFileSystem):
    def __init__(self, journal_dir: Path, data_dir: Path) -> None:
        super().__init__(journal_dir)
        self.data_dir = data_dir
        self.data_dir_fsyncs = 0

    def fsync_dir(self, path: Path) -> None:
        if path == self.data_dir:
            self.data_dir_fsyncs += 1
        super().fsync_dir(path)


def sole_leader(pm: PartitionManager, topic_id: str) -> PartitionState:
    """A partition state with agent 1 (``pm``'s) as leader and only replica."""
    return PartitionState(
        leader=1,
        leader_epoch=0,
        replicas=[1],
        isr=[1],
        controller_epoch=1,
        incarnations={1: pm.incarnation},
        topic_id=topic_id,
    )


def host_all(data: Path, spec: TopicSpec) -> int:
    """Apply a leader state for every partition at once; returns how many were hosted (the
    caller installs the recording file system and puts its own back)."""

    async def run() -> int:
        pm = PartitionManager(1, data)
        pm.session_ok = True
        state = sole_leader(pm, spec.topic_id)
        try:
            await asyncio.gather(
                *(pm.apply(TOPIC, p, state, spec.config) for p in range(PARTITIONS))
            )
            return sum(p.role == "leader" for p in pm.partitions.values())
        finally:
            # the power is cut now: what the close fsyncs is not recorded, so it counts for
            # nothing in the model, and only what hosting made durable is kept
            fileio.set_file_system(fileio.FileSystem())
            await pm.close()

    return asyncio.run(run())


def test_partitions_hosted_together_survive_a_power_loss(tmp_path: Path) -> None:
    data, journal = tmp_path / "data", tmp_path / "journal"
    crashfs.start_recording(data, journal)
    spec = TopicSpec.build(
        name=TOPIC, partitions=PARTITIONS, replication_factor=1, topic_id="id-1", created_ms=0
    )
    fs = CountingFileSystem(journal, data)
    old = fileio.set_file_system(fs)
    try:
        hosted = host_all(data, spec)
    finally:
        fileio.set_file_system(old)
    assert hosted == PARTITIONS
    # the new directories' names shared fsyncs of the data directory
    assert 1 <= fs.data_dir_fsyncs < PARTITIONS
    crashfs.drop_unsynced(journal)  # every name and byte not covered by an fsync is gone
    for p in range(PARTITIONS):
        directory = data / f"{TOPIC}-{p}"
        assert read_topic_id(directory) == "id-1", directory
        assert (directory / "00000000000000000000.log").exists(), directory
        with PartitionLog.open(directory, spec.config.log_config()) as log:
            assert log.log_end_offset == 0
            assert [s.path.name for s in log.segments] == ["00000000000000000000.log"]


def test_auto_wal_mode_puts_topics_of_many_partitions_and_the_overflow_on_the_agent_wal(
    tmp_path: Path,
) -> None:
    """``wal.mode=auto``: an ``always`` partition keeps its own group commit unless its topic
    has more than ``wal.auto.topic.partitions`` partitions, or ``wal.auto.max.own.commits``
    hosted partitions already fsync their own files; ``interval`` topics are always on the
    WAL. A closed partition gives its place back."""

    def spec(name: str, partitions: int, policy: str) -> TopicSpec:
        return TopicSpec.build(
            name=name,
            partitions=partitions,
            replication_factor=1,
            topic_id=f"id-{name}",
            created_ms=0,
            config={"fsync.policy": policy},
        )

    async def run() -> None:
        pm = PartitionManager(1, tmp_path / "data")
        pm.session_ok = True
        pm.wal = AgentWal(tmp_path / "data" / WAL_DIRECTORY)
        pm.wal.open()
        pm.wal_policies = frozenset({FsyncPolicy.INTERVAL})
        pm.wal_auto = (8, 6)  # topics of more than 8 partitions; at most 6 own commits

        async def host(s: TopicSpec, partitions: range) -> list[bool]:
            state = sole_leader(pm, s.topic_id)
            for p in partitions:  # one at a time: the cap counts in order
                await pm.apply(s.name, p, state, s.config, s.topic_id, -1, s.partitions)
            return [
                isinstance(pm.partitions[(s.name, p)].committer, WalPartition) for p in partitions
            ]

        try:
            few, many = spec("few", 4, "always"), spec("many", 9, "always")
            assert await host(few, range(4)) == [False] * 4
            assert await host(many, range(9)) == [True] * 9  # 9 > 8: the whole topic
            assert await host(spec("ticks", 2, "interval"), range(2)) == [True, True]
            # two more own commits fit under the cap of 6, the rest go on the WAL
            other = spec("other", 4, "always")
            assert await host(other, range(4)) == [False, False, True, True]
            await pm.apply("few", 0, None, None)  # the topic is gone here: a place is free
            assert ("few", 0) not in pm.partitions
            last = spec("last", 2, "always")
            assert await host(last, range(2)) == [False, True]
        finally:
            await pm.close()
            await pm.wal.close()

    asyncio.run(run())
