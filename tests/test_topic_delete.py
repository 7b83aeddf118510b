"""Deleting a topic deletes it (issue 32): 3 real agents, RF 3, tiering to moto, the admin API
over HTTP (the local runtime process), a real ZooKeeper, real Spark.

* the issue's scenario: delete and create again at once; the group, a consumer, replay and
  Spark see the new topic only, and the old topic id's objects leave the bucket;
* the controller killed -9 in the middle of step 5 (a proxy in front of moto holds the second
  ``DeleteObjects`` of segment keys): the next controller finishes the delete;
* a delete without re-create, one replica down meanwhile: replay and Spark raise, the
  group's offsets are gone, the returning replica drops its copy;
* a producer and a consumer running across the delete and the re-create;
* raw Produce, Fetch and OffsetCommit requests that name a deleted incarnation's id.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from broker_agents.kafka.admin import KafkaTopicAdmin
from infra.local_runtime import command, wait_for_listening
from sdk import Consumer, Producer, TopicPartition
from sdk.admin import SyncAdmin, TopicDescription
from sdk.replay import Archive, ArchiveConfig, replay
from storage.codec import decode_batches, encode_batch
from storage.errors import (
    InconsistentTopicIdError,
    TopicDeletionInProgressError,
    UnknownTopicIdError,
    UnknownTopicOrPartitionError,
)
from storage.metadata import AsyncZooKeeper, MetadataStore, TopicConfig, TopicSpec
from storage.metadata.groups import CommittedOffset, TopicCommits, decode_offsets, encode_offsets
from storage.protocol import messages as m
from storage.tier import ObjectStore, ObjectStoreConfig
from tests.cluster import AgentHandle, Cluster, WireClient
from tests.faulty_proxy import FaultyProxy
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot, metric_value, scrape_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "t"
SPLIT = {0: 5_200, 1: 8_000, 2: 6_800}  # the 20,000 records, as its group committed them
TOPIC_CONFIGS = {"segment.bytes": 65536, "segment.ms": 1000}


# ---------------------------------------------------------------- the stack


@dataclass
class Stack:
    cluster: Cluster
    admin: SyncAdmin
    url: str
    configs: tuple[str, ...]
    s3: S3Target

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    def archive(self) -> Archive:
        return Archive(archive_config(self.s3))


def archive_config(s3: S3Target) -> ArchiveConfig:
    return ArchiveConfig(
        bucket=s3.bucket,
        endpoint_url=s3.endpoint_url,
        region=s3.region,
        access_key_id=s3.access_key_id,
        secret_access_key=s3.secret_access_key,
    )


def start_stack(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
    *extra: str,
) -> Stack:
    configs = (
        f"s3.bucket={s3.bucket}",
        "tier.check.interval.ms=100",
        "s3.request.timeout.ms=5000",
        "group.initial.rebalance.delay.ms=300",
        *extra,
    )
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    for agent_id in (1, 2, 3):
        cluster.start_agent(agent_id, *configs, env=s3.env())
    runtime = processes.start(command(zk_chroot.connect_string), name="admin", cwd=ROOT)
    url = wait_for_listening(runtime.popen, runtime.log_path)
    return Stack(cluster, SyncAdmin(url, timeout=10), url, configs, s3)


def create(stack: Stack, configs: dict[str, Any] | None = None) -> TopicDescription:
    created = stack.admin.create_topic(TOPIC, 3, 3, configs or TOPIC_CONFIGS)
    stack.cluster.wait_for_leaders(TOPIC)
    return created


def wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def deleted(stack: Stack) -> bool:
    try:
        stack.admin.describe_topic(TOPIC)
    except UnknownTopicOrPartitionError:
        return True
    return False


def create_again_as_soon_as_allowed(stack: Stack, timeout: float = 60.0) -> tuple[Any, int]:
    """Create the topic in a loop until the admin accepts; (description, refusals seen)."""
    refusals = 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            return create(stack), refusals
        except TopicDeletionInProgressError as exc:
            assert "being deleted" in str(exc)
            refusals += 1
        if time.monotonic() > deadline:
            raise TimeoutError("the name never became free")
        time.sleep(0.05)


def keys(s3: S3Target, prefix: str) -> list[str]:
    out: list[str] = []
    for page in s3.client.get_paginator("list_objects_v2").paginate(
        Bucket=s3.bucket, Prefix=prefix
    ):
        out.extend(o["Key"] for o in page.get("Contents", []))
    return out


def old_id_objects(s3: S3Target, topic_id: str) -> list[str]:
    """Segment objects of ``topic_id`` and snapshots that name it."""
    found = keys(s3, f"topics/{TOPIC}/{topic_id}/")
    for key in keys(s3, f"manifests/{TOPIC}/"):
        body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        if topic_id.encode() in body:
            found.append(key)
    return found


def value(tag: bytes, p: int, i: int) -> bytes:
    return b"%s-%d-%06d|" % (tag, p, i) + b"x" * 60


async def produce(bootstrap: str, tag: bytes, split: dict[int, int], chunk: int = 1000) -> None:
    config = {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5}
    async with Producer(config) as producer:
        for p, n in split.items():
            for lo in range(0, n, chunk):
                batch = [value(tag, p, i) for i in range(lo, min(n, lo + chunk))]
                await producer.send_batch(TOPIC, batch, partition=p)
                if chunk < 1000:
                    await producer.flush()  # one small batch at a time: many small segments
        await producer.flush()


def expected(tag: bytes, split: dict[int, int]) -> set[tuple[int, int, bytes]]:
    return {(p, i, value(tag, p, i)) for p, n in split.items() for i in range(n)}


async def read_all(consumer: Consumer, count: int) -> list[tuple[int, int, bytes]]:
    """``count`` records, then one more poll that must bring nothing (an exact count)."""
    got: list[tuple[int, int, bytes]] = []
    async with asyncio.timeout(60):
        while len(got) < count:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                got.extend((tp.partition, r.offset, r.value) for r in records)
    for records in (await consumer.getmany(timeout_ms=1000)).values():
        got.extend((r.partition, r.offset, r.value) for r in records)
    return got


async def group_reads(bootstrap: str, count: int) -> list[tuple[int, int, bytes]]:
    config = {
        "bootstrap.servers": bootstrap,
        "group.id": "g",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    }
    async with Consumer(config) as consumer:
        consumer.subscribe([TOPIC])
        got = await read_all(consumer, count)
        await consumer.commit()
    return got


async def assigned_reads(bootstrap: str, count: int) -> list[tuple[int, int, bytes]]:
    async with Consumer({"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest"}) as c:
        c.assign([TopicPartition(TOPIC, p) for p in range(3)])
        return await read_all(c, count)


def tiered(stack: Stack, topic_id: str, ends: dict[int, int]) -> bool:
    try:
        snaps = stack.archive().incarnation(TOPIC, topic_id)
    except UnknownTopicOrPartitionError:
        return False
    return all(p in snaps and snaps[p].manifest.end >= end for p, end in ends.items())


def replayed(stack: Stack) -> list[bytes]:
    """Values replay returns; [] when the topic has no snapshot (unknown)."""
    try:
        return [v for t in replay(TOPIC, archive=stack.archive()) for v in t["value"].to_pylist()]
    except UnknownTopicOrPartitionError:
        return []


def offsets_znode(zk: KazooClient, group: str = "g") -> TopicCommits | None:
    if zk.exists(f"/groups/{group}/offsets/{TOPIC}") is None:
        return None
    return decode_offsets(zk.get(f"/groups/{group}/offsets/{TOPIC}")[0])


# ---------------------------------------------------------------- DeleteObjects


def test_objects_are_deleted_in_batches_and_counted_page_by_page(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    for i in range(23):
        s3.client.put_object(Bucket=s3.bucket, Key=f"topics/x/id/0/{i:05d}.seg", Body=b"x")
    s3.client.put_object(Bucket=s3.bucket, Key="topics/x/other/0/00000.seg", Body=b"x")

    async def run() -> tuple[int, list[str], int]:
        store = ObjectStore(
            ObjectStoreConfig(bucket=s3.bucket, endpoint_url=s3.endpoint_url, region=s3.region)
        )
        try:
            total = await store.count("topics/x/id/", page_keys=5)  # five pages, one short
            page = await store.list_keys("topics/x/id/", max_keys=10)
            with pytest.raises(ValueError, match="at most 1000"):
                await store.delete_many([f"k{i}" for i in range(1001)])
            await store.delete_many([*page, "topics/x/id/0/not-there.seg"])  # missing: fine
            rest = await store.count("topics/x/id/", page_keys=5)
            return total, page, rest
        finally:
            await store.close()

    total, page, rest = asyncio.run(run())
    assert (total, len(page), rest) == (23, 10, 13)
    assert keys(s3, "topics/x/id/")[0] == "topics/x/id/0/00010.seg"  # the first ten went
    assert keys(s3, "topics/x/other/") == ["topics/x/other/0/00000.seg"]  # another prefix: kept


# ---------------------------------------------------------------- Spark


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from spark.source import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("strata-topic-delete")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


def spark_values(spark: Any, s3: S3Target) -> list[bytes]:
    c = archive_config(s3)
    df = (
        spark.read.format("strata")
        .option("topic", TOPIC)
        .option("bucket", c.bucket)
        .option("endpoint", c.endpoint_url)
        .option("region", c.region)
        .option("accessKey", c.access_key_id)
        .option("secretKey", c.secret_access_key)
        .load()
    )
    return [bytes(r["value"]) for r in df.select("value").collect()]


def spark_values_or_unknown(spark: Any, s3: S3Target) -> list[bytes]:
    try:
        return spark_values(spark, s3)
    except Exception as exc:  # Spark wraps the planner's error; its text names the class
        assert "UnknownTopicOrPartitionError" in str(exc), exc
        return []


# ---------------------------------------------------------------- the scenario


def test_delete_and_create_again_gives_a_clean_topic(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    stack = start_stack(processes, zk_chroot, s3, tmp_path)
    old = create(stack)
    asyncio.run(produce(stack.bootstrap, b"old", SPLIT))
    first = asyncio.run(group_reads(stack.bootstrap, 20_000))
    assert set(first) == expected(b"old", SPLIT)
    committed = offsets_znode(zk_client)
    assert committed is not None and committed.topic_id == old.topic_id
    assert {p: c.offset for p, c in committed.offsets.items()} == SPLIT
    wait("the old topic tiered", lambda: tiered(stack, old.topic_id, SPLIT))
    assert keys(s3, f"topics/{TOPIC}/{old.topic_id}/")

    asked = time.monotonic()
    deleting = stack.admin.delete_topic(TOPIC)
    assert deleting.deletion is not None and deleting.topic_id == old.topic_id
    new, refusals = create_again_as_soon_as_allowed(stack)
    assert refusals > 0  # the name was taken while the delete ran
    assert new.topic_id != old.topic_id and new.deletion is None
    # at once: nothing of the old topic, in replay or Spark (nothing of the new one tiered yet)
    assert not [v for v in replayed(stack) if v.startswith(b"old")]
    assert not [v for v in spark_values_or_unknown(spark, s3) if v.startswith(b"old")]
    committed = offsets_znode(zk_client)
    assert committed is None  # step 6 removed them; nothing committed for the new topic yet

    asyncio.run(produce(stack.bootstrap, b"new", SPLIT))
    fresh = expected(b"new", SPLIT)
    group = asyncio.run(group_reads(stack.bootstrap, 20_000))
    assert len(group) == 20_000 and set(group) == fresh  # from offset 0, no old offsets applied
    everything = asyncio.run(assigned_reads(stack.bootstrap, 20_000))
    assert len(everything) == 20_000 and set(everything) == fresh
    committed = offsets_znode(zk_client)
    assert committed is not None and committed.topic_id == new.topic_id

    wait("the new topic tiered", lambda: tiered(stack, new.topic_id, SPLIT))
    new_values = sorted(v for _, _, v in fresh)
    assert sorted(replayed(stack)) == new_values
    assert sorted(spark_values(spark, s3)) == new_values

    left = asked + 60 - time.monotonic()
    assert wait("no object of the old id", lambda: not old_id_objects(s3, old.topic_id), left)
    assert keys(s3, f"topics/{TOPIC}/{new.topic_id}/")  # the new topic's are there


# ---------------------------------------------------------------- the controller dies in step 5


def controller_id(zk: KazooClient) -> int:
    return int(json.loads(zk.get("/controller")[0])["agent_id"])


def test_controller_killed_in_the_middle_of_deleting_objects(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    host, port = s3.endpoint_url.rsplit("/", 1)[-1].split(":")
    with FaultyProxy(host, int(port)) as proxy:
        stack = start_stack(
            processes,
            zk_chroot,
            s3,
            tmp_path,
            f"s3.endpoint.url={proxy.endpoint_url}",
            "topic.delete.batch.size=5",
            "s3.request.timeout.ms=20000",
        )
        small = {"segment.bytes": 4096, "segment.ms": 1000}
        old = create(stack, small)
        split = {0: 600, 1: 600, 2: 600}
        asyncio.run(produce(stack.bootstrap, b"old", split, chunk=40))
        wait("tiered", lambda: tiered(stack, old.topic_id, split))
        objects = len(keys(s3, f"topics/{TOPIC}/{old.topic_id}/"))
        assert objects > 10  # several batches of 5

        # the first DeleteObjects of segment keys goes through; the next one is held
        proxy.hold(f"<Key>topics/{TOPIC}/".encode(), after=1)
        stack.admin.delete_topic(TOPIC)
        wait("a DeleteObjects held", lambda: proxy.held >= 1)
        spec = TopicSpec.model_validate_json(zk_client.get(f"/topics/{TOPIC}")[0])
        assert spec.deletion is not None
        assert (spec.deletion.step.value, spec.deletion.objects_deleted) == ("delete_objects", 5)
        assert spec.deletion.objects_total >= objects

        # the status, as users see it: the admin API, the CLI, the metrics
        status = stack.admin.describe_topic(TOPIC).deletion
        assert status is not None and (status.step_number, status.step) == (5, "delete_objects")
        assert status.objects_left == spec.deletion.objects_total - 5 > 0
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "infra.cli",
                "--admin-url",
                stack.url,
                "topics",
                "describe",
                TOPIC,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert cli.returncode == 0, cli.stderr
        assert "being deleted: step 5/7 delete_objects" in " ".join(cli.stdout.split())
        url = stack.cluster.agents[1].metrics_url
        wait(
            "the metrics show the delete",
            lambda: (
                metric_value(page := scrape_metrics(url), "strata_topics_pending_deletion") == 1
                and metric_value(page, "strata_topic_deletion_objects_left") == status.objects_left
            ),
            10,
        )

        victim = controller_id(zk_client)
        epoch = int(zk_client.get("/controller_epoch")[0])
        stack.cluster.kill(victim)
        proxy.release()
        stack.cluster.start_agent(victim, *stack.configs, env=s3.env())

        wait("the delete completed by the next controller", lambda: deleted(stack), 90)
        assert int(zk_client.get("/controller_epoch")[0]) > epoch  # another term finished it
        assert old_id_objects(s3, old.topic_id) == []
        assert zk_client.exists(f"/topics/{TOPIC}") is None

        # the name starts clean, and nothing of the delete touches the new topic
        new = create(stack, small)
        asyncio.run(produce(stack.bootstrap, b"new", split))
        wait("the new topic tiered", lambda: tiered(stack, new.topic_id, split))
        assert sorted(replayed(stack)) == sorted(v for _, _, v in expected(b"new", split))
        got = asyncio.run(assigned_reads(stack.bootstrap, 1_800))
        assert set(got) == expected(b"new", split)
        assert old_id_objects(s3, old.topic_id) == []
        for agent in (1, 2, 3):
            for d in (tmp_path / "data" / f"agent-{agent}").glob(f"{TOPIC}-*"):
                assert (d / "partition.metadata").read_text().endswith(f"{new.topic_id}\n")


# ---------------------------------------------------------------- delete, no re-create


def test_delete_without_create_again_leaves_nothing(
    spark: Any,
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    stack = start_stack(processes, zk_chroot, s3, tmp_path)
    old = create(stack)
    split = {0: 1_000, 1: 1_000, 2: 1_000}
    asyncio.run(produce(stack.bootstrap, b"old", split))
    asyncio.run(group_reads(stack.bootstrap, 3_000))
    wait("tiered", lambda: tiered(stack, old.topic_id, split))
    assert len(replayed(stack)) == 3_000
    # one replica is down through the whole delete: it does not hold the delete up, and
    # removes its copy of the deleted topic when it comes back
    stack.cluster.stop(3)
    down = tmp_path / "data" / "agent-3"
    assert sorted(d.name for d in down.glob(f"{TOPIC}-*")) == ["t-0", "t-1", "t-2"]

    stack.admin.delete_topic(TOPIC)
    wait("the delete completed", lambda: deleted(stack))
    stack.cluster.start_agent(3, *stack.configs, env=s3.env())
    wait("the returning agent's stray copy removed", lambda: not list(down.glob(f"{TOPIC}-*")))

    with pytest.raises(UnknownTopicOrPartitionError):
        list(replay(TOPIC, archive=stack.archive()))
    with pytest.raises(Exception, match="UnknownTopicOrPartitionError"):
        spark_values(spark, s3)
    assert zk_client.exists(f"/groups/g/offsets/{TOPIC}") is None
    assert zk_client.exists("/groups/g") is not None  # the group itself stays
    assert keys(s3, f"topics/{TOPIC}/") == [] and keys(s3, f"manifests/{TOPIC}/") == []
    assert not list((tmp_path / "data").glob(f"agent-*/{TOPIC}-*"))
    for agent in stack.cluster.agents.values():
        assert (
            metric_value(scrape_metrics(agent.metrics_url), "strata_topics_pending_deletion") == 0
        )

    # a commit of the old topic that lands after step 6 (a race): never shown nor handed out
    stale = TopicCommits(old.topic_id, {0: CommittedOffset(1_000, None, 1)})
    zk_client.create(f"/groups/g/offsets/{TOPIC}", encode_offsets(stale))
    assert stack.admin.describe_group("g")["offsets"] == []
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "-o",
            "json",
            "--zookeeper",
            zk_chroot.connect_string,
            "--bootstrap",
            stack.bootstrap,
            "groups",
            "describe",
            "g",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["offsets"] == []
    with pytest.raises(UnknownTopicOrPartitionError):
        stack.admin.reset_offsets("g", TOPIC, "earliest")

    async def committed() -> Any:
        async with Consumer({"bootstrap.servers": stack.bootstrap, "group.id": "g"}) as c:
            return await c.committed(TopicPartition(TOPIC, 0))

    assert asyncio.run(committed()) is None


# ---------------------------------------------------------------- clients across the delete


def test_running_producer_and_consumer_never_touch_the_old_incarnation(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    """A producer sends all along (one record every 2 ms, round robin); a consumer assigned
    every partition reads all along. The topic is deleted and created again under them.

    * every record acknowledged once serving had stopped is in the new topic, where its
      acknowledgement said: nothing was written into the old log after the delete began;
    * the consumer read each partition's old records, then the new topic from offset 0 to its
      end, record for record as the new topic has them: it never read the old log after the
      re-create, nor the new one at an offset meant for the old one.
    """
    stack = start_stack(processes, zk_chroot, s3, tmp_path)
    create(stack, {"segment.bytes": 1 << 20})
    acks: dict[bytes, tuple[int, int, float]] = {}  # value -> (partition, offset, ack time)
    failures: list[BaseException] = []
    seen: dict[int, list[tuple[int, bytes]]] = defaultdict(list)

    async def scenario() -> float:
        stop_producing, stop_consuming = asyncio.Event(), asyncio.Event()
        progress = asyncio.Event()  # an acknowledgement or a poll happened

        def acknowledged(v: bytes, fut: asyncio.Future[Any]) -> None:
            if fut.exception() is not None:
                failures.append(fut.exception())  # type: ignore[arg-type]
            else:
                acks[v] = (fut.result().partition, fut.result().offset, time.monotonic())
            progress.set()

        async def producing() -> None:
            config = {
                "bootstrap.servers": stack.bootstrap,
                "acks": "all",
                "linger.ms": 1,
                "delivery.timeout.ms": 120_000,
                "max.block.ms": 120_000,
            }
            async with Producer(config) as producer:
                n = 0
                while not stop_producing.is_set():
                    v = b"%08d" % n
                    fut = await producer.send(TOPIC, v, partition=n % 3)
                    fut.add_done_callback(lambda f, v=v: acknowledged(v, f))
                    n += 1
                    await asyncio.sleep(0.002)
                await producer.flush()

        async def consuming() -> None:
            config = {"bootstrap.servers": stack.bootstrap, "auto.offset.reset": "earliest"}
            async with Consumer(config) as consumer:
                consumer.assign([TopicPartition(TOPIC, p) for p in range(3)])
                while not stop_consuming.is_set():
                    for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                        seen[tp.partition].extend((r.offset, r.value) for r in records)
                    progress.set()

        async def until(what: str, check: Callable[[], bool]) -> None:
            try:
                async with asyncio.timeout(60):
                    while not check():
                        progress.clear()
                        await progress.wait()
            except TimeoutError:
                raise TimeoutError(what) from None

        def stopped_serving() -> bool:
            try:
                status = stack.admin.describe_topic(TOPIC).deletion
            except UnknownTopicOrPartitionError:
                return True
            return status is not None and status.step_number >= 3

        tasks = [asyncio.create_task(producing()), asyncio.create_task(consuming())]
        await until("records before the delete", lambda: sum(map(len, seen.values())) >= 300)
        await asyncio.to_thread(stack.admin.delete_topic, TOPIC)
        await asyncio.to_thread(wait, "serving stopped", stopped_serving)
        fenced_at = time.monotonic()
        await asyncio.to_thread(create_again_as_soon_as_allowed, stack)
        await until(
            "records acknowledged by the new topic",
            lambda: sum(1 for a in list(acks.values()) if a[2] > fenced_at) >= 300,
        )
        stop_producing.set()
        await tasks[0]
        later = {v for v, a in acks.items() if a[2] > fenced_at}
        await until(
            "the consumer read them all",
            lambda: later <= {v for recs in seen.values() for _, v in recs},
        )
        stop_consuming.set()
        await tasks[1]
        return fenced_at

    fenced_at = asyncio.run(scenario())
    assert failures == []  # every record was delivered: none was lost to the delete
    later = [a for a in acks.values() if a[2] > fenced_at]
    fresh = asyncio.run(assigned_reads(stack.bootstrap, len(later)))
    new_log: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    for p, offset, v in sorted(fresh):
        new_log[p].append((offset, v))
    for records in new_log.values():
        assert [o for o, _ in records] == list(range(len(records)))  # the new topic, from 0
    in_new = {(p, o, v) for p, recs in new_log.items() for o, v in recs}
    assert len(in_new) == len(later)
    for v, (p, offset, at) in acks.items():
        if at > fenced_at:  # acknowledged after serving stopped: it is in the new topic
            assert (p, offset, v) in in_new, (v, p, offset)
    for p in range(3):
        records = seen[p]
        start = next(i for i, (o, v) in enumerate(records) if o == 0 and (p, o, v) in in_new)
        old_part, new_part = records[:start], records[start:]
        assert old_part, "the consumer read the old topic before the delete"
        assert [o for o, _ in old_part] == list(range(len(old_part)))
        for o, v in old_part:  # each old record is what the producer was told it stored
            assert acks[v][:2] == (p, o) and acks[v][2] <= fenced_at
        assert new_part == new_log[p]  # the whole new topic, from offset 0, nothing else


# ---------------------------------------------------------------- the wire, by topic id


async def wire_calls(agent: AgentHandle, topic_id: str | None, value: bytes) -> dict[str, Any]:
    """A Produce, a Fetch from offset 0 and an OffsetCommit for partition 0 of the topic, each
    naming ``topic_id``: each one's error code, and what was stored or read."""
    client = await WireClient.connect(agent.host, agent.port)
    try:
        produced = await client.call(
            m.ApiKey.PRODUCE,
            m.ProduceRequest(
                -1,
                10_000,
                [m.ProduceTopic(TOPIC, [m.ProducePartition(0, encode_batch([value]))], topic_id)],
            ),
        )
        fetched = await client.call(
            m.ApiKey.FETCH,
            m.FetchRequest(
                -1,
                0,
                1,
                1 << 20,
                0,
                [m.FetchTopic(TOPIC, [m.FetchPartition(0, 0, 1 << 20, -1)], topic_id)],
            ),
        )
        committed = await client.call(
            m.ApiKey.OFFSET_COMMIT,
            m.OffsetCommitRequest(
                "g",
                -1,
                "",
                None,
                [m.OffsetCommitTopic(TOPIC, [m.OffsetCommitPartition(0, 1, None)], topic_id)],
            ),
        )
    finally:
        await client.close()
    p = produced.topics[0].partitions[0]
    f = fetched.topics[0].partitions[0]
    return {
        "produce": p.error_code,
        "offset": p.base_offset if p.error_code == 0 else None,
        "fetch": f.error_code,
        "values": []
        if not f.records
        else [r["value"] for r in decode_batches(f.records).to_pylist()],
        "commit": committed.topics[0].partitions[0].error_code,
    }


TXN_GROUP = "gt"


async def txn_offset_commit(agent: AgentHandle, producer_id: int, topic_id: str | None) -> int:
    """A TxnOffsetCommit of offset 1 of partition 0 for ``TXN_GROUP``: its error code."""
    resp = await WireClient.call_once(
        agent.host,
        agent.port,
        m.ApiKey.TXN_OFFSET_COMMIT,
        m.TxnOffsetCommitRequest(
            "tx",
            TXN_GROUP,
            producer_id,
            0,
            -1,
            "",
            None,
            [m.OffsetCommitTopic(TOPIC, [m.OffsetCommitPartition(0, 1, None)], topic_id)],
        ),
    )
    return int(resp.topics[0].partitions[0].error_code)


async def commit_marker(agent: AgentHandle, producer_id: int) -> int:
    """The commit marker of ``producer_id``'s transaction for ``TXN_GROUP``: the group's code."""
    resp = await WireClient.call_once(
        agent.host,
        agent.port,
        m.ApiKey.WRITE_TXN_MARKERS,
        m.WriteTxnMarkersRequest([m.TxnMarker(producer_id, 0, 1, 1, [], [TXN_GROUP])]),
    )
    return int(resp.markers[0].groups[0].error_code)


def test_requests_naming_a_deleted_incarnation_are_refused_on_the_wire(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    tmp_path: Path,
) -> None:
    """What an agent answers a client still holding a deleted incarnation's topic id (KIP-516):
    ``INCONSISTENT_TOPIC_ID`` once the name has a new incarnation, ``UNKNOWN_TOPIC_ID`` once no
    topic has it; nothing is written to, read from or committed for either incarnation. The
    same for transactional offsets (TxnOffsetCommit), and offsets parked for an incarnation
    deleted before their commit marker are dropped by it."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    agent = cluster.start_agent(1)
    runtime = processes.start(command(zk_chroot.connect_string), name="admin", cwd=ROOT)
    admin = SyncAdmin(wait_for_listening(runtime.popen, runtime.log_path), timeout=10)

    def create_and_lead() -> str:
        topic_id = str(wait("the name free", lambda: try_create(admin)))
        cluster.wait_for_leaders(TOPIC)
        assert cluster.metadata([TOPIC]).topics[0].topic_id == topic_id
        wait("the leader serving", lambda: asyncio.run(fetch_error(agent, topic_id)) == 0)
        return topic_id

    old = create_and_lead()
    assert asyncio.run(wire_calls(agent, old, b"old")) == {
        "produce": 0, "offset": 0, "fetch": 0, "values": [b"old"], "commit": 0,
    }  # fmt: skip
    assert asyncio.run(txn_offset_commit(agent, 7001, old)) == 0  # parked until its marker
    admin.delete_topic(TOPIC)
    new = create_and_lead()
    assert new != old
    # the old incarnation's parked transactional offsets are dropped by their commit marker
    assert asyncio.run(commit_marker(agent, 7001)) == 0
    assert offsets_znode(zk_client, TXN_GROUP) is None
    assert asyncio.run(txn_offset_commit(agent, 7002, old)) == InconsistentTopicIdError.code
    assert asyncio.run(txn_offset_commit(agent, 7003, new)) == 0
    assert asyncio.run(commit_marker(agent, 7003)) == 0
    in_txn = offsets_znode(zk_client, TXN_GROUP)
    assert in_txn is not None and in_txn.topic_id == new and in_txn.offsets[0].offset == 1

    stale = asyncio.run(wire_calls(agent, old, b"stale"))
    code = InconsistentTopicIdError.code
    assert stale == {"produce": code, "offset": None, "fetch": code, "values": [], "commit": code}
    assert offsets_znode(zk_client) is None  # the old commit went with the old topic; none since
    assert asyncio.run(wire_calls(agent, new, b"new")) == {
        "produce": 0, "offset": 0, "fetch": 0, "values": [b"new"], "commit": 0,
    }  # fmt: skip
    committed = offsets_znode(zk_client)
    assert committed is not None and committed.topic_id == new

    admin.delete_topic(TOPIC)
    wait("the delete completed", lambda: zk_client.exists(f"/topics/{TOPIC}") is None)
    gone = asyncio.run(wire_calls(agent, new, b"gone"))
    code = UnknownTopicIdError.code
    assert gone == {"produce": code, "offset": None, "fetch": code, "values": [], "commit": code}
    assert zk_client.exists(f"/groups/g/offsets/{TOPIC}") is None
    assert asyncio.run(txn_offset_commit(agent, 7004, new)) == UnknownTopicIdError.code
    by_name = asyncio.run(wire_calls(agent, None, b"by name"))  # a client without ids
    assert (by_name["produce"], by_name["fetch"]) == (UnknownTopicOrPartitionError.code,) * 2


async def fetch_error(agent: AgentHandle, topic_id: str) -> int:
    fetch = m.FetchRequest(
        -1, 0, 1, 1 << 20, 0, [m.FetchTopic(TOPIC, [m.FetchPartition(0, 0, 1 << 20)], topic_id)]
    )
    resp = await WireClient.call_once(agent.host, agent.port, m.ApiKey.FETCH, fetch)
    return int(resp.topics[0].partitions[0].error_code)


def try_create(admin: SyncAdmin) -> str | None:
    try:
        return admin.create_topic(TOPIC, 1, 1).topic_id
    except TopicDeletionInProgressError:
        return None


# ---------------------------------------------------------------- Kafka's DeleteTopics


def test_kafka_delete_topics_marks_the_topic_for_the_controller(zk_chroot: ZooKeeperChroot) -> None:
    """The Kafka listener's DeleteTopics deletes as the admin API does: it marks the spec
    (step 1) and leaves the rest to the controller (none runs here, so the mark stays, and the
    topic's node with it). A second delete answers again without a new mark; growing or
    describing the topic meanwhile answers UNKNOWN_TOPIC_OR_PARTITION, as for a topic that
    does not exist."""
    unknown = UnknownTopicOrPartitionError.code

    async def run() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            store = MetadataStore(zk)
            await store.init()
            spec = TopicSpec.build(
                name=TOPIC,
                partitions=2,
                replication_factor=1,
                config=TopicConfig(),
                topic_id="0" * 31 + "1",
                created_ms=int(time.time() * 1000),
            )
            await store.create_topic(spec)
            kafka = KafkaTopicAdmin(store)

            async def delete(name: str) -> list[dict[str, Any]]:
                got = await kafka.delete_topics({"topic_names": [name], "timeout_ms": 1000}, 3)
                return list(got["responses"])

            assert await delete(TOPIC) == [{"name": TOPIC, "error_code": 0}]
            marked, _ = await store.get_topic(TOPIC)
            assert marked.deletion is not None and marked.topic_id == spec.topic_id
            assert await delete(TOPIC) == [{"name": TOPIC, "error_code": 0}]
            again, _ = await store.get_topic(TOPIC)
            assert again.deletion == marked.deletion
            assert await delete("no-such-topic") == [
                {"name": "no-such-topic", "error_code": unknown}
            ]

            grow = await kafka.create_partitions(
                {
                    "topics": [{"name": TOPIC, "count": 4, "assignments": None}],
                    "timeout_ms": 1000,
                    "validate_only": False,
                },
                1,
            )
            assert [r["error_code"] for r in grow["results"]] == [unknown]
            described = await kafka.describe_configs(
                {
                    "resources": [
                        {"resource_type": 2, "resource_name": TOPIC, "configuration_keys": None}
                    ]
                },
                3,
            )
            assert [r["error_code"] for r in described["results"]] == [unknown]
            after, _ = await store.get_topic(TOPIC)
            assert after.partitions == 2 and after.deletion == marked.deletion
        finally:
            await zk.stop()

    asyncio.run(run())
