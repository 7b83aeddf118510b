"""Unmodified Kafka clients against three real agents' Kafka listeners.

kafka-python (pure Python), aiokafka (asyncio) and confluent-kafka (librdkafka) produce with
acks 0 / 1 / all and with idempotence; every client's records are read back by the other two
and by the Strata SDK; keys land on the partition Kafka's murmur2 rule names; each client runs
a consumer group of two members through a rebalance, commits, restarts and resumes from the
committed offsets, and seeks by timestamp; kcat lists metadata, produces and consumes; a
Kafka producer with acks=all loses nothing through a leader kill -9 (the same check as the
native path, ``tests.cluster.check_acknowledged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiokafka
import confluent_kafka as ck
import kafka as kp
import pyarrow as pa
import pytest

from sdk import Consumer, Producer, TopicPartition
from sdk.partitioner import murmur2, to_positive
from storage.codec import Compression, decode_batches, iter_batches
from storage.kafka import frames as kf
from storage.kafka.messages import ApiKey
from storage.kafka.records import TAG_HEADER, build_kafka_batch
from storage.protocol import messages as m
from tests.cluster import Cluster, check_acknowledged, fetch_request
from tests.delay_support import wait_until
from tests.harness import ProcessGroup, ZooKeeperChroot, create_chroot, delete_chroot, kazoo_client
from tests.harness import close_client as close_kazoo
from tests.kafka_support import read_kafka_frame

PARTITIONS = 4
CLIENTS = ("kafka-python", "aiokafka", "confluent-kafka")
KAFKA_CONFIGS = ("kafka.listener=127.0.0.1:0", "group.initial.rebalance.delay.ms=0")
Record = tuple[int, int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...], int]
"""partition, offset, key, value, headers, timestamp"""


@pytest.fixture(scope="module")
def cluster(zk_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three agents with Kafka listeners, shared by the tests of this module that do not
    kill agents (each uses topics of its own)."""
    tmp = tmp_path_factory.mktemp("kafka-cluster")
    admin = kazoo_client(zk_server.connect_string)
    chroot = create_chroot(admin, zk_server.connect_string, "kafka-clients")
    group = ProcessGroup(tmp / "processes")
    try:
        c = Cluster(group, chroot, tmp / "data")
        for i in (1, 2, 3):
            c.start_agent(i, *KAFKA_CONFIGS)
        yield c
    finally:
        group.close()
        delete_chroot(admin, chroot)
        close_kazoo(admin)


def _topic(cluster: Cluster, name: str, partitions: int = PARTITIONS) -> str:
    cluster.create_topic(name, partitions, 3)
    cluster.wait_for_leaders(name)
    return name


def _records(n: int, tag: str) -> list[tuple[bytes, bytes, list[tuple[str, bytes]], int]]:
    """Keyed records; two in three carry headers, one in four a Strata tag (the header
    ``strata.tag``, last, where a Strata record's tags come back to Kafka clients)."""
    base = 1_700_000_000_000
    return [
        (
            f"{tag}-key-{i % 37}".encode(),
            f"{tag}-value-{i:06d}".encode() * (1 + i % 5),
            ([("seq", str(i).encode()), ("client", tag.encode())] if i % 3 else [])
            + ([(TAG_HEADER, f"t{i % 5}".encode())] if i % 4 == 1 else []),
            base + i,
        )
        for i in range(n)
    ]


# ---- producers -------------------------------------------------------------------------------
def produce_kafka_python(bootstrap: str, topic: str, records: list[Any], **conf: Any) -> None:
    producer = kp.KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=5, **conf)
    try:
        futures = [
            producer.send(topic, value=v, key=k, headers=h, timestamp_ms=ts)
            for k, v, h, ts in records
        ]
        producer.flush(30)
        if conf.get("acks", 1) != 0:
            for f in futures:
                f.get(timeout=30)
    finally:
        producer.close(10)


def produce_aiokafka(bootstrap: str, topic: str, records: list[Any], **conf: Any) -> None:
    async def run() -> None:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, **conf)
        await producer.start()
        try:
            futures = [
                await producer.send(topic, value=v, key=k, headers=h, timestamp_ms=ts)
                for k, v, h, ts in records
            ]
            await producer.flush()
            if conf.get("acks", 1) != 0:
                await asyncio.gather(*futures)
        finally:
            await producer.stop()

    asyncio.run(run())


def produce_confluent(bootstrap: str, topic: str, records: list[Any], **conf: Any) -> None:
    errors: list[Any] = []
    producer = ck.Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 5,
            "partitioner": "murmur2_random",  # Kafka's (Java client's) rule
            **conf,
        }
    )
    for k, v, h, ts in records:
        producer.produce(
            topic,
            value=v,
            key=k,
            headers=h,
            timestamp=ts,
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not errors, errors[:3]


PRODUCERS: dict[str, Callable[..., None]] = {
    "kafka-python": produce_kafka_python,
    "aiokafka": produce_aiokafka,
    "confluent-kafka": produce_confluent,
}
ACKS = {
    "kafka-python": {"0": {"acks": 0}, "1": {"acks": 1}, "all": {"acks": "all"}},
    "aiokafka": {"0": {"acks": 0}, "1": {"acks": 1}, "all": {"acks": "all"}},
    "confluent-kafka": {"0": {"acks": "0"}, "1": {"acks": "1"}, "all": {"acks": "all"}},
}
IDEMPOTENT = {
    "kafka-python": {"acks": "all", "enable_idempotence": True},
    "aiokafka": {"acks": "all", "enable_idempotence": True},
    "confluent-kafka": {"acks": "all", "enable.idempotence": True},
}


# ---- readers ---------------------------------------------------------------------------------
def read_kafka_python(
    bootstrap: str, topic: str, count: int, isolation: str = "read_uncommitted"
) -> list[Record]:
    consumer = kp.KafkaConsumer(
        bootstrap_servers=bootstrap.split(","), enable_auto_commit=False, isolation_level=isolation
    )
    out: list[Record] = []
    try:
        tps = [kp.TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + 60
        while len(out) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                out += [
                    (r.partition, r.offset, r.key, r.value, tuple(r.headers), r.timestamp)
                    for r in batch
                ]
    finally:
        consumer.close()
    return out


def read_aiokafka(
    bootstrap: str, topic: str, count: int, isolation: str = "read_uncommitted"
) -> list[Record]:
    async def run() -> list[Record]:
        consumer = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level=isolation
        )
        await consumer.start()
        out: list[Record] = []
        try:
            tps = [aiokafka.TopicPartition(topic, p) for p in range(PARTITIONS)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            async with asyncio.timeout(60):
                while len(out) < count:
                    for batch in (await consumer.getmany(timeout_ms=500)).values():
                        out += [
                            (r.partition, r.offset, r.key, r.value, tuple(r.headers), r.timestamp)
                            for r in batch
                        ]
        finally:
            await consumer.stop()
        return out

    return asyncio.run(run())


def read_confluent(
    bootstrap: str, topic: str, count: int, isolation: str = "read_uncommitted"
) -> list[Record]:
    consumer = ck.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "reader",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    out: list[Record] = []
    try:
        consumer.assign(
            [ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(PARTITIONS)]
        )
        deadline = time.monotonic() + 60
        while len(out) < count and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                assert msg.error() is None, msg.error()
                headers = tuple((k, v) for k, v in msg.headers() or [])
                out.append(
                    (
                        msg.partition(),
                        msg.offset(),
                        msg.key(),
                        msg.value(),
                        headers,
                        msg.timestamp()[1],
                    )
                )
    finally:
        consumer.close()
    return out


def read_sdk(bootstrap: str, topic: str, count: int) -> list[Record]:
    async def run() -> list[Record]:
        tables: list[tuple[int, pa.Table]] = []
        got = 0
        async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
            tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            async with asyncio.timeout(60):
                while got < count:
                    for tp, table in (await consumer.getmany_arrow(timeout_ms=500)).items():
                        tables.append((tp.partition, table))
                        got += table.num_rows
        out: list[Record] = []
        for p, table in tables:
            for row in table.to_pylist():
                # a Kafka record's strata.tag headers are its tags, not also headers; they
                # are put back where Kafka clients see them, to compare with those
                assert all(h["key"] != TAG_HEADER for h in row["headers"]), row
                headers = tuple((h["key"], h["value"]) for h in row["headers"]) + tuple(
                    (TAG_HEADER, t.encode()) for t in row["tags"]
                )
                ts = round(row["timestamp"].timestamp() * 1000)
                out.append((p, row["offset"], row["key"], row["value"], headers, ts))
        return out

    return asyncio.run(run())


READERS: dict[str, Callable[..., list[Record]]] = {
    "kafka-python": read_kafka_python,
    "aiokafka": read_aiokafka,
    "confluent-kafka": read_confluent,
}


@pytest.mark.slow
@pytest.mark.parametrize("client", CLIENTS)
def test_produce_with_every_acks_and_idempotence_read_back_by_every_client(
    cluster: Cluster, client: str
) -> None:
    """Four runs of 300 records (acks 0, 1, all, idempotent) from one client; the other two
    clients and the SDK read all 1,200 back: same partitions, offsets, keys, values,
    headers and timestamps, each key on ``toPositive(murmur2(key)) % partitions``."""
    topic = _topic(cluster, f"produced-by-{client}")
    bootstrap = cluster.kafka_bootstrap
    sent = []
    for run, conf in [*ACKS[client].items(), ("idempotent", IDEMPOTENT[client])]:
        records = _records(300, f"{client}-{run}")
        PRODUCERS[client](bootstrap, topic, records, **conf)
        sent += records
    expected = {(k, v, tuple(h), ts) for k, v, h, ts in sent}
    views = {}
    for reader in [c for c in CLIENTS if c != client]:
        views[reader] = READERS[reader](bootstrap, topic, len(sent))
    views["sdk"] = read_sdk(cluster.bootstrap, topic, len(sent))
    reference = sorted(views["sdk"])
    assert len(reference) == len(sent)
    assert {(k, v, h, ts) for _, _, k, v, h, ts in reference} == expected
    for p, _, key, _, _, _ in reference:
        assert key is not None and p == to_positive(murmur2(key)) % PARTITIONS, key
    for p in range(PARTITIONS):
        offsets = [o for q, o, *_ in reference if q == p]
        assert offsets == list(range(len(offsets)))
    for reader, seen in views.items():
        assert sorted(seen) == reference, reader


@pytest.mark.slow
def test_records_without_headers_are_stored_as_each_client_sent_them_and_read_by_all(
    cluster: Cluster,
) -> None:
    """Uncompressed batches of records without headers (what Kafka clients send unless told
    to compress) are stored as they came, a Kafka batch inside a Strata batch
    (``storage.codec.kafka_body``): the leaders' logs hold such batches only, and every
    client and the SDK read back exactly what was sent, offsets counted from 0."""
    topic = _topic(cluster, "kept-as-sent")
    sent = []
    for client in CLIENTS:
        records = [(k, v, [], ts) for k, v, _, ts in _records(300, f"plain-{client}")]
        PRODUCERS[client](cluster.kafka_bootstrap, topic, records, **IDEMPOTENT[client])
        sent += records
    expected = {(k, v, (), ts) for k, v, _, ts in sent}
    reference = sorted(read_sdk(cluster.bootstrap, topic, len(sent)))
    assert {(k, v, h, ts) for _, _, k, v, h, ts in reference} == expected
    for reader in CLIENTS:
        assert sorted(READERS[reader](cluster.kafka_bootstrap, topic, len(sent))) == reference
    assert _stored_as(cluster, topic) == {Compression.KAFKA}
    # a topic read mostly as Arrow can have them converted instead
    columnar = "kept-columnar"
    cluster.create_topic(columnar, PARTITIONS, 3, {"kafka.batch.storage": "columnar"})
    cluster.wait_for_leaders(columnar)
    records = [(k, v, [], ts) for k, v, _, ts in _records(300, "columnar")]
    produce_confluent(cluster.kafka_bootstrap, columnar, records, **IDEMPOTENT["confluent-kafka"])
    got = read_sdk(cluster.bootstrap, columnar, len(records))
    assert {(k, v, h, ts) for _, _, k, v, h, ts in got} == {
        (k, v, (), ts) for k, v, _, ts in records
    }
    assert _stored_as(cluster, columnar) == {Compression.NONE}


def _stored_as(cluster: Cluster, topic: str) -> set[Compression]:
    """How the batches of ``topic`` are stored (a raw native fetch from each leader); each
    partition's offsets count from 0."""
    kinds = []
    for p, meta in cluster.wait_for_leaders(topic).items():
        leader = cluster.agents[meta.leader_id]
        resp = cluster.call(leader, m.ApiKey.FETCH, fetch_request(topic, p, 0, max_bytes=8 << 20))
        data = resp.topics[0].partitions[0].records
        kinds += [h.compression for h, _ in iter_batches(data)]
        offsets = decode_batches(data).column("offset").to_pylist()
        assert offsets == list(range(len(offsets)))
    assert kinds
    return set(kinds)


@pytest.mark.slow
def test_records_produced_by_the_sdk_are_read_by_every_kafka_client(cluster: Cluster) -> None:
    """The other way round: the SDK produces through the native listener (keys, headers,
    tags, timestamps); kafka-python, aiokafka and confluent-kafka read the same records,
    each tag as a ``strata.tag`` header after the record's other headers."""
    topic = _topic(cluster, "produced-by-sdk")
    sent = _records(400, "sdk")

    async def produce() -> None:
        async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as producer:
            plain = [[(k, v) for k, v in h if k != TAG_HEADER] for _, _, h, _ in sent]
            tags = [[v.decode() for k, v in h if k == TAG_HEADER] for _, _, h, _ in sent]
            done = await producer.send_batch(
                topic,
                [v for _, v, _, _ in sent],
                keys=[k for k, _, _, _ in sent],
                headers=plain,
                tags=tags,
                timestamp_ms=[ts for *_, ts in sent],
            )
            await producer.flush()
            await done

    asyncio.run(produce())
    expected = {(k, v, tuple(h), ts) for k, v, h, ts in sent}
    reference = sorted(read_sdk(cluster.bootstrap, topic, len(sent)))
    assert {(k, v, h, ts) for _, _, k, v, h, ts in reference} == expected
    assert sum(1 for *_, h, _ in reference if (TAG_HEADER, b"t1") in h) > 0
    for reader in CLIENTS:
        assert sorted(READERS[reader](cluster.kafka_bootstrap, topic, len(sent))) == reference, (
            reader
        )


def test_kafka_clients_read_sdk_transactions_committed_or_not_and_never_their_markers(
    cluster: Cluster,
) -> None:
    """An SDK transactional producer commits, aborts and commits again across partitions:
    with read_committed every Kafka client reads the committed records only, with
    read_uncommitted the aborted ones too; the transaction markers are control batches to
    them (skipped), never records."""
    topic = _topic(cluster, "sdk-transactions")

    async def produce() -> None:
        config = {"bootstrap.servers": cluster.bootstrap, "transactional.id": "kafka-readers"}
        async with Producer(config) as producer:
            await producer.init_transactions()
            for name in ("first", "aborted", "last"):
                producer.begin_transaction()
                sent = [
                    await producer.send(topic, f"{name}-{i}".encode(), partition=i % PARTITIONS)
                    for i in range(12)
                ]
                if name == "aborted":
                    await producer.flush()  # stored, then aborted: in the log, marked aborted
                    await producer.abort_transaction()
                    await asyncio.gather(*sent, return_exceptions=True)
                else:
                    await producer.commit_transaction()
                    await asyncio.gather(*sent)

    async def latest_while_open() -> tuple[int, int]:
        """Partition 0's latest offset for read_committed and read_uncommitted Kafka clients
        (ListOffsets v2) while a transaction with stored records is open there."""
        config = {"bootstrap.servers": cluster.bootstrap, "transactional.id": "kafka-open"}
        async with Producer(config) as producer:
            await producer.init_transactions()
            producer.begin_transaction()
            sent = [await producer.send(topic, b"open", partition=0) for _ in range(3)]
            await producer.flush()
            latest = []
            for isolation in (1, 0):
                request = kf.encode_request(
                    ApiKey.LIST_OFFSETS, 2, 90 + isolation, "t",
                    {"replica_id": -1, "isolation_level": isolation,
                     "topics": [{"name": topic, "partitions": [
                         {"partition_index": 0, "timestamp": -1}]}]},
                )  # fmt: skip
                for address in cluster.kafka_bootstrap.split(","):  # the leader answers
                    _, body = kf.parse_response(
                        await asyncio.to_thread(_exchange, address, request), ApiKey.LIST_OFFSETS, 2
                    )
                    part = body["topics"][0]["partitions"][0]
                    if part["error_code"] == 0:
                        latest.append(part["offset"])
                        break
            await producer.abort_transaction()
            await asyncio.gather(*sent, return_exceptions=True)
        return latest[0], latest[1]

    asyncio.run(produce())
    committed = {f"{n}-{i}".encode() for n in ("first", "last") for i in range(12)}
    aborted = {f"aborted-{i}".encode() for i in range(12)}
    for reader in CLIENTS:
        for isolation, want in (
            ("read_committed", committed),
            ("read_uncommitted", committed | aborted),
        ):
            got = READERS[reader](cluster.kafka_bootstrap, topic, len(want), isolation)
            values = [v for _, _, _, v, _, _ in got]
            assert sorted(values) == sorted(want), (reader, isolation)  # type: ignore[type-var]
            # in each partition's order: the last transaction after the first
            for p in range(PARTITIONS):
                mine = [v for part, _, _, v, _, _ in sorted(got) if part == p]
                assert mine == sorted(mine, key=lambda v: not v.startswith(b"first")), mine
    stable, end = asyncio.run(latest_while_open())
    # partition 0: 3 + 3 committed records, 3 aborted, 3 markers; the open transaction's 3
    assert (stable, end) == (12, 15)


# ---- Kafka clients' own transactions -----------------------------------------------------------
TXN_STEPS = (("a", True, 5), ("b", False, 9), ("c", True, 8))
"""A pipeline's transactions: (name, commit?, input offset committed with it)."""


class TxnDriver:
    """One Kafka client's transactional producer, driven in steps: each transaction writes
    12 records over the 4 partitions and commits an input offset of a group with it."""

    def __init__(self, client: str, bootstrap: str, txn_id: str, group: str, source: str) -> None:
        self.client, self.group, self.source = client, group, source
        self.loop = asyncio.new_event_loop() if client == "aiokafka" else None
        self.member: Any = None
        if client == "confluent-kafka":
            self.p: Any = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id})
            self.p.init_transactions(30)
            # a real member of the group: its metadata rides on TxnOffsetCommit v3 (KIP-447)
            self.member = ck.Consumer(
                {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
            )
            self.member.subscribe([source])
            deadline = time.monotonic() + 30
            while not self.member.assignment():
                assert time.monotonic() < deadline, "the group member never got its partitions"
                self.member.poll(0.2)
            self.metadata = self.member.consumer_group_metadata()
        elif client == "aiokafka":
            assert self.loop is not None

            async def start() -> Any:
                producer = aiokafka.AIOKafkaProducer(
                    bootstrap_servers=bootstrap, transactional_id=txn_id
                )
                await producer.start()
                return producer

            self.p = self.loop.run_until_complete(start())
        else:
            self.p = kp.KafkaProducer(
                bootstrap_servers=bootstrap.split(","), transactional_id=txn_id
            )
            self.p.init_transactions()

    def transaction(self, topic: str, name: str, commit: bool, offset: int) -> None:
        values = [(f"{name}-{i}".encode(), i % PARTITIONS) for i in range(12)]
        if self.client == "confluent-kafka":
            self.p.begin_transaction()
            for value, partition in values:
                self.p.produce(topic, value, partition=partition)
            self.p.send_offsets_to_transaction(
                [ck.TopicPartition(self.source, 0, offset)], self.metadata, 30
            )
            self.p.flush(30)  # stored before the end: an abort leaves them in the log, aborted
            (self.p.commit_transaction if commit else self.p.abort_transaction)(30)
        elif self.client == "aiokafka":
            assert self.loop is not None

            async def run() -> None:
                await self.p.begin_transaction()
                sent = [
                    await self.p.send(topic, value, partition=partition)
                    for value, partition in values
                ]
                await asyncio.gather(*sent)
                await self.p.send_offsets_to_transaction(
                    {aiokafka.TopicPartition(self.source, 0): offset}, self.group
                )
                await (self.p.commit_transaction() if commit else self.p.abort_transaction())

            self.loop.run_until_complete(run())
        else:
            self.p.begin_transaction()
            for value, partition in values:
                self.p.send(topic, value, partition=partition)
            self.p.send_offsets_to_transaction(
                {kp.TopicPartition(self.source, 0): kp.OffsetAndMetadata(offset, "", -1)},
                self.group,
            )
            self.p.flush()
            (self.p.commit_transaction if commit else self.p.abort_transaction)()

    def leave_group(self) -> None:
        """The group member leaves (its metadata stays with the producer): another driver's
        member can then join without waiting for this one's rebalance timeout."""
        if self.member is not None:
            self.member.close()
            self.member = None

    def close(self) -> None:
        self.leave_group()
        if self.client == "confluent-kafka":
            self.p.flush(5)
        elif self.client == "aiokafka":
            assert self.loop is not None
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.p.stop())
            self.loop.close()
        else:
            self.p.close(timeout=5)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_kafka_clients_transactions_commit_abort_carry_offsets_and_fence_zombies(
    cluster: Cluster, client: str
) -> None:
    """A Kafka client's own transactional producer (``init_transactions``, begin, produce
    over 4 partitions, ``send_offsets_to_transaction``, commit or abort) through the Kafka
    listener: read_committed readers get the committed transactions whole and nothing of the
    aborted one; the group's offset is the last committed transaction's, not the aborted
    one's; a second producer with the same ``transactional.id`` fences the first, whose next
    transaction fails and leaves nothing in the log."""
    topic = _topic(cluster, f"txn-out-{client}")
    source = _topic(cluster, f"txn-in-{client}")
    group, txn_id = f"txn-group-{client}", f"txn-{client}"
    first = TxnDriver(client, cluster.kafka_bootstrap, txn_id, group, source)
    try:
        for name, commit, offset in TXN_STEPS:
            first.transaction(topic, name, commit, offset)
        first.leave_group()
        second = TxnDriver(client, cluster.kafka_bootstrap, txn_id, group, source)
        try:
            with pytest.raises(Exception) as fenced:
                first.transaction(topic, "zombie", True, 10)
            print(f"{client}: the zombie's commit failed with {fenced.value!r}")
            assert any(w in repr(fenced.value).lower() for w in ("fenced", "epoch")), fenced.value
            second.transaction(topic, "d", True, 11)
        finally:
            second.close()
    finally:
        with contextlib.suppress(Exception):
            first.close()

    def values(names: str) -> list[bytes]:
        return sorted(f"{n}-{i}".encode() for n in names for i in range(12))

    for reader in CLIENTS:
        got = READERS[reader](cluster.kafka_bootstrap, topic, 36, "read_committed")
        assert sorted(v for *_, v, _, _ in got) == values("acd"), reader  # type: ignore[type-var]
    everything = read_sdk(cluster.bootstrap, topic, 48)
    assert sorted(v for *_, v, _, _ in everything) == values("abcd")  # type: ignore[type-var]
    # 48 records and 4 transactions' markers on each partition: nothing of the zombie
    assert len(_all_offsets(cluster, topic)) == 48 + 4 * PARTITIONS
    reader_ = ck.Consumer({"bootstrap.servers": cluster.kafka_bootstrap, "group.id": group})
    try:
        (committed,) = reader_.committed([ck.TopicPartition(source, 0)], 30)
        assert committed.offset == 11  # d's; b's 9 was aborted, the zombie's 10 refused
    finally:
        reader_.close()


# ---- groups ----------------------------------------------------------------------------------
class GroupMember:
    """One member of a consumer group, driven in steps (``poll``), for each client."""

    def __init__(self, client: str, bootstrap: str, group: str, topic: str) -> None:
        self.client = client
        self.seen: list[tuple[int, int, int]] = []  # partition, offset, timestamp
        self.uncommitted = False
        self.loop = asyncio.new_event_loop() if client == "aiokafka" else None
        if client == "kafka-python":
            self.c: Any = kp.KafkaConsumer(
                topic,
                bootstrap_servers=bootstrap.split(","),
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=10_000,
                heartbeat_interval_ms=500,
            )
            # the topic's partitions known before the first join: see KAFKA_PYTHON_STUCK_JOIN
            assert self.c.partitions_for_topic(topic) == set(range(PARTITIONS))
        elif client == "aiokafka":
            assert self.loop is not None

            async def start() -> Any:
                consumer = aiokafka.AIOKafkaConsumer(
                    topic,
                    bootstrap_servers=bootstrap,
                    group_id=group,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    session_timeout_ms=10_000,
                    heartbeat_interval_ms=500,
                )
                await consumer.start()
                return consumer

            self.c = self.loop.run_until_complete(start())
        else:
            self.c = ck.Consumer(
                {
                    "bootstrap.servers": bootstrap,
                    "group.id": group,
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    "session.timeout.ms": 10_000,
                    "heartbeat.interval.ms": 500,
                }
            )
            self.c.subscribe([topic])

    def poll(self) -> None:
        """Take what is there and commit it (at-least-once: commit after processing; a
        commit that loses a race with a rebalance is retried after the next poll)."""
        before = len(self.seen)
        if self.client == "kafka-python":
            for batch in self.c.poll(timeout_ms=200).values():
                self.seen += [(r.partition, r.offset, r.timestamp) for r in batch]
        elif self.client == "aiokafka":
            assert self.loop is not None
            got = self.loop.run_until_complete(self.c.getmany(timeout_ms=200))
            for batch in got.values():
                self.seen += [(r.partition, r.offset, r.timestamp) for r in batch]
        else:
            for msg in self.c.consume(100, 0.2):
                assert msg.error() is None, msg.error()
                self.seen.append((msg.partition(), msg.offset(), msg.timestamp()[1]))
        if len(self.seen) > before or self.uncommitted:
            self.uncommitted = not self.commit()

    def assignment(self) -> set[int]:
        if self.client == "aiokafka":
            return {tp.partition for tp in self.c.assignment()}
        return {tp.partition for tp in self.c.assignment()}

    def commit(self) -> bool:
        """Commit the positions; False if a rebalance got in the way (retry later)."""
        try:
            if self.client == "kafka-python":
                self.c.commit()
            elif self.client == "aiokafka":
                assert self.loop is not None
                self.loop.run_until_complete(self.c.commit())
            else:
                self.c.commit(asynchronous=False)
        except (kp.errors.CommitFailedError, kp.errors.RebalanceInProgressError):
            return False
        except (aiokafka.errors.CommitFailedError, aiokafka.errors.RebalanceInProgressError):
            return False
        except ck.KafkaException as exc:
            code = exc.args[0].code()
            if code == ck.KafkaError._NO_OFFSET:
                return True  # nothing consumed since the last commit
            if code in (ck.KafkaError.REBALANCE_IN_PROGRESS, ck.KafkaError.ILLEGAL_GENERATION):
                return False
            raise
        return True

    def offset_for_time(self, topic: str, partition: int, ts: int) -> int:
        if self.client == "kafka-python":
            tp = kp.TopicPartition(topic, partition)
            return int(self.c.offsets_for_times({tp: ts})[tp].offset)
        if self.client == "aiokafka":
            assert self.loop is not None
            tp = aiokafka.TopicPartition(topic, partition)
            got = self.loop.run_until_complete(self.c.offsets_for_times({tp: ts}))
            return int(got[tp].offset)
        got = self.c.offsets_for_times([ck.TopicPartition(topic, partition, ts)], 10)
        return int(got[0].offset)

    def close(self) -> None:
        if self.client == "aiokafka":
            assert self.loop is not None
            self.loop.run_until_complete(self.c.stop())
            self.loop.close()
        else:
            self.c.close()


def _poll_until(members: list[GroupMember], done: Callable[[], bool], what: str) -> None:
    """Poll every member until ``done``: each in a thread of its own, as applications run
    their consumers (a member whose poll waits for a rebalance must not hold up the others)."""
    deadline = time.monotonic() + 90
    with ThreadPoolExecutor(len(members)) as pool:
        while not done():
            assert time.monotonic() < deadline, what
            list(pool.map(lambda mb: mb.poll(), members))


GROUP_CLIENTS = CLIENTS
# KAFKA_PYTHON_STUCK_JOIN: kafka-python 3.0.12's leader, when it joined before it knew the
# topic's partitions, rejoins as soon as it learns them (its metadata snapshot changed); if
# its poll() times out while that second join's SyncGroup is in flight, no later poll() takes
# the finished join (need_rejoin() is False by then), so heartbeats stay off and the member
# expires. A client bug, seen in its DEBUG log; the member above learns the partitions first.


@pytest.mark.slow
@pytest.mark.parametrize("client", GROUP_CLIENTS)
def test_group_of_two_rebalances_commits_resumes_and_seeks_by_timestamp(
    cluster: Cluster, client: str
) -> None:
    topic = _topic(cluster, f"group-{client}")
    bootstrap = cluster.kafka_bootstrap
    group = f"g-{client}"
    first = _records(200, "first")
    produce_confluent(bootstrap, topic, first, acks="all")

    a = GroupMember(client, bootstrap, group, topic)
    _poll_until([a], lambda: len(a.assignment()) == PARTITIONS and bool(a.seen), "a alone")
    b = GroupMember(client, bootstrap, group, topic)
    # the second member's join rebalances the group: the partitions are split between them
    _poll_until(
        [a, b],
        lambda: (
            bool(a.assignment())
            and bool(b.assignment())
            and a.assignment() | b.assignment() == set(range(PARTITIONS))
            and not a.assignment() & b.assignment()
        ),
        "rebalance to two members",
    )
    _poll_until(
        [a, b],
        lambda: {(p, o) for p, o, _ in a.seen + b.seen} >= _all_offsets(cluster, topic),
        "everything consumed by the group",
    )
    _poll_until([a, b], lambda: not a.uncommitted and not b.uncommitted, "commits")
    a.close()
    b.close()

    second = _records(50, "second")
    produce_confluent(bootstrap, topic, second, acks="all")
    ends = _all_offsets(cluster, topic)
    c = GroupMember(client, bootstrap, group, topic)
    try:
        _poll_until(
            [c], lambda: {(p, o) for p, o, _ in c.seen} >= ends - _before(first, ends), "resume"
        )
        # resumed from the committed offsets: nothing of the first 200 again
        assert len({(p, o) for p, o, _ in c.seen}) == len(second)
        # seek by timestamp: the first record at or after a time, per partition
        mid = first[120][3]
        for p in range(PARTITIONS):
            found = c.offset_for_time(topic, p, mid)
            want = min(
                (o for q, o, ts in a.seen + b.seen + c.seen if q == p and ts >= mid),
                default=-1,
            )
            assert found == want, (p, found, want)
    finally:
        c.close()


@pytest.mark.slow
def test_kafka_clients_and_the_sdk_share_a_groups_committed_offsets(cluster: Cluster) -> None:
    """One group, one coordinator: offsets a confluent-kafka member committed are the SDK's
    committed offsets for that group id; what the SDK commits then, kafka-python reads back."""
    topic = _topic(cluster, "shared-group", partitions=2)
    produce_confluent(cluster.kafka_bootstrap, topic, _records(100, "shared"), acks="all")
    kafka_member = GroupMember("confluent-kafka", cluster.kafka_bootstrap, "shared", topic)
    try:
        _poll_until(
            [kafka_member],
            lambda: len(kafka_member.seen) == 100 and not kafka_member.uncommitted,
            "the Kafka member consumed and committed everything",
        )
    finally:
        kafka_member.close()
    ends = {p: 1 + max(o for q, o, _ in kafka_member.seen if q == p) for p in range(2)}

    async def sdk_side() -> dict[int, int | None]:
        async with Consumer(
            {"bootstrap.servers": cluster.bootstrap, "group.id": "shared"}
        ) as consumer:
            seen = {}
            for p in range(2):
                got = await consumer.committed(TopicPartition(topic, p))
                seen[p] = None if got is None else got.offset
            await consumer.commit({TopicPartition(topic, p): 7 + p for p in range(2)})
            return seen

    assert asyncio.run(sdk_side()) == ends
    reader = kp.KafkaConsumer(
        bootstrap_servers=cluster.kafka_bootstrap.split(","),
        group_id="shared",
        enable_auto_commit=False,
    )
    try:
        assert [reader.committed(kp.TopicPartition(topic, p)) for p in range(2)] == [7, 8]
    finally:
        reader.close()


def _all_offsets(cluster: Cluster, topic: str) -> set[tuple[int, int]]:
    async def ends() -> dict[TopicPartition, int]:
        async with Consumer({"bootstrap.servers": cluster.bootstrap}) as consumer:
            return await consumer.end_offsets([TopicPartition(topic, p) for p in range(PARTITIONS)])

    return {(tp.partition, o) for tp, end in asyncio.run(ends()).items() for o in range(end)}


def _before(first: list[Any], ends: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (partition, offset) pairs of the first run: the lowest ``len(first)`` offsets."""
    per: dict[int, list[int]] = {}
    for p, o in ends:
        per.setdefault(p, []).append(o)
    counts = {p: 0 for p in per}
    for k, *_ in first:
        counts[to_positive(murmur2(k)) % PARTITIONS] += 1
    return {(p, o) for p, offsets in per.items() for o in sorted(offsets)[: counts[p]]}


# ---- admin APIs, groups seen by an admin client, long polling --------------------------------
def test_kafka_admin_client_creates_describes_grows_lists_groups_and_deletes(
    cluster: Cluster,
) -> None:
    """confluent-kafka's AdminClient: CreateTopics (with a config; a bad name refused with
    INVALID_TOPIC_EXCEPTION), DescribeConfigs, CreatePartitions, ListGroups and
    DescribeGroups of a group a Kafka consumer joined, DeleteTopics."""
    from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic

    admin = AdminClient({"bootstrap.servers": cluster.kafka_bootstrap})
    futures = admin.create_topics(
        [NewTopic("admin-made", 2, 3, config={"retention.ms": "3600000"}), NewTopic("a/b", 1, 1)]
    )
    futures["admin-made"].result(30)
    with pytest.raises(ck.KafkaException) as refused:
        futures["a/b"].result(30)
    assert refused.value.args[0].code() == ck.KafkaError.TOPIC_EXCEPTION
    cluster.wait_for_leaders("admin-made")
    resource = ConfigResource("TOPIC", "admin-made")
    configs = admin.describe_configs([resource])[resource].result(30)
    assert configs["retention.ms"].value == "3600000"
    assert configs["min.insync.replicas"].is_default

    admin.create_partitions([NewPartitions("admin-made", 4)])["admin-made"].result(30)

    def grown() -> bool:
        parts = admin.list_topics("admin-made", timeout=30).topics["admin-made"].partitions
        return len(parts) == 4 and all(p.leader >= 0 for p in parts.values())

    # the controller creates the new partitions' states after the answer, as Kafka's does
    wait_until(grown, 30, "four partitions with leaders")

    member = GroupMember("confluent-kafka", cluster.kafka_bootstrap, "admin-seen", "admin-made")
    try:
        _poll_until([member], lambda: len(member.assignment()) == 4, "assigned")
        listed = admin.list_consumer_groups().result(30)
        assert "admin-seen" in {g.group_id for g in listed.valid}
        described = admin.describe_consumer_groups(["admin-seen"])["admin-seen"].result(30)
        assert described.state == ck.ConsumerGroupState.STABLE
        assert len(described.members) == 1
        got = {tp.partition for tp in described.members[0].assignment.topic_partitions}
        assert got == {0, 1, 2, 3}
    finally:
        member.close()

    admin.delete_topics(["admin-made"])["admin-made"].result(30)
    # as in Kafka, the agents' metadata forgets the topic shortly after the delete is answered
    wait_until(lambda: "admin-made" not in admin.list_topics(timeout=30).topics, 30, "topic gone")


def test_a_kafka_fetch_waits_for_data_that_arrives_during_its_max_wait(cluster: Cluster) -> None:
    """Long polling: a Fetch at the end of an empty partition (max_wait_ms 30 s, min_bytes 1)
    and, behind it on the same connection, a Produce; the agent starts requests in the order
    they arrive, so the fetch looks first, finds nothing, waits, and answers with the record
    (an agent that did not wait would answer it empty)."""
    import socket

    topic = _topic(cluster, "long-poll", partitions=1)
    leader = cluster.metadata([topic]).topics[0].partitions[0].leader_id
    address = cluster.agents[leader].kafka
    assert address
    fetch = kf.encode_request(
        ApiKey.FETCH, 11, 1, "t",
        {"replica_id": -1, "max_wait_ms": 30_000, "min_bytes": 1, "max_bytes": 1 << 20,
         "isolation_level": 0,
         "topics": [{"topic": topic, "partitions": [
             {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}]},
    )  # fmt: skip
    batch = build_kafka_batch([(None, b"long-polled", [])], base_timestamp=int(time.time() * 1e3))
    produce = kf.encode_request(
        ApiKey.PRODUCE, 7, 2, "t",
        {"acks": 1, "timeout_ms": 5000,
         "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": batch}]}]},
    )  # fmt: skip
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(fetch + produce)
        corr, fetched = kf.parse_response(read_kafka_frame(sock), ApiKey.FETCH, 11)
        part = fetched["responses"][0]["partitions"][0]
        assert (corr, part["error_code"], part["high_watermark"]) == (1, 0, 1)
        assert b"long-polled" in bytes(part["records"])
        corr, produced = kf.parse_response(read_kafka_frame(sock), ApiKey.PRODUCE, 7)
        assert corr == 2
        assert produced["responses"][0]["partition_responses"][0]["error_code"] == 0


# ---- kcat ------------------------------------------------------------------------------------
def test_kcat_lists_metadata_produces_and_consumes(cluster: Cluster) -> None:
    assert shutil.which("kcat"), "kcat is needed: apt-get install kcat (.ci/run does)"
    topic = _topic(cluster, "kcat")
    bootstrap = cluster.kafka_bootstrap
    listing = subprocess.run(
        ["kcat", "-b", bootstrap, "-L", "-t", topic], capture_output=True, text=True, timeout=30
    )
    assert listing.returncode == 0, listing.stderr
    assert "3 brokers:" in listing.stdout
    assert f'topic "{topic}" with {PARTITIONS} partitions' in listing.stdout
    lines = "".join(f"k{i}:v{i}\n" for i in range(100))
    produced = subprocess.run(
        ["kcat", "-b", bootstrap, "-P", "-t", topic, "-K", ":"],
        input=lines,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert produced.returncode == 0, produced.stderr
    consumed = subprocess.run(
        ["kcat", "-b", bootstrap, "-C", "-t", topic, "-o", "beginning", "-e", "-f", "%k=%s\n"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert consumed.returncode == 0, consumed.stderr
    assert sorted(consumed.stdout.split()) == sorted(f"k{i}=v{i}" for i in range(100))
    got = read_sdk(cluster.bootstrap, topic, 100)
    assert sorted((k, v) for _, _, k, v, _, _ in got) == sorted(
        (f"k{i}".encode(), f"v{i}".encode()) for i in range(100)
    )


# ---- a leader killed under acks=all ----------------------------------------------------------
@pytest.mark.slow
def test_confluent_acks_all_survives_a_leader_kill_9(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    for i in (1, 2, 3):
        cluster.start_agent(i, *KAFKA_CONFIGS)
    topic = "ledger"
    cluster.create_topic(topic, 2, 3, {"min.insync.replicas": 2})
    cluster.wait_for_leaders(topic)
    acked: dict[bytes, tuple[int, int]] = {}
    producer = ck.Producer(
        {
            "bootstrap.servers": cluster.kafka_bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 1,
            "retry.backoff.ms": 50,
            "message.timeout.ms": 120_000,
            "partitioner": "murmur2_random",
        }
    )

    def delivered(err: Any, msg: Any) -> None:
        assert err is None, err
        acked[msg.value()] = (msg.partition(), msg.offset())

    seq = 0

    def produce_for(seconds: float) -> None:
        nonlocal seq
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            producer.produce(
                topic, value=b"%08d" % seq, key=b"k%d" % (seq % 8), on_delivery=delivered
            )
            seq += 1
            producer.poll(0.002)

    produce_for(1.5)
    victim = next(p for p in cluster.metadata([topic]).topics[0].partitions).leader_id
    cluster.kill(victim)
    produce_for(3.0)
    cluster.wait_for_leaders(topic, exclude={victim})
    produce_for(1.5)
    assert producer.flush(120) == 0
    assert len(acked) == seq and seq > 500

    async def everything() -> dict[int, pa.Table]:
        tables: dict[int, list[pa.Table]] = {0: [], 1: []}
        async with Consumer({"bootstrap.servers": cluster.bootstrap}) as consumer:
            tps = [TopicPartition(topic, p) for p in (0, 1)]
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

    duplicates = check_acknowledged(asyncio.run(everything()), acked)
    print(f"{len(acked)} acknowledged through a kill -9 of agent {victim}, {duplicates} duplicates")
    assert duplicates == 0


# ---- bad frames ------------------------------------------------------------------------------
def _exchange(address: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; the first response frame (without its size)."""
    import socket

    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        return read_kafka_frame(sock)


def test_bad_frames_get_kafka_error_codes_and_the_agent_keeps_serving(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    import socket

    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    agent = cluster.start_agent(1, *KAFKA_CONFIGS, "socket.request.max.bytes=65536")
    assert agent.kafka
    address = agent.kafka
    api_versions = kf.encode_request(ApiKey.API_VERSIONS, 0, 1, "t", {})
    # an API that is not served: UNSUPPORTED_VERSION (35) after the correlation id
    answer = _exchange(address, struct.pack(">ihhi", 10, 9999, 0, 77) + b"\x00\x00")
    assert struct.unpack(">ih", answer[:6]) == (77, 35)
    # a served API at a version that is not: the same; ApiVersions answers with its list
    answer = _exchange(address, struct.pack(">ihhi", 10, ApiKey.FETCH, 99, 78) + b"\x00\x00")
    assert struct.unpack(">ih", answer[:6]) == (78, 35)
    answer = _exchange(address, struct.pack(">ihhi", 10, ApiKey.API_VERSIONS, 99, 79) + b"\x00\x00")
    corr, body = kf.parse_response(answer, ApiKey.API_VERSIONS, 0)
    assert (corr, body["error_code"]) == (79, 35) and body["api_keys"]
    # a body that does not parse: INVALID_REQUEST (42) in the API's own response
    garbage = struct.pack(">hhi", ApiKey.LIST_GROUPS, 0, 80) + b"\x00\x01t" + b"\xff" * 5
    answer = _exchange(address, struct.pack(">i", len(garbage)) + garbage)
    corr, body = kf.parse_response(answer, ApiKey.LIST_GROUPS, 0)
    assert (corr, body["error_code"], body["groups"]) == (80, 42, [])
    # a request over socket.request.max.bytes, sent whole: MESSAGE_TOO_LARGE (10) after the
    # agent skipped it; the same connection then serves the next request
    big = kf.encode_request(
        ApiKey.CREATE_TOPICS, 2, 81, "t",
        {"topics": [{"name": "x" * 200, "num_partitions": 1, "replication_factor": 1,
                     "configs": [{"name": "a", "value": "b" * 30000}] * 3}]},
    )  # fmt: skip
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(big + api_versions)
        corr, body = kf.parse_response(read_kafka_frame(sock), ApiKey.CREATE_TOPICS, 2)
        assert corr == 81 and body["topics"] == []
        assert (
            kf.parse_response(read_kafka_frame(sock), ApiKey.API_VERSIONS, 0)[1]["error_code"] == 0
        )
    # a produce whose batch is corrupt: CORRUPT_MESSAGE (2) for that partition
    cluster.create_topic("bad", 1, 1)
    cluster.wait_for_leaders("bad")
    batch = bytearray(build_kafka_batch([(None, b"v", [])], base_timestamp=0))
    batch[-1] ^= 0xFF
    produce = kf.encode_request(
        ApiKey.PRODUCE, 7, 82, "t",
        {"acks": 1, "timeout_ms": 5000,
         "topic_data": [{"name": "bad", "partition_data": [{"index": 0, "records": bytes(batch)}]}]},
    )  # fmt: skip
    corr, body = kf.parse_response(_exchange(address, produce), ApiKey.PRODUCE, 7)
    assert body["responses"][0]["partition_responses"][0]["error_code"] == 2
    # a size prefix that is negative: the stream cannot be trusted, the connection is closed
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(struct.pack(">i", -5))
        assert sock.recv(10) == b""
    # and the agent still serves everyone, Kafka clients and the SDK alike
    assert (
        kf.parse_response(_exchange(address, api_versions), ApiKey.API_VERSIONS, 0)[1]["error_code"]
        == 0
    )
    produce_confluent(address, "bad", [(None, b"fine", [], 1)], acks="all")
    assert [v for *_, v, _, _ in read_sdk(cluster.bootstrap, "bad", 1)] == [b"fine"]
