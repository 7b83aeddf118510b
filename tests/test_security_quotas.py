"""Client quotas: the rules on a virtual clock, then a greedy producer and a greedy consumer
held to their rates by a real agent while another principal's requests go on undisturbed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker_agents.security.quotas import MAX_THROTTLE_S, Quotas, exempt
from sdk import Consumer, Producer, TopicPartition
from sdk.auth import ScramLogin
from storage.errors import InvalidRequestError
from storage.metadata import AsyncZooKeeper
from storage.metadata.quotas import QuotaConfig, QuotaStore, encode_quotas, parse_quota
from storage.metadata.users import ScramCredential, UserStore
from storage.protocol import messages as m
from tests.cluster import ROOT, Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot


# ---- the rules, on a virtual clock -----------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _quotas(limits: dict[str, QuotaConfig], burst_s: float = 1.0, **kw: Any) -> Quotas:
    q = Quotas(kw.get("super_users", frozenset()), burst_s=burst_s, clock=kw["clock"])
    q.update(encode_quotas(limits))
    return q


def test_a_client_that_waits_out_its_throttle_gets_its_rate() -> None:
    """A greedy client that sends as soon as its answer comes gets the rate, plus the burst."""
    clock = Clock()
    q = _quotas({"User:a": QuotaConfig(producer_byte_rate=1000)}, clock=clock)
    start, sent = clock.now, 0
    while clock.now - start < 100:
        sent += 300
        clock.now += q.charge("User:a", m.ApiKey.PRODUCE, 300, 0)
    assert 1000 * 100 <= sent <= 1000 * 101 + 300  # rate x time, plus one burst second


def test_who_is_limited_and_by_what() -> None:
    clock = Clock()
    q = _quotas(
        {
            "User:*": QuotaConfig(consumer_byte_rate=100),
            "User:a": QuotaConfig(producer_byte_rate=100),
            "User:r": QuotaConfig(request_rate=1000),
        },
        burst_s=0.0,
        super_users=frozenset({"User:admin"}),
        clock=clock,
    )
    # a's own entry replaces the default: fetches are free for a, produce is not
    assert q.charge("User:a", m.ApiKey.FETCH, 0, 10_000) == 0
    assert q.charge("User:a", m.ApiKey.PRODUCE, 200, 0) == pytest.approx(2.0)
    # anyone else has the default, each principal on its own clock
    assert q.charge("User:b", m.ApiKey.FETCH, 0, 50) == pytest.approx(0.5)
    assert q.charge("User:c", m.ApiKey.FETCH, 0, 50) == pytest.approx(0.5)
    assert q.charge("User:b", m.ApiKey.PRODUCE, 10**9, 0) == 0
    # super users never wait; nor does a clock run further ahead than the cap
    assert q.charge("User:admin", m.ApiKey.FETCH, 0, 10**9) == 0
    assert q.charge("User:c", m.ApiKey.FETCH, 0, 10**9) == MAX_THROTTLE_S
    assert q.throttled == 4
    # the request rate counts every request: 3,000 at once wait up to 3 s
    waits = [q.charge("User:r", m.ApiKey.HEARTBEAT, 0, 0) for _ in range(3000)]
    assert waits[0] == pytest.approx(0.001) and waits[-1] == pytest.approx(3.0)


def test_the_agents_own_traffic_is_never_counted() -> None:
    replica = m.FetchRequest(2, 500, 1, 1 << 20, 0, [])
    consumer = m.FetchRequest(-1, 500, 1, 1 << 20, 0, [])
    assert exempt(m.ApiKey.FETCH, replica) and not exempt(m.ApiKey.FETCH, consumer)
    assert exempt(m.ApiKey.WRITE_TXN_MARKERS, None)
    assert exempt(m.ApiKey.OFFSET_FOR_LEADER_EPOCH, None)


def test_quotas_that_do_not_parse_keep_the_previous_ones() -> None:
    clock = Clock()
    q = _quotas({"User:a": QuotaConfig(request_rate=5)}, clock=clock)
    q.update(b'{"User:a": {"request_rate": -1}}')
    assert q.limit("User:a") == QuotaConfig(request_rate=5)
    q.update(None)  # the znode removed: no quotas
    assert q.limit("User:a") is None


@pytest.mark.parametrize(
    ("principal", "body", "says"),
    [
        ("alice", {"request_rate": 1}, "User:<name>"),
        ("User:a b", {"request_rate": 1}, "User:<name>"),
        ("User:a", {"request_rate": 0}, "request_rate"),
        ("User:a", {"producer_byte_rate": "fast"}, "producer_byte_rate"),
        ("User:a", {"bytes": 1}, "bytes"),
        ("User:a", [1], "JSON object"),
    ],
)
def test_bad_quotas_are_refused_with_what_is_wrong(principal: str, body: Any, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says.replace("*", r"\*")):
        parse_quota(principal, body)


# ---- a real agent ----------------------------------------------------------------------------
PASSWORDS = {"alice": "alice-quota-5d1", "bob": "bob-quota-8e2", "admin": "admin-quota-3c4"}
RATE = 1_000_000  # bytes/s
VALUE = b"q" * 1000


def _zk(zk: ZooKeeperChroot, work: Any) -> None:
    async def run() -> None:
        client = AsyncZooKeeper(zk.connect_string)
        await client.start()
        try:
            await work(client)
        finally:
            await client.stop()

    asyncio.run(run())


def _set_quota(zk: ZooKeeperChroot, principal: str, quota: QuotaConfig) -> None:
    async def work(client: AsyncZooKeeper) -> None:
        await QuotaStore(client).set(principal, quota)

    _zk(zk, work)


@pytest.fixture
def cluster(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    async def users(client: AsyncZooKeeper) -> None:
        for name, password in PASSWORDS.items():
            cred = await asyncio.to_thread(ScramCredential.make, "SCRAM-SHA-512", password, 4096)
            await UserStore(client).set(name, "SCRAM-SHA-512", cred)

    _zk(zk_chroot, users)
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_login = ScramLogin("SCRAM-SHA-512", "admin", PASSWORDS["admin"])
    c.start_agent(
        1,
        "listener.security.protocol=SASL_PLAINTEXT",
        "super.users=User:admin",
        "kafka.listener=127.0.0.1:0",
    )
    for topic in ("greedy", "other"):
        c.create_topic(topic, 1)
        c.wait_for_leaders(topic)
    return c


def _conf(c: Cluster, user: str, **extra: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": c.bootstrap,
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": user,
        "sasl.password": PASSWORDS[user],
        **extra,
    }


def _rate(acks: list[tuple[float, int]], start: float, end: float) -> float:
    """Bytes per second over [start, end]: the slope of the bytes received so far against
    time (least squares; answers come in lumps of a few batches, so a count between two
    instants would depend on where they fall)."""
    window = sorted((t, n) for t, n in acks if start <= t <= end)
    assert len(window) >= 5, f"only {len(window)} answers in the window"
    times = [t for t, _ in window]
    total = list(itertools.accumulate(n for _, n in window))
    return statistics.linear_regression(times, total).slope


async def _latencies(producer: Producer, n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        await producer.send_and_wait("other", b"bob-%d" % i)
        out.append(time.perf_counter() - started)
        await asyncio.sleep(0.002)
    return out


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


@pytest.mark.slow
@pytest.mark.serial
def test_a_greedy_producer_is_held_to_its_quota_and_others_go_on(
    cluster: Cluster, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """Alice (a process of her own) sends as fast as she may under a 1 MB/s quota until the
    test is done with her (SIGTERM); her rate is taken over a 10 s window. Then Bob's
    produce latency is sampled in short blocks, with Alice stopped (SIGSTOP: Bob alone, his
    unthrottled latency) and running by turns, so that the machine's own noise falls on both
    alike. That is done five times and the median of the five ratios is held to 2x (the way
    every figure here is taken: one round's p99 is its 10th-largest sample; rounds here see
    1.0-1.8x, the alone p99 itself moving 1.0-2.4 ms from round to round, and a CI run's
    three rounds once gave 1.01x, 2.37x and 2.02x).

    What Bob's tail meets beside Alice was traced (agent-side times of each request against
    Alice's): his slow requests fall within a few ms of Alice's requests and answers (she
    sends about 320 KB at a time, her throttled batches drained together), on the agent's
    side of the socket; with her requests held to 64 KB the rounds gave 1.0-1.3x."""
    _set_quota(zk_chroot, "User:alice", QuotaConfig(producer_byte_rate=RATE))
    out = tmp_path / "alice.json"
    argv = [sys.executable, "-m", "tests.greedy_producer", "--bootstrap", cluster.bootstrap]
    argv += ["--user", "alice", "--password", PASSWORDS["alice"], "--topic", "greedy"]
    argv += ["--seconds", "300", "--out", str(out)]
    started = time.monotonic()
    alice = cluster.processes.start(argv, name="alice", cwd=ROOT)
    rounds: list[tuple[list[float], list[float]]] = []  # (alone, beside)

    async def bob() -> None:
        conf = _conf(cluster, "bob", acks=1, **{"linger.ms": 0})
        async with Producer(conf) as producer:
            await _latencies(producer, 10)  # connection, login, metadata
            await asyncio.sleep(max(0.0, started + 12 - time.monotonic()))  # the window is over
            # 960 samples a side a round (a p99 of 300 swung with the machine), in blocks of
            # 20 (about 70 ms) so that a burst of the disk's own writeback falls on both
            for _ in range(5):
                alone: list[float] = []
                beside: list[float] = []
                for _ in range(48):
                    os.kill(alice.pid, signal.SIGSTOP)
                    try:
                        alone.extend(await _latencies(producer, 20))
                    finally:
                        os.kill(alice.pid, signal.SIGCONT)
                    beside.extend(await _latencies(producer, 20))
                rounds.append((alone, beside))

    asyncio.run(bob())
    assert alice.alive, "alice stopped before the latency blocks were done"
    os.kill(alice.pid, signal.SIGTERM)  # done with her: she writes what she saw
    assert alice.wait(30) == 0
    result = json.loads(out.read_text())
    rate = _rate([(t, n) for t, n in result["acks"]], started + 1, started + 11)
    assert 0.9 * RATE <= rate <= 1.1 * RATE, f"{rate:,.0f} B/s against a quota of {RATE:,}"
    assert result["throttle_ms"] > 0, "the answers said they were held"
    seen = "; ".join(
        f"{_p99(alone) * 1000:.2f} ms alone, {_p99(beside) * 1000:.2f} ms beside alice"
        for alone, beside in rounds
    )
    print(f"bob's p99 by round: {seen}")
    ratio = statistics.median(_p99(beside) / _p99(alone) for alone, beside in rounds)
    assert ratio <= 2, f"bob's p99 beside a throttled alice: {ratio:.2f}x alone ({seen})"


@pytest.mark.slow
@pytest.mark.serial
def test_a_greedy_consumer_is_held_to_its_quota(
    cluster: Cluster, zk_chroot: ZooKeeperChroot
) -> None:
    backlog = 8 * RATE // len(VALUE)

    async def fill() -> None:
        async with Producer(_conf(cluster, "bob", acks=1)) as producer:
            for _ in range(backlog // 1000):
                await producer.send_batch("greedy", [VALUE] * 1000, partition=0)
            await producer.flush()

    asyncio.run(fill())
    _set_quota(zk_chroot, "User:alice", QuotaConfig(consumer_byte_rate=RATE))

    async def consume() -> list[tuple[float, int]]:
        got: list[tuple[float, int]] = []
        conf = _conf(
            cluster,
            "alice",
            **{"max.partition.fetch.bytes": 64 * 1024, "fetch.max.bytes": 64 * 1024},
        )
        async with Consumer(conf) as consumer:
            consumer.assign([TopicPartition("greedy", 0)])
            consumer.seek(TopicPartition("greedy", 0), 0)
            started = time.monotonic()
            while time.monotonic() < started + 6:
                batches = await consumer.getmany(timeout_ms=500)
                n = sum(len(r.value or b"") for rs in batches.values() for r in rs)
                if n:
                    got.append((time.monotonic() - started, n))
        return got

    got = asyncio.run(consume())
    assert sum(n for _, n in got) < backlog * len(VALUE), "the backlog outlasts the window"
    rate = _rate(got, 1, 6)
    assert 0.9 * RATE <= rate <= 1.1 * RATE, f"{rate:,.0f} B/s against a quota of {RATE:,}"


@pytest.mark.slow
@pytest.mark.serial
def test_the_kafka_listener_throttles_and_says_so(
    cluster: Cluster, zk_chroot: ZooKeeperChroot
) -> None:
    """An unmodified Kafka client (librdkafka) over the quota: told the throttle time in the
    answers (its ``throttle_cb`` fires) and held near the rate."""
    ck = pytest.importorskip("confluent_kafka")
    _set_quota(zk_chroot, "User:alice", QuotaConfig(producer_byte_rate=RATE))
    throttles: list[float] = []
    delivered = 0

    def done(err: Any, msg: Any) -> None:
        nonlocal delivered
        if err is None:
            delivered += len(msg.value())

    producer = ck.Producer(
        {
            "bootstrap.servers": cluster.kafka_bootstrap,
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "alice",
            "sasl.password": PASSWORDS["alice"],
            "acks": 1,
            "linger.ms": 5,
            "queue.buffering.max.kbytes": 1024,
            "throttle_cb": lambda event: throttles.append(event.throttle_time),
        }
    )
    seconds = 4.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            producer.produce("greedy", VALUE, partition=0, on_delivery=done)
        except BufferError:  # the client's buffer is full: the agent holds it back
            producer.poll(0.05)
        producer.poll(0)
    producer.purge()
    producer.flush(10)
    del producer  # librdkafka would go on dialling the agent after the test stops it
    assert throttles and max(throttles) > 0, "the answers carried a throttle time"
    # the rate and the burst, and what was in flight (loose: the precise rate is the SDK
    # test's; without the quota this client delivers some 200 MB here)
    assert delivered <= (seconds + 1) * RATE * 1.5, f"{delivered:,} bytes in {seconds} s"
