"""A disk that fails under a running agent: an fsync that returns EIO, a disk that fills up.

What must hold (docs/operations.md, *Disk errors*): the agent stops acknowledging (producers
get a typed, retriable error), never takes a failed fsync as having worked (the log is fenced,
and when it is opened again it is first cut back to what was fsynced: fsyncgate), takes the
partition offline here so it leaves the ISR and the controller moves leadership, and takes it
back once the disk works (or has room) again; nothing that was not on disk was acknowledged.

EIO is injected by ``storage.wal.crashfs`` (the fileio seam), whose power-loss model also
keeps the pages a failed fsync did not write lost, as Linux may. A full disk is a real small
tmpfs per agent, filled with a ballast file (removing it gives the space back); where the
machine does not allow a mount, the same seam's byte quota stands in (``SmallDisks.kind``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.errors import StorageError, for_code
from storage.wal import crashfs
from tests.cluster import Cluster
from tests.fault_support import (
    Ledger,
    check_log,
    data_dir,
    journal_dir,
    power_loss,
    produce,
    read_log,
    start_recorded,
    values_on_disk,
)
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "events"
CONFIG = {"fsync.policy": "always", "segment.bytes": 64 << 10, "min.insync.replicas": 2}
NO_GUARD = "log.dir.min.free.bytes=0"  # let the disk really fill (the guard refuses earlier)
#: the fsync that makes the partition's acknowledged records durable fails once: the agent
#: WAL's (wal.mode=agent) or, with wal.mode=partition, the partition files' own
EIO_ONCE = {"agent": [("/wal/", 1)], "partition": [(f"/{TOPIC}-0/", 1)]}
WAL_MODES = ["agent", "partition"]


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    return Cluster(processes, zk_chroot, tmp_path / "data")


def metadata(cluster: Cluster, exclude: set[int] | None = None) -> tuple[int, list[int]]:
    md = cluster.wait_for_leaders(TOPIC, exclude=exclude, timeout=60)[0]
    return md.leader_id, sorted(md.isr)


def wait_isr(cluster: Cluster, isr: list[int], timeout: float = 60) -> int:
    """Poll until partition 0's ISR is ``isr``; returns its leader."""
    deadline = time.monotonic() + timeout
    while True:
        leader, got = metadata(cluster)
        if got == isr:
            return leader
        assert time.monotonic() < deadline, f"ISR {got}, waited for {isr}"
        time.sleep(0.1)


def assert_retriable(errors: list[int]) -> None:
    assert errors, "the failing agent never refused a produce"
    assert all(for_code(c).retriable for c in errors), sorted(set(errors))


def agent_log(cluster: Cluster, agent_id: int) -> str:
    return "".join(
        p.log_text() for p in cluster.processes if p.name.startswith(f"agent-{agent_id}")
    )


# ---------------------------------------------------------------- fsync EIO


@pytest.mark.parametrize("wal", WAL_MODES)
def test_fsync_eio_on_one_agent_fences_reopens_and_acknowledges_nothing_it_lost(
    cluster: Cluster, wal: str
) -> None:
    agent = start_recorded(cluster, 1, f"wal.mode={wal}")
    cluster.create_topic(TOPIC, 1, 1, CONFIG | {"min.insync.replicas": 1})
    cluster.wait_for_leaders(TOPIC)
    ledger = Ledger()
    errors: list[int] = []

    async def run() -> None:
        task = asyncio.create_task(
            produce(agent, TOPIC, 0, ledger, acks=1, batches=1 << 30, timeout_ms=2000)
        )
        await ledger.wait_acked(300)
        crashfs.set_faults(journal_dir(cluster, 1), fsync_eio=EIO_ONCE[wal])
        # the partition is closed, offline, opened again (cut back to its last good fsync),
        # and acknowledges again: the same connection, the same producer
        await ledger.wait_acked(len(ledger.acked) + 300)
        # the fault happened once; a restarted process would read the rule afresh
        crashfs.set_faults(journal_dir(cluster, 1))
        await asyncio.to_thread(power_loss, cluster, 1)
        errors.extend(await task)

    asyncio.run(run())
    assert_retriable(errors)
    assert StorageError.code in errors
    text = agent_log(cluster, 1)
    assert "disk error, closing the partition here" in text
    assert "is offline on this agent" in text
    agent = start_recorded(cluster, 1, f"wal.mode={wal}")
    cluster.wait_for_leaders(TOPIC)
    # the power loss after the fault: every acknowledged record, before and after it, is on
    # the disk (had the reopened log trusted the failed fsync, the bytes it never wrote would
    # sit in the middle of the segment: corruption, and later acknowledged records behind it)
    check_log(asyncio.run(read_log(cluster, TOPIC, 0)), ledger, ledger.acked)


@pytest.mark.parametrize("wal", WAL_MODES)
def test_fsync_eio_on_the_leader_moves_leadership_and_it_rejoins_the_isr(
    cluster: Cluster, wal: str
) -> None:
    for a in (1, 2, 3):
        start_recorded(cluster, a, f"wal.mode={wal}")
    cluster.create_topic(TOPIC, 1, 3, CONFIG)
    leader, _ = metadata(cluster)
    leader = wait_isr(cluster, [1, 2, 3])
    ledger = Ledger()
    injected: list[float] = []

    async def run() -> list[int]:
        task = asyncio.create_task(
            produce(
                cluster.agents[leader], TOPIC, 0, ledger, acks=-1, batches=1 << 30, timeout_ms=2000
            )
        )
        await ledger.wait_acked(300)
        crashfs.set_faults(journal_dir(cluster, leader), fsync_eio=EIO_ONCE[wal])
        injected.append(time.monotonic())
        await asyncio.to_thread(wait_moved, cluster, leader)
        print(f"EIO, RF 3 leader: leadership moved {time.monotonic() - injected[0]:.2f} s later")
        task.cancel()
        result = (await asyncio.gather(task, return_exceptions=True))[0]
        return result if isinstance(result, list) else []

    errors = asyncio.run(run())
    assert all(for_code(c).retriable for c in errors)
    new, _ = metadata(cluster, exclude={leader})
    # the old leader opens the partition again (as a follower, cut back to its last good
    # fsync), catches up and is taken back into the ISR
    assert wait_isr(cluster, [1, 2, 3]) == new
    print(f"EIO, RF 3 leader: ISR full again {time.monotonic() - injected[0]:.2f} s after")
    # reopened after the fence: cut back to its last good fsync, or (when the failed fsync
    # covered nothing of this partition past an earlier one, e.g. a checkpoint's) left whole
    reopened = re.search(
        r"events-0: (cutting the log back from \d+ to \d+|the log ends at \d+, within)",
        agent_log(cluster, leader),
    )
    assert reopened, "the fenced partition was not reopened with its durable end checked"
    assert_left_and_rejoined_the_isr(cluster, leader, new)
    assert not asyncio.run(produce(cluster.agents[new], TOPIC, 0, ledger, acks=-1, batches=50))
    log = asyncio.run(read_log(cluster, TOPIC, 0))
    check_log(log, ledger, ledger.acked)
    _replicas_agree(cluster, [v for _, v in log])


def wait_moved(cluster: Cluster, leader: int) -> None:
    """Poll (60 s) until partition 0 has a leader other than ``leader``."""
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(RuntimeError):
            if cluster.metadata([TOPIC]).topics[0].partitions[0].leader_id not in (leader, -1):
                return
        assert time.monotonic() < deadline, f"agent {leader} still leads"
        time.sleep(0.1)


def assert_left_and_rejoined_the_isr(cluster: Cluster, agent_id: int, new: int) -> None:
    """The controller elected without ``agent_id`` (its offline replica left the ISR), and the
    new leader took it back later. (Both can pass within a fraction of a second, faster than
    metadata can be polled: the agents' own logs are the evidence.)"""
    logs = "".join(agent_log(cluster, a) for a in (1, 2, 3))
    elected = re.search(
        rf"{TOPIC}-0: leader {agent_id} -> {new} \(epoch \d+, ISR (\[[^]]*\])\)", logs
    )
    assert elected and str(agent_id) not in elected.group(1), "no election without it"
    assert re.search(
        rf"{TOPIC}-0: ISR \[[^]]*\] -> \[[^]]*{agent_id}[^]]*\]", agent_log(cluster, new)
    )


def _replicas_agree(cluster: Cluster, want: list[bytes]) -> None:
    deadline = time.monotonic() + 30
    for a in (1, 2, 3):
        while values_on_disk(data_dir(cluster, a) / f"{TOPIC}-0") != want:
            assert time.monotonic() < deadline, f"agent {a} does not hold the leader's log"
            time.sleep(0.05)


# ---------------------------------------------------------------- a full disk


class SmallDisks:
    """A small filesystem per agent data directory: tmpfs mounts if this machine allows them,
    else the fileio seam's byte quota (the agents then run with ``STRATA_CRASHFS``)."""

    SIZE = 64 << 20

    def __init__(self, cluster: Cluster, *, quota: bool) -> None:
        self.cluster = cluster
        self.mounts: list[Path] = []
        probe = cluster.data_root.parent / "mount-probe"
        probe.mkdir(parents=True)
        self.kind = "tmpfs" if not quota and _mount(probe, 1 << 20) else "quota"
        if self.kind == "tmpfs":
            _umount(probe)

    def start(self, agent_id: int, *configs: str) -> None:
        if self.kind == "tmpfs":
            path = data_dir(self.cluster, agent_id)
            path.mkdir(parents=True, exist_ok=True)
            assert _mount(path, self.SIZE), "a tmpfs mount failed after the probe worked"
            self.mounts.append(path)
            self.cluster.start_agent(agent_id, *configs)
        else:
            start_recorded(self.cluster, agent_id, *configs)

    def fill(self, agent_id: int, leave: int) -> None:
        """Leave only ``leave`` bytes free for the agent's data directory."""
        if self.kind == "tmpfs":
            path = data_dir(self.cluster, agent_id)
            st = os.statvfs(path)
            size = st.f_bavail * st.f_frsize - leave
            with open(path / "ballast", "wb") as f:
                f.truncate(0)
                os.posix_fallocate(f.fileno(), 0, size)
        else:
            used = sum(
                p.stat().st_size for p in data_dir(self.cluster, agent_id).rglob("*") if p.is_file()
            )
            crashfs.set_faults(journal_dir(self.cluster, agent_id), quota_bytes=used + leave)

    def free(self, agent_id: int) -> None:
        if self.kind == "tmpfs":
            (data_dir(self.cluster, agent_id) / "ballast").unlink()
        else:
            crashfs.set_faults(journal_dir(self.cluster, agent_id))

    def close(self) -> None:
        for path in self.mounts:
            _umount(path)


def _mount(path: Path, size: int) -> bool:
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _umount(path: Path) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


@pytest.fixture(params=["mount", "quota"])
def disks(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[SmallDisks]:
    """``mount``: a tmpfs per agent where the machine allows it (else the quota as well)."""
    d = SmallDisks(cluster, quota=request.param == "quota")
    try:
        yield d
    finally:
        for a in list(cluster.agents):
            cluster.kill(a)
        d.close()


def test_a_full_disk_on_the_leader_moves_it_out_and_back_when_space_returns(
    cluster: Cluster, disks: SmallDisks
) -> None:
    print(f"small disks: {disks.kind}")
    for a in (1, 2, 3):
        disks.start(a, NO_GUARD)
    cluster.create_topic(TOPIC, 1, 3, CONFIG)
    leader = wait_isr(cluster, [1, 2, 3])
    ledger = Ledger()

    async def run() -> list[int]:
        task = asyncio.create_task(
            produce(
                cluster.agents[leader], TOPIC, 0, ledger, acks=-1, batches=1 << 30, timeout_ms=2000
            )
        )
        await ledger.wait_acked(100)
        await asyncio.to_thread(disks.fill, leader, 256 << 10)
        filled = time.monotonic()
        await asyncio.to_thread(wait_moved, cluster, leader)
        print(f"full disk ({disks.kind}): leadership moved {time.monotonic() - filled:.2f} s later")
        task.cancel()
        result = (await asyncio.gather(task, return_exceptions=True))[0]
        return result if isinstance(result, list) else []

    errors = asyncio.run(run())
    assert all(for_code(c).retriable for c in errors)
    new, _ = metadata(cluster, exclude={leader})
    assert "is offline on this agent" in agent_log(cluster, leader)
    # while its disk is full it stays out (it does not take the partition back without room)
    assert not asyncio.run(produce(cluster.agents[new], TOPIC, 0, ledger, acks=-1, batches=50))
    assert leader not in metadata(cluster)[1]
    disks.free(leader)
    freed = time.monotonic()
    assert wait_isr(cluster, [1, 2, 3]) == new
    print(
        f"full disk ({disks.kind}): ISR full {time.monotonic() - freed:.2f} s after space returned"
    )
    assert_left_and_rejoined_the_isr(cluster, leader, new)
    log = asyncio.run(read_log(cluster, TOPIC, 0))
    check_log(log, ledger, ledger.acked)
    _replicas_agree(cluster, [v for _, v in log])
