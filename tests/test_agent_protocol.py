"""One real agent process, spoken to with raw protocol frames: bad input and long polling.

Every bad input gets a typed error (or, for framing garbage, a closed connection), the agent
keeps serving other clients, and nothing already stored changes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
from pathlib import Path

import pytest

from storage.codec import decode_batches, encode_batch
from storage.errors import (
    BatchTooLargeError,
    CorruptBatchError,
    NotLeaderError,
    OutOfOrderSequenceError,
    UnknownTopicOrPartitionError,
    UnsupportedVersionError,
)
from storage.protocol import encode_request
from storage.protocol import messages as m
from tests.cluster import AgentHandle, Cluster, WireClient, fetch_request, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot, rss_bytes

TOPIC = "events"


@pytest.fixture
def agent(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> AgentHandle:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    handle = cluster.start_agent(1, "socket.request.max.bytes=1048576")
    cluster.create_topic(TOPIC, 2, 1, {"max.message.bytes": 65536})
    cluster.wait_for_leaders(TOPIC)
    return handle


def _stored(agent: AgentHandle, partition: int = 0) -> list[dict[str, object]]:
    async def run() -> list[dict[str, object]]:
        resp = await WireClient.call_once(
            agent.host, agent.port, m.ApiKey.FETCH, fetch_request(TOPIC, partition, 0)
        )
        r = resp.topics[0].partitions[0]
        assert r.error_code == 0
        return [] if r.records is None else decode_batches(r.records).to_pylist()

    return asyncio.run(run())


def _produce(agent: AgentHandle, records: object, partition: int = 0) -> m.ProducePartitionResult:
    async def run() -> m.ProducePartitionResult:
        resp = await WireClient.call_once(
            agent.host, agent.port, m.ApiKey.PRODUCE, produce_request(TOPIC, partition, records)
        )
        result: m.ProducePartitionResult = resp.topics[0].partitions[0]
        return result

    return asyncio.run(run())


def _seed(agent: AgentHandle) -> list[dict[str, object]]:
    result = _produce(agent, encode_batch([b"one", b"two", b"three"], keys=[b"a", b"b", None]))
    assert (result.error_code, result.base_offset) == (0, 0)
    stored = _stored(agent)
    assert [r["value"] for r in stored] == [b"one", b"two", b"three"]
    return stored


def _raw_exchange(agent: AgentHandle, payload: bytes) -> bytes:
    """Send bytes on a fresh socket, half-close, and read whatever comes back until EOF."""
    with socket.create_connection((agent.host, agent.port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # size field = 0x20544547: over the frame limit
        b"\xff\xff\xff\xff" + b"x" * 32,  # negative size
        struct.pack("<i", 3) + b"abc",  # a frame shorter than a request header
    ],
    ids=["http", "negative-size", "short-frame"],
)
def test_framing_garbage_closes_the_connection_and_others_are_served(
    agent: AgentHandle, garbage: bytes
) -> None:
    before = _seed(agent)
    assert _raw_exchange(agent, garbage) == b""  # closed without a response
    assert _stored(agent) == before  # a healthy client is still served, nothing changed


def test_frame_over_the_maximum_size_closes_the_connection(agent: AgentHandle) -> None:
    before = _seed(agent)
    with socket.create_connection((agent.host, agent.port), timeout=10) as s:
        s.sendall(struct.pack("<i", 2 << 20))  # 2 MiB announced, limit is 1 MiB
        s.settimeout(10)
        assert s.recv(1) == b""  # closed as soon as the size was read, nothing buffered
    assert _stored(agent) == before


def test_unknown_api_key_gets_a_typed_error_and_the_connection_stays_usable(
    agent: AgentHandle,
) -> None:
    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            cid = await client.send(99, m.ApiVersionsRequest())
            frame = await client.receive()
            assert frame.correlation_id == cid
            assert isinstance(frame.error(), UnsupportedVersionError)
            cid = await client.send(m.ApiKey.METADATA, m.MetadataRequest(None), version=7)
            assert isinstance((await client.receive()).error(), UnsupportedVersionError)
            versions = await client.call(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest())
            assert {v.api_key for v in versions.api_keys} == set(m.APIS)
        finally:
            await client.close()

    asyncio.run(run())


def test_bad_crc_is_refused_and_the_log_is_unchanged(agent: AgentHandle) -> None:
    before = _seed(agent)
    bad = bytearray(encode_batch([b"evil"]))
    bad[-12] ^= 0xFF
    result = _produce(agent, bytes(bad))
    assert result.error_code == CorruptBatchError.code
    assert "CRC" in (result.error_message or "")
    assert _stored(agent) == before
    ok = _produce(agent, encode_batch([b"four"]))
    assert (ok.error_code, ok.base_offset) == (0, 3)


def test_message_over_max_message_bytes_is_refused(agent: AgentHandle) -> None:
    before = _seed(agent)
    result = _produce(agent, encode_batch([bytes(70_000)]))
    assert result.error_code == BatchTooLargeError.code
    assert _stored(agent) == before


def test_a_retried_idempotent_batch_gets_its_first_offset_and_is_stored_once(
    agent: AgentHandle,
) -> None:
    _seed(agent)

    def idempotent(seq: int, values: list[bytes]) -> bytes:
        return encode_batch(values, producer_id=99, producer_epoch=0, base_sequence=seq)

    first = _produce(agent, idempotent(0, [b"a", b"b"]))
    assert (first.error_code, first.base_offset) == (0, 3)
    again = _produce(agent, idempotent(0, [b"a", b"b"]))  # the response was lost: a retry
    assert (again.error_code, again.base_offset) == (0, 3)
    gap = _produce(agent, idempotent(5, [b"e"]))  # sequences 2-4 never arrived
    assert gap.error_code == OutOfOrderSequenceError.code
    nxt = _produce(agent, idempotent(2, [b"c"]))
    assert (nxt.error_code, nxt.base_offset) == (0, 5)
    assert [r["value"] for r in _stored(agent)] == [b"one", b"two", b"three", b"a", b"b", b"c"]


def test_unknown_topic_or_partition(agent: AgentHandle) -> None:
    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            batch = encode_batch([b"x"])
            for topic, partition in (("nope", 0), (TOPIC, 7)):
                resp = await client.call(m.ApiKey.PRODUCE, produce_request(topic, partition, batch))
                assert resp.topics[0].partitions[0].error_code == UnknownTopicOrPartitionError.code
                resp = await client.call(m.ApiKey.FETCH, fetch_request(topic, partition, 0))
                assert resp.topics[0].partitions[0].error_code == UnknownTopicOrPartitionError.code
            md = await client.call(m.ApiKey.METADATA, m.MetadataRequest(["nope"]))
            assert md.topics[0].error_code == UnknownTopicOrPartitionError.code
        finally:
            await client.close()

    asyncio.run(run())


def test_one_bad_partition_does_not_fail_the_others_in_a_request(agent: AgentHandle) -> None:
    async def run() -> None:
        good = encode_batch([b"good"])
        req = m.ProduceRequest(
            1,
            10000,
            [
                m.ProduceTopic(
                    TOPIC, [m.ProducePartition(0, b"\x00" * 80), m.ProducePartition(1, good)]
                )
            ],
        )
        resp = await WireClient.call_once(agent.host, agent.port, m.ApiKey.PRODUCE, req)
        bad_result, good_result = resp.topics[0].partitions
        assert bad_result.error_code == CorruptBatchError.code
        assert (good_result.error_code, good_result.base_offset) == (0, 0)

    asyncio.run(run())
    assert _stored(agent, 0) == []
    assert [r["value"] for r in _stored(agent, 1)] == [b"good"]


def test_pipelined_requests_are_answered_in_order(agent: AgentHandle) -> None:
    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            # a long poll first, then produces that complete sooner: answers still come in
            # order, and an acks=0 produce among them adds none
            ids = [
                await client.send(
                    m.ApiKey.FETCH, fetch_request(TOPIC, 1, 0, max_wait_ms=300, min_bytes=10**6)
                )
            ]
            for i in range(20):
                acks = 0 if i == 10 else 1
                cid = await client.send(
                    m.ApiKey.PRODUCE,
                    produce_request(TOPIC, 0, encode_batch([b"%d" % i]), acks=acks),
                )
                if acks:
                    ids.append(cid)
            frames = [await client.receive() for _ in ids]
            assert [f.correlation_id for f in frames] == ids
            offsets = [
                m.ProduceResponse.decode(f.body).topics[0].partitions[0].base_offset
                for f in frames[1:]
            ]
            assert offsets == [i for i in range(20) if i != 10]
        finally:
            await client.close()

    asyncio.run(run())


def test_acks_zero_gets_no_response(agent: AgentHandle) -> None:
    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            await client.send(
                m.ApiKey.PRODUCE, produce_request(TOPIC, 0, encode_batch([b"fire"]), acks=0)
            )
            cid = await client.send(m.ApiKey.API_VERSIONS, m.ApiVersionsRequest())
            frame = await client.receive()
            assert frame.correlation_id == cid  # the first answer is to the second request
        finally:
            await client.close()

    asyncio.run(run())
    assert [r["value"] for r in _stored(agent)] == [b"fire"]


def test_long_poll_waits_max_wait_on_an_empty_partition(agent: AgentHandle) -> None:
    async def run() -> float:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            start = time.monotonic()
            resp = await client.call(m.ApiKey.FETCH, fetch_request(TOPIC, 1, 0, max_wait_ms=500))
            answer = resp.topics[0].partitions[0]
            assert (answer.error_code, answer.records) == (0, None)
            return time.monotonic() - start
        finally:
            await client.close()

    elapsed = asyncio.run(run())
    assert 0.45 <= elapsed < 3.0, elapsed


def test_long_poll_answers_as_soon_as_data_arrives(agent: AgentHandle) -> None:
    async def run() -> None:
        consumer = await WireClient.connect(agent.host, agent.port)
        producer = await WireClient.connect(agent.host, agent.port)
        try:
            # the fetch may wait up to 30 s: only the arriving data can end it early
            cid = await consumer.send(
                m.ApiKey.FETCH, fetch_request(TOPIC, 1, 0, max_wait_ms=30_000)
            )
            start = time.monotonic()
            await producer.call(
                m.ApiKey.PRODUCE, produce_request(TOPIC, 1, encode_batch([b"wake up"]))
            )
            frame = await consumer.receive(wait_s=20)
            assert frame.correlation_id == cid
            records = m.FetchResponse.decode(frame.body).topics[0].partitions[0].records
            assert [r["value"] for r in decode_batches(records).to_pylist()] == [b"wake up"]
            assert time.monotonic() - start < 20
        finally:
            await consumer.close()
            await producer.close()

    asyncio.run(run())


def test_not_leader_names_the_leader(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.start(2)
    cluster.create_topic(TOPIC, 2, 1)
    leaders = cluster.wait_for_leaders(TOPIC)
    p = leaders[0]
    other = next(a for a in cluster.agents.values() if a.agent_id != p.leader_id)

    async def run() -> None:
        resp = await WireClient.call_once(
            other.host,
            other.port,
            m.ApiKey.PRODUCE,
            produce_request(TOPIC, 0, encode_batch([b"x"])),
        )
        r = resp.topics[0].partitions[0]
        assert r.error_code == NotLeaderError.code
        assert (r.leader_id, r.leader_epoch) == (p.leader_id, p.leader_epoch)

    asyncio.run(run())


def test_an_agent_cut_off_from_zookeeper_refuses_writes_until_its_session_is_confirmed(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Freeze this test's own ZooKeeper server (SIGSTOP): the agent's connection is SUSPENDED,
    it may already have been replaced, so it must stop acting as leader. Thaw it (SIGCONT):
    the session is confirmed again and writes are accepted."""
    import signal

    from infra.zookeeper import start_zookeeper
    from tests.harness import ZooKeeperChroot

    zk = start_zookeeper(tmp_path / "zk")
    try:
        cluster = Cluster(
            processes,
            ZooKeeperChroot(zk.connect_string, "/suspend"),
            tmp_path / "data",
            session_timeout_ms=20_000,
        )
        agent = cluster.start_agent(1)
        cluster.create_topic(TOPIC, 1, 1)
        cluster.wait_for_leaders(TOPIC)
        # a loaded machine can drop the fresh ZooKeeper connection on its own (seen in CI):
        # the agent then refuses writes until it reconnects, which is what this test checks
        deadline = time.monotonic() + 30
        while _produce(agent, encode_batch([b"before"])).error_code != 0:
            assert time.monotonic() < deadline, "writes were not accepted before the freeze"
            time.sleep(0.2)

        os.kill(zk.pid, signal.SIGSTOP)
        try:
            # kazoo declares the connection lost after about 2/3 of the session timeout
            # without an answer; until then writes may still be accepted
            deadline = time.monotonic() + 30
            while True:
                result = _produce(agent, encode_batch([b"while frozen"]))
                if result.error_code == NotLeaderError.code:
                    break
                assert time.monotonic() < deadline, "writes were still accepted"
                time.sleep(0.2)
            assert "ZooKeeper session" in (result.error_message or "")
        finally:
            os.kill(zk.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _produce(agent, encode_batch([b"after"])).error_code != 0:
            assert time.monotonic() < deadline, "writes were not accepted again after the thaw"
            time.sleep(0.2)
        values = [r["value"] for r in _stored(agent)]
        assert values[0] == b"before" and values[-1] == b"after"
    finally:
        zk.stop()


def test_many_pipelining_producers_cannot_grow_the_agent_past_its_request_budget(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """Overload with stalled handlers: the follower of every partition is frozen (SIGSTOP), so
    each acks=all produce waits for it (up to ``replica.lag.time.max.ms``) while 24
    connections pipeline 1 MiB requests at the leader, up to 64 in flight each: 1.5 GiB of
    requests if the agent read them all. ``queued.max.request.bytes`` caps what the agent has
    read and not yet handled over all connections, so its RSS stays near that bound."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    budget = "queued.max.request.bytes=16777216"
    leader = cluster.start_agent(1, budget, "replica.lag.time.max.ms=30000")
    cluster.start_agent(2, budget, "replica.lag.time.max.ms=30000")
    cluster.create_topic(TOPIC, 4, 2, {"min.insync.replicas": 1})
    deadline = time.monotonic() + 30
    while True:
        parts = cluster.wait_for_leaders(TOPIC)
        if all(len(p.isr) == 2 for p in parts.values()):
            break
        assert time.monotonic() < deadline, parts
        time.sleep(0.05)
    led = [p for p, md in parts.items() if md.leader_id == 1]
    assert led, parts  # the controller spreads 4 leaders over 2 agents
    pid = leader.process.pid
    batch = encode_batch([os.urandom(1024)] * 1000)  # ~1 MiB
    frames = [
        b"".join(
            bytes(x)
            for x in encode_request(
                m.ApiKey.PRODUCE, 0, "flood", produce_request(TOPIC, p, batch, acks=-1)
            )
        )
        for p in led
    ]
    rss_before = rss_bytes(pid)
    peak = rss_before
    cluster.kill(2, signal.SIGSTOP)

    async def flood(i: int) -> None:
        """Write requests back to back until cancelled; ``drain`` blocks while the agent
        does not read, so the client's own buffer stays under the transport's high mark."""
        _, writer = await asyncio.open_connection(leader.host, leader.port)
        sent = 0
        try:
            while True:
                writer.write(frames[(i + sent) % len(frames)])
                sent += 1
                await writer.drain()
        finally:
            writer.transport.abort()

    async def run() -> None:
        nonlocal peak
        tasks = [asyncio.create_task(flood(i)) for i in range(24)]
        until = time.monotonic() + 6
        while time.monotonic() < until:
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.05)  # sampling interval of the RSS probe
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # every connection was still pushing when the sampling ended (none failed early)
        early = [repr(r) for r in results if not isinstance(r, asyncio.CancelledError)]
        assert not early, early

    try:
        asyncio.run(run())
    finally:
        cluster.kill(2, signal.SIGCONT)
    # 16 MiB of queued requests plus the agent's working set; without the budget it read
    # about 1.5 GiB of frames here (64 in flight x 24 connections x 1 MiB)
    assert peak - rss_before < 256 << 20, (rss_before >> 20, peak >> 20)
    # and it still serves: a fresh produce to a partition it leads is answered
    result = _produce(leader, encode_batch([b"after the flood"]), led[0])
    assert result.error_code == 0


def test_markers_for_one_partition_in_one_request_are_each_applied_and_answered(
    agent: AgentHandle,
) -> None:
    """A WriteTxnMarkers request with several transactions' markers for one partition (a
    coordinator sends what it has queued for an agent at once): they are applied in request
    order, one wait for all, and each is answered on its own (a commit, an abort, and a late
    marker of an older coordinator epoch refused as fenced); read_committed then hands out
    the committed transaction's record and not the aborted one's."""
    from handlers.ranges import read_range
    from sdk import Consumer, TopicPartition
    from storage.errors import TransactionCoordinatorFencedError

    for pid, value in ((9001, b"kept"), (9002, b"dropped")):
        batch = encode_batch(
            [value], producer_id=pid, producer_epoch=0, base_sequence=0, transactional=True
        )
        assert _produce(agent, batch).error_code == 0
    on_p0 = [m.TxnTopic(TOPIC, [0])]
    request = m.WriteTxnMarkersRequest(
        [
            m.TxnMarker(9001, 0, 1, 5, on_p0, []),
            m.TxnMarker(9002, 0, 0, 5, on_p0, []),
            m.TxnMarker(9001, 0, 1, 4, on_p0, []),  # an older decision, come late
        ]
    )
    resp = asyncio.run(
        WireClient.call_once(agent.host, agent.port, m.ApiKey.WRITE_TXN_MARKERS, request)
    )
    assert [x.producer_id for x in resp.markers] == [9001, 9002, 9001]
    codes = [x.topics[0].partitions[0].error_code for x in resp.markers]
    assert codes == [0, 0, TransactionCoordinatorFencedError.code]

    async def committed() -> list[bytes | None]:
        config = {
            "bootstrap.servers": f"{agent.host}:{agent.port}",
            "isolation.level": "read_committed",
        }
        async with Consumer(config) as c:
            tp = TopicPartition(TOPIC, 0)
            end = (await c.end_offsets([tp]))[tp]
            return [r.value for r in await read_range(c, tp, 0, end, limit_s=30)]

    assert asyncio.run(committed()) == [b"kept"]
