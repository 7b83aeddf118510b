"""Three agents on a three-server ZooKeeper ensemble: kill -9 the ZooKeeper leader, then lose
the quorum for 30 s, under an idempotent acks=all producer that never stops.

What users rely on, checked at the end against the partitions' logs as the leaders serve them
and against every replica's files:

* nothing acknowledged is lost: every acknowledged (partition, offset) holds exactly the
  record acknowledged for it — two agents acknowledging writes for one partition in the same
  period (split brain) would give two records one offset, and one of them would be missing or
  elsewhere;
* nothing is stored twice (the producer is idempotent; its retries across the faults must not
  duplicate);
* every replica holds the same records below the high watermark, and each partition's leader
  epochs never go down along its log;
* service returns: acknowledgements resume after each fault, and afterwards the controller
  still acts (a new topic gets leaders; an agent killed with -9 loses its partitions to
  in-sync replicas). Every agent's connection is suspended through both faults, the
  controller's included; its session survives, and it must take up its seat again
  (``MetadataStore.try_become_controller``) rather than wait for its own node to go away.

While the quorum is lost no agent has a confirmed session, so none acknowledges a write: no
leader can change either, so there is nothing to fence, but an agent cannot tell a lost
quorum from being cut off alone, and refuses (``docs/operations.md``).

The recovery times (fault end to the first acknowledgement of a record sent after it) are
printed; ``docs/operations.md`` (*Fault table*) quotes them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.zookeeper import ZooKeeperEnsemble
from sdk import Producer, RecordMetadata
from storage.codec import decode_batch, iter_batches
from storage.errors import StrataError
from storage.protocol import messages as m
from tests.cluster import SESSION_TIMEOUT_MS, Cluster, WireClient, fetch_request
from tests.harness import ProcessGroup, ZooKeeperChroot

pytestmark = pytest.mark.slow

TOPIC = "ledger"
PARTITIONS = 6
QUORUM_LOSS_S = 30.0
RECOVERY_BOUND_S = SESSION_TIMEOUT_MS / 1000 + 20
"""Acknowledgements must resume this soon after a fault ends (a liveness bound, not a figure:
the measured times are printed)."""


@dataclass
class Ledger:
    """What the producer sent and what was acknowledged, with monotonic times."""

    sent_at: dict[bytes, float] = field(default_factory=dict)
    acked: dict[bytes, RecordMetadata] = field(default_factory=dict)
    acked_at: dict[bytes, float] = field(default_factory=dict)
    failed: dict[bytes, BaseException] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, value: bytes, fut: asyncio.Future[RecordMetadata]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self.acked[value] = fut.result()
            self.acked_at[value] = time.monotonic()
        else:
            self.failed[value] = exc
        self.changed.set()

    def first_ack_sent_after(self, t: float) -> float | None:
        """When the first record sent after ``t`` was acknowledged (None: not yet)."""
        times = [self.acked_at[v] for v in self.acked_at if self.sent_at[v] > t]
        return min(times) if times else None

    async def wait_first_ack_sent_after(self, t: float, within_s: float) -> float:
        """Seconds from ``t`` to the first acknowledgement of a record sent after ``t``."""
        async with asyncio.timeout(within_s):
            while (acked := self.first_ack_sent_after(t)) is None:
                self.changed.clear()
                await self.changed.wait()
        return acked - t

    def acks_between(self, start: float, end: float) -> int:
        return sum(start <= t < end for t in self.acked_at.values())

    def longest_pause(self, start: float, end: float) -> float:
        """The longest time without an acknowledgement that overlaps [start, end]."""
        times = sorted(self.acked_at.values())
        return max(
            (b - a for a, b in itertools.pairwise(times) if b >= start and a <= end),
            default=end - start,
        )


async def _produce_steadily(producer: Producer, ledger: Ledger, stop: asyncio.Event) -> None:
    """About 150 records a second, each value unique, spread over the partitions by key."""
    i = 0
    while not stop.is_set():
        value = b"r%07d" % i
        ledger.sent_at[value] = time.monotonic()
        fut = await producer.send(TOPIC, value, key=b"k%d" % (i % 30))
        fut.add_done_callback(lambda f, v=value: ledger.record(v, f))
        i += 1
        await asyncio.sleep(0.005)  # pacing: a steady rate through every fault


@dataclass(frozen=True)
class Recovery:
    fault: str
    seconds: float
    detail: str


async def _faults(cluster: Cluster, ensemble: ZooKeeperEnsemble) -> tuple[Ledger, list[Recovery]]:
    ledger = Ledger()
    recoveries: list[Recovery] = []
    config = {
        "bootstrap.servers": cluster.bootstrap,
        "acks": "all",
        "linger.ms": 5,
        "request.timeout.ms": 5000,
        "delivery.timeout.ms": 120_000,
        "retry.backoff.ms": 50,
        "retry.backoff.max.ms": 500,
    }
    async with Producer(config) as producer:
        stop = asyncio.Event()
        producing = asyncio.create_task(_produce_steadily(producer, ledger, stop))
        try:
            await ledger.wait_first_ack_sent_after(time.monotonic(), 30)

            # a) kill -9 the ZooKeeper leader: the two others elect a new one
            zk_leader = ensemble.leader()
            assert zk_leader is not None
            killed_at = time.monotonic()
            await asyncio.to_thread(ensemble.kill, zk_leader)
            new_leader = await asyncio.to_thread(ensemble.wait_for_quorum, timeout=30)
            elected = time.monotonic() - killed_at
            await ledger.wait_first_ack_sent_after(time.monotonic(), RECOVERY_BOUND_S)
            recoveries.append(
                Recovery(
                    "ZooKeeper leader kill -9",
                    ledger.longest_pause(killed_at, time.monotonic()),
                    f"longest pause in acks; server {zk_leader} killed, server {new_leader} "
                    f"leads {_secs(elected)} later",
                )
            )
            await asyncio.to_thread(ensemble.start, zk_leader)  # three members again

            # b) lose the quorum: stop the leader and one follower for 30 s
            zk_leader = ensemble.leader()
            assert zk_leader is not None
            follower = next(i for i in ensemble.server_ids if i != zk_leader)
            lost_at = time.monotonic()
            await asyncio.to_thread(ensemble.stop, zk_leader)
            await asyncio.to_thread(ensemble.stop, follower)
            await asyncio.sleep(QUORUM_LOSS_S)  # the fault's length: no event to wait for
            restarted_at = time.monotonic()
            await asyncio.to_thread(ensemble.start, zk_leader, follower, wait=False)
            await asyncio.to_thread(ensemble.wait_for_quorum, timeout=60)
            back_at = time.monotonic()
            await ledger.wait_first_ack_sent_after(back_at, RECOVERY_BOUND_S)
            first_ack = min(t for t in ledger.acked_at.values() if t > restarted_at)
            # without a quorum no agent has a confirmed session: none acknowledges (what was
            # accepted just before the loss may finish its acks=all wait: 5 s of grace)
            refused = ledger.acks_between(lost_at + 5, restarted_at)
            assert refused == 0, f"{refused} writes acknowledged without a ZooKeeper quorum"
            recoveries.append(
                Recovery(
                    "ZooKeeper quorum lost for 30 s",
                    first_ack - restarted_at,
                    f"from the restart of servers {zk_leader} and {follower} to the first ack; "
                    f"the quorum was back after {_secs(back_at - restarted_at)}, the first "
                    f"ack {_secs(first_ack - back_at)} after that; "
                    f"longest pause in acks "
                    f"{_secs(ledger.longest_pause(lost_at, first_ack))}",
                )
            )
            # steady again: a few hundred more acknowledgements after the recovery
            steady = time.monotonic()
            while ledger.acks_between(steady, time.monotonic() + 1) < 300:
                ledger.changed.clear()
                async with asyncio.timeout(30):
                    await ledger.changed.wait()
        finally:
            stop.set()
            await producing
        await producer.flush()
    return ledger, recoveries


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s"


def _read_log(
    cluster: Cluster, partition: int, until: int
) -> tuple[list[tuple[int, int, bytes]], int]:
    """(offset, leader epoch, value) of every record of ``partition`` from its leader, once
    its high watermark has reached ``until``; and the high watermark."""
    deadline = time.monotonic() + 30
    while True:
        leaders = cluster.wait_for_leaders(TOPIC)
        agent = cluster.agents[leaders[partition].leader_id]
        records: list[tuple[int, int, bytes]] = []
        hw = -1
        offset = 0
        while True:
            resp = asyncio.run(
                WireClient.call_once(
                    agent.host,
                    agent.port,
                    m.ApiKey.FETCH,
                    fetch_request(TOPIC, partition, offset, max_bytes=4 << 20),
                )
            )
            r = resp.topics[0].partitions[0]
            if r.error_code != 0:
                break
            hw = r.high_watermark
            if r.records is None or len(r.records) == 0:
                break
            for header, pos in iter_batches(r.records):
                values = decode_batch(r.records, pos).column("value").to_pylist()
                for i, value in enumerate(values):
                    if header.base_offset + i >= offset:
                        records.append((header.base_offset + i, header.leader_epoch, value))
                offset = header.next_offset
            if offset >= hw:
                break
        if hw >= until and offset >= hw:
            return [r for r in records if r[0] < hw], hw
        assert time.monotonic() < deadline, f"partition {partition}: high watermark {hw} < {until}"
        time.sleep(0.1)


def _replica_values(directory: Path) -> list[bytes]:
    """Values in a live agent's log files, read-only (an append in progress ends the read)."""
    values: list[bytes] = []
    for path in sorted(directory.glob("*.log")):
        data = path.read_bytes()
        try:
            for _, pos in iter_batches(data):
                values += decode_batch(data, pos).column("value").to_pylist()
        except StrataError:
            break
    return values


def _check_logs(cluster: Cluster, ledger: Ledger) -> dict[int, list[tuple[int, int, bytes]]]:
    last_acked: dict[int, int] = defaultdict(lambda: -1)
    for meta in ledger.acked.values():
        last_acked[meta.partition] = max(last_acked[meta.partition], meta.offset)
    logs = {}
    for p in range(PARTITIONS):
        records, hw = _read_log(cluster, p, last_acked[p] + 1)
        assert [o for o, _, _ in records] == list(range(hw)), f"partition {p}: offsets have gaps"
        epochs = [e for _, e, _ in records]
        assert epochs == sorted(epochs), f"partition {p}: leader epochs go down along the log"
        logs[p] = records
    stored: dict[tuple[int, int], bytes] = {
        (p, o): v for p, records in logs.items() for o, _, v in records
    }
    for value, meta in ledger.acked.items():
        assert stored.get((meta.partition, meta.offset)) == value, (
            f"acknowledged {value!r} at {meta.partition}:{meta.offset}, "
            f"stored {stored.get((meta.partition, meta.offset))!r}"
        )
    values = [v for v in stored.values()]
    assert len(values) == len(set(values)), "a record is stored twice"
    assert set(values) <= set(ledger.sent_at), "a record nobody sent"
    # every replica holds the same records below the high watermark
    for p, records in logs.items():
        expected = [v for _, _, v in records]
        for agent_id in cluster.agents:
            directory = cluster.data_root / f"agent-{agent_id}" / f"{TOPIC}-{p}"
            deadline = time.monotonic() + 20
            while len(got := _replica_values(directory)) < len(expected):
                assert time.monotonic() < deadline, f"agent {agent_id} lags on partition {p}"
                time.sleep(0.1)
            assert got[: len(expected)] == expected, f"agent {agent_id} diverges on {p}"
    return logs


def test_zookeeper_leader_kill_then_quorum_loss_loses_nothing_and_service_returns(
    processes: ProcessGroup,
    zk_ensemble: ZooKeeperEnsemble,
    zk_ensemble_chroot: ZooKeeperChroot,
    tmp_path: Path,
) -> None:
    cluster = Cluster(processes, zk_ensemble_chroot, tmp_path / "data")
    cluster.start(3)
    cluster.create_topic(TOPIC, PARTITIONS, 3)
    cluster.wait_for_leaders(TOPIC)

    epochs_before = {p: md.leader_epoch for p, md in cluster.wait_for_leaders(TOPIC).items()}
    ledger, recoveries = asyncio.run(_faults(cluster, zk_ensemble))
    epochs_after = {p: md.leader_epoch for p, md in cluster.wait_for_leaders(TOPIC).items()}
    print(f"leader epochs before the faults {epochs_before}, after {epochs_after}")
    for r in recoveries:
        print(f"recovery after {r.fault}: {r.seconds:.2f} s ({r.detail})")
    print(
        f"{len(ledger.sent_at)} records sent, {len(ledger.acked)} acknowledged, "
        f"{len(ledger.failed)} failed"
    )
    assert not ledger.failed, next(iter(ledger.failed.values()))
    _check_logs(cluster, ledger)

    # the controller still acts: a new topic gets leaders, a killed agent loses its partitions
    cluster.create_topic("after-faults", 3, 3)
    cluster.wait_for_leaders("after-faults")
    victim = cluster.wait_for_leaders(TOPIC)[0].leader_id
    cluster.kill(victim)
    cluster.wait_for_leaders(TOPIC, exclude={victim}, timeout=SESSION_TIMEOUT_MS / 1000 + 10)
