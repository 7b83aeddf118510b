"""Replication with real agents: acks=all through repeated leader kills, a zombie leader, ISR
limits. Three agents, RF=3, min.insync.replicas=2, ZooKeeper session timeout 4 s."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest

from sdk import Consumer, Producer, TopicPartition
from storage.codec import decode_batch, encode_batch, iter_batches
from storage.errors import (
    NotEnoughReplicasError,
    NotLeaderError,
    RequestTimedOutError,
    StrataError,
)
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient, check_acknowledged, fetch_values, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot

TOPIC = "ledger"


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.start(3)
    return c


def _state(cluster: Cluster, partition: int = 0) -> m.PartitionMetadata:
    md = cluster.metadata([TOPIC])
    return next(p for p in md.topics[0].partitions if p.partition == partition)


def _wait_isr(
    cluster: Cluster, size: int, partition: int = 0, timeout: float = 30
) -> m.PartitionMetadata:
    deadline = time.monotonic() + timeout
    while True:
        st = _state(cluster, partition)
        live = {a.agent_id for a in cluster.alive()}
        if st.error_code == 0 and st.leader_id in live and len(st.isr) == size:
            return st
        assert time.monotonic() < deadline, f"ISR did not reach {size}: {st}"
        time.sleep(0.05)


def _log_values(directory: Path) -> list[bytes]:
    """Values in an agent's log files, read-only (the agent owns them)."""
    values: list[bytes] = []
    for path in sorted(directory.glob("*.log")):
        data = path.read_bytes()
        try:
            for _, pos in iter_batches(data):
                values += decode_batch(data, pos).column("value").to_pylist()
        except StrataError:
            break
    return values


async def _consume_everything(bootstrap: str, partitions: int) -> dict[int, pa.Table]:
    tables: dict[int, list[pa.Table]] = {p: [] for p in range(partitions)}
    async with Consumer(
        {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}
    ) as consumer:
        tps = [TopicPartition(TOPIC, p) for p in range(partitions)]
        ends = await consumer.end_offsets(tps)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        got = 0
        async with asyncio.timeout(60):
            while got < sum(ends.values()):
                for tp, table in (await consumer.getmany_arrow(timeout_ms=500)).items():
                    tables[tp.partition].append(table)
                    got += table.num_rows
    return {p: pa.concat_tables(ts) for p, ts in tables.items() if ts}


def test_acks_all_survives_five_leader_kills(cluster: Cluster) -> None:
    partitions = 2
    cluster.create_topic(TOPIC, partitions, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    acked: dict[bytes, tuple[int, int]] = {}
    kills = 0

    async def run() -> None:
        nonlocal kills
        config = {
            "bootstrap.servers": cluster.bootstrap,
            "acks": "all",
            "linger.ms": 1,
            "retry.backoff.ms": 50,
            "request.timeout.ms": 4000,
            "delivery.timeout.ms": 120_000,
        }
        async with Producer(config) as producer:
            stop = asyncio.Event()

            async def produce() -> None:
                seq = 0
                pending: list[tuple[bytes, asyncio.Future[object]]] = []
                while not stop.is_set():
                    value = b"%08d" % seq
                    pending.append(
                        (value, await producer.send(TOPIC, value, key=b"k%d" % (seq % 8)))
                    )
                    seq += 1
                    await asyncio.sleep(0.002)  # a steady rate across the kills
                for value, fut in pending:
                    meta = await fut
                    acked[value] = (meta.partition, meta.offset)  # type: ignore[attr-defined]

            task = asyncio.create_task(produce())
            for _ in range(5):
                # every partition back to a full ISR first: killing the leader of one whose
                # ISR is still that leader alone would (rightly) leave it without a leader
                for p in range(partitions):
                    await asyncio.to_thread(_wait_isr, cluster, 3, p)
                victim = (await asyncio.to_thread(_state, cluster)).leader_id
                cluster.kill(victim)
                kills += 1
                await asyncio.to_thread(cluster.wait_for_leaders, TOPIC, exclude={victim})
                await asyncio.to_thread(cluster.start_agent, victim)
            await asyncio.to_thread(_wait_isr, cluster, 3)
            stop.set()
            await task

    asyncio.run(run())
    assert kills == 5 and len(acked) > 500

    tables = asyncio.run(_consume_everything(cluster.bootstrap, partitions))
    duplicates = check_acknowledged(tables, acked)
    print(f"{len(acked)} acknowledged, {duplicates} duplicates, {kills} leader kills")
    # the idempotent producer's retries (after lost acknowledgements, onto new leaders) were
    # recognised: the new leader knows the producer's last batches from the replicated headers
    assert duplicates == 0


def test_a_zombie_leader_acknowledges_nothing_and_truncates_its_divergent_tail(
    cluster: Cluster,
) -> None:
    cluster.create_topic(TOPIC, 1, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    _wait_isr(cluster, 3)

    async def produce_to(agent_id: int, values: list[bytes]) -> m.ProducePartitionResult:
        a = cluster.agents[agent_id]
        resp = await WireClient.call_once(
            a.host,
            a.port,
            m.ApiKey.PRODUCE,
            produce_request(TOPIC, 0, encode_batch(values), acks=-1),
        )
        result: m.ProducePartitionResult = resp.topics[0].partitions[0]
        return result

    # the first write goes where a client's would: to the leader, again after NOT_LEADER (a
    # retriable refusal that appended nothing), as the controller's start-up may still be
    # rewriting the new partition's state (a CI run saw one at this point)
    deadline = time.monotonic() + 30
    while True:
        zombie = _state(cluster).leader_id
        first = asyncio.run(produce_to(zombie, [b"a1", b"a2"]))
        if first.error_code != NotLeaderError.code or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert first.error_code == 0, first
    handle = cluster.agents[zombie]

    async def scenario() -> m.ProducePartitionResult:
        client = await WireClient.connect(handle.host, handle.port)
        try:
            cluster.kill(zombie, signal.SIGSTOP)
            try:
                # queued in the socket while the leader is frozen: it runs the moment it thaws,
                # before the agent has noticed that it lost its session and its leadership
                cid = await client.send(
                    m.ApiKey.PRODUCE,
                    produce_request(TOPIC, 0, encode_batch([b"zombie"]), acks=-1, timeout_ms=8000),
                )
                st = await asyncio.to_thread(
                    cluster.wait_for_leaders, TOPIC, exclude={zombie}, timeout=30
                )
                new_leader = st[0].leader_id
                assert (await produce_to(new_leader, [b"b1", b"b2"])).error_code == 0
            finally:
                cluster.kill(zombie, signal.SIGCONT)
            frame = await client.receive(wait_s=30)
            assert frame.correlation_id == cid
            return m.ProduceResponse.decode(frame.body).topics[0].partitions[0]
        finally:
            await client.close()

    result = asyncio.run(scenario())
    assert result.error_code != 0, f"a zombie acknowledged a write: {result}"

    # the zombie rejoins as a follower: its log converges on the new leader's, without "zombie"
    new_leader = _state(cluster).leader_id
    assert new_leader != zombie
    deadline = time.monotonic() + 30
    leader_dir = cluster.data_root / f"agent-{new_leader}" / f"{TOPIC}-0"
    zombie_dir = cluster.data_root / f"agent-{zombie}" / f"{TOPIC}-0"
    while True:
        expected = _log_values(leader_dir)
        if _log_values(zombie_dir) == expected:
            break
        assert time.monotonic() < deadline, (_log_values(zombie_dir), expected)
        time.sleep(0.1)
    assert expected == [b"a1", b"a2", b"b1", b"b2"]
    _wait_isr(cluster, 3)


def test_acks_all_needs_min_insync_replicas_while_acks_1_still_works(cluster: Cluster) -> None:
    cluster.create_topic(TOPIC, 1, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    st = _wait_isr(cluster, 3)
    leader = cluster.agents[st.leader_id]
    for follower in st.replicas:
        if follower != st.leader_id:
            cluster.stop(follower)
    _wait_isr(cluster, 1)

    async def run() -> tuple[m.ProducePartitionResult, m.ProducePartitionResult]:
        client = await WireClient.connect(leader.host, leader.port)
        try:
            all_ = await client.call(
                m.ApiKey.PRODUCE, produce_request(TOPIC, 0, encode_batch([b"all"]), acks=-1)
            )
            one = await client.call(
                m.ApiKey.PRODUCE, produce_request(TOPIC, 0, encode_batch([b"one"]), acks=1)
            )
            return all_.topics[0].partitions[0], one.topics[0].partitions[0]
        finally:
            await client.close()

    all_result, one_result = asyncio.run(run())
    assert all_result.error_code == NotEnoughReplicasError.code
    assert one_result.error_code == 0

    # with an ISR of one, the high watermark is the log end
    assert fetch_values(leader, TOPIC) == [b"one"]


def test_acks_all_answers_request_timed_out_while_an_in_sync_follower_is_frozen(
    cluster: Cluster,
) -> None:
    """A frozen follower (SIGSTOP) stays in the ISR until its session expires, so the high
    watermark cannot cover a new batch: acks=all answers REQUEST_TIMED_OUT after the request's
    timeout_ms, well before the session expiry would have let the ISR shrink."""
    cluster.create_topic(TOPIC, 1, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    st = _wait_isr(cluster, 3)
    leader = cluster.agents[st.leader_id]
    frozen = next(r for r in st.replicas if r != st.leader_id)
    cluster.kill(frozen, signal.SIGSTOP)
    try:

        async def run() -> tuple[m.ProducePartitionResult, float]:
            client = await WireClient.connect(leader.host, leader.port)
            try:
                started = time.monotonic()
                resp = await client.call(
                    m.ApiKey.PRODUCE,
                    produce_request(TOPIC, 0, encode_batch([b"late"]), acks=-1, timeout_ms=300),
                )
                return resp.topics[0].partitions[0], time.monotonic() - started
            finally:
                await client.close()

        result, took = asyncio.run(run())
    finally:
        cluster.kill(frozen, signal.SIGCONT)
    assert result.error_code == RequestTimedOutError.code
    assert "300 ms" in (result.error_message or "")
    assert 0.3 <= took < 3.0


def _reassign(cluster: Cluster, partition: int, target: list[int]) -> None:
    from storage.metadata import AsyncZooKeeper, MetadataStore

    async def run() -> None:
        zk = AsyncZooKeeper(cluster.zk.connect_string)
        await zk.start()
        try:
            await MetadataStore(zk).request_reassignment(TOPIC, partition, target)
        finally:
            await zk.stop()

    asyncio.run(run())


def test_moving_a_partition_onto_a_new_agent_under_load_loses_nothing(cluster: Cluster) -> None:
    cluster.create_topic(TOPIC, 1, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    before = _wait_isr(cluster, 3)
    cluster.start_agent(4)
    # replace the current leader by the new agent: leadership has to move too
    target = [4] + [r for r in before.replicas if r != before.leader_id]
    acked: list[tuple[float, bytes, int]] = []

    async def run() -> None:
        config = {
            "bootstrap.servers": cluster.bootstrap,
            "acks": "all",
            "linger.ms": 1,
            "retry.backoff.ms": 20,
            "request.timeout.ms": 4000,
        }
        async with Producer(config) as producer:
            stop = asyncio.Event()

            async def produce() -> None:
                seq = 0
                while not stop.is_set():
                    value = b"%08d" % seq
                    fut = await producer.send(TOPIC, value, partition=0)
                    fut.add_done_callback(
                        lambda f, v=value: acked.append((time.monotonic(), v, f.result().offset))
                    )
                    seq += 1
                    await asyncio.sleep(0.003)
                await producer.flush()

            task = asyncio.create_task(produce())
            await asyncio.sleep(0.5)  # traffic before the move
            await asyncio.to_thread(_reassign, cluster, 0, target)
            deadline = time.monotonic() + 60
            while True:
                st = await asyncio.to_thread(_state, cluster)
                if sorted(st.replicas) == sorted(target) and st.leader_id == 4 and len(st.isr) == 3:
                    break
                assert time.monotonic() < deadline, f"reassignment did not complete: {st}"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # traffic after the move
            stop.set()
            await task

    asyncio.run(run())
    # the removed agent dropped its copy; the new one has everything
    assert not (cluster.data_root / f"agent-{before.leader_id}" / f"{TOPIC}-0").exists()
    tables = asyncio.run(_consume_everything(cluster.bootstrap, 1))
    consumed = dict(
        zip(
            tables[0].column("offset").to_pylist(),
            tables[0].column("value").to_pylist(),
            strict=True,
        )
    )
    for _, value, offset in acked:
        assert consumed[offset] == value
    times = sorted(t for t, _, _ in acked)
    gap = max(b - a for a, b in itertools.pairwise(times))
    assert gap < 5.0, f"acknowledgements stopped for {gap:.1f} s"
    print(f"{len(acked)} acknowledged across the move, longest gap {gap * 1000:.0f} ms")


def test_a_follower_that_catches_up_rejoins_the_isr_on_its_fetch(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """A restarted follower goes back into the ISR on the fetch that brings it up to the high
    watermark, as in Kafka, not on the leader's next ISR tick (half
    ``replica.lag.time.max.ms``): until then acks=all is one failure from unavailable. The
    tick here is 60 s, far past the deadline below."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    slow_tick = "replica.lag.time.max.ms=120000"
    for agent_id in (1, 2, 3):
        cluster.start_agent(agent_id, slow_tick)
    cluster.create_topic(TOPIC, 1, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(TOPIC)
    st = _wait_isr(cluster, 3)
    follower = next(r for r in st.replicas if r != st.leader_id)
    cluster.stop(follower)
    _wait_isr(cluster, 2)  # the controller takes it out when its session ends

    async def produce() -> None:
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as p:
            for i in range(50):
                await p.send(TOPIC, b"while-away-%d" % i, partition=0)
            await p.flush()

    asyncio.run(produce())  # the follower has records to catch up on
    cluster.start_agent(follower, slow_tick)
    st = _wait_isr(cluster, 3, timeout=20)
    assert follower in st.isr
