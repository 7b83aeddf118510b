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
from storage.metadata import PartitionState
from storage.metadata.models import TopicSpec
from storage.wal import PartitionLog, crashfs, fileio
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


def host_all(data: Path, spec: TopicSpec) -> int:
    """Apply a leader state for every partition at once; returns how many were hosted (the
    caller installs the recording file system and puts its own back)."""

    async def run() -> int:
        pm = PartitionManager(1, data)
        pm.session_ok = True
        state = PartitionState(
            leader=1,
            leader_epoch=0,
            replicas=[1],
            isr=[1],
            controller_epoch=1,
            incarnations={1: pm.incarnation},
            topic_id=spec.topic_id,
        )
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
