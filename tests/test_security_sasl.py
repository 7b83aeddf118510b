"""SASL/SCRAM on the agents' listeners, against real agent processes and a real ZooKeeper.

* Users in ZooKeeper (``/config/users``, salted verifiers only) log in with SCRAM-SHA-256 and
  -512 through the SDK, and through an unmodified Kafka client on the Kafka listener.
* Refused with ``AuthenticationFailedError``: a wrong password and an unknown user (the same
  answer), a replayed exchange; a request before logging in gets ``IllegalSaslStateError``
  and the connection is closed; a connection that never logs in is closed at the deadline.
* Two agents replicate with an inter-agent user (acks=all, RF 2).
* A flood of failed logins does not stall an authenticated client's requests: SCRAM work is
  bounded (``sasl.max.concurrent.authentications``), failures wait on their own connection.
* Passwords never appear in the agents' logs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from handlers.groups import GroupAdmin
from sdk import Consumer, Producer, TopicPartition
from sdk.auth import ScramLogin
from sdk.group import OffsetAndMetadata
from storage.codec import encode_batch
from storage.errors import AuthenticationFailedError, IllegalSaslStateError
from storage.metadata import AsyncZooKeeper, MetadataStore
from storage.metadata.users import ScramCredential, UserStore
from storage.protocol import messages as m
from tests.cluster import Cluster, WireClient, produce_request, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.kafka_support import refused_kafka_producer

pytestmark = pytest.mark.slow

PASSWORDS = {"alice": "alice-secret-7f3a", "agents": "agents-secret-91bc"}


def _add_users(zk: ZooKeeperChroot, users: dict[str, str]) -> None:
    async def run() -> None:
        client = AsyncZooKeeper(zk.connect_string)
        await client.start()
        try:
            store = UserStore(client)
            for name, password in users.items():
                for mech in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                    cred = await asyncio.to_thread(ScramCredential.make, mech, password, 4096)
                    await store.set(name, mech, cred)
        finally:
            await client.stop()

    asyncio.run(run())


SASL = ("listener.security.protocol=SASL_PLAINTEXT",)


def _sasl_cluster(
    processes: ProcessGroup, zk: ZooKeeperChroot, tmp_path: Path, *configs: str
) -> Cluster:
    _add_users(zk, PASSWORDS)
    c = Cluster(processes, zk, tmp_path / "data")
    c.client_login = ScramLogin("SCRAM-SHA-512", "alice", PASSWORDS["alice"])
    c.start_agent(1, *SASL, *configs)
    c.create_topic("t", 1)
    c.wait_for_leaders("t")
    return c


def _conf(c: Cluster, user: str, password: str, mech: str = "SCRAM-SHA-512") -> dict[str, Any]:
    return {
        "bootstrap.servers": c.bootstrap,
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mech,
        "sasl.username": user,
        "sasl.password": password,
        "request.timeout.ms": 5000,
    }


async def _produce(conf: dict[str, Any], values: list[bytes]) -> list[int]:
    producer = Producer(conf)
    try:
        await producer.start()
        futs = [await producer.send("t", v, partition=0) for v in values]
        await producer.flush()
        return [f.result().offset for f in futs]
    finally:
        await producer.close()


def test_scram_logins_and_refusals(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    c = _sasl_cluster(processes, zk_chroot, tmp_path)
    agent = c.agents[1]

    async def run() -> None:
        for i, mech in enumerate(("SCRAM-SHA-256", "SCRAM-SHA-512")):
            conf = _conf(c, "alice", PASSWORDS["alice"], mech)
            assert await _produce(conf, [b"m%d" % i]) == [i]
        conf = _conf(c, "alice", PASSWORDS["alice"]) | {"auto.offset.reset": "earliest"}
        async with Consumer(conf) as consumer:
            consumer.assign([("t", 0)])
            got = await read_records(consumer, 2)
        assert [r.value for r in got] == [b"m0", b"m1"]

        answers = []
        for user, password in (("alice", "wrong"), ("nobody", "whatever")):
            with pytest.raises(AuthenticationFailedError) as info:
                await _produce(_conf(c, user, password), [b"no"])
            answers.append(str(info.value).split(": ")[-1])
        # the same answer whether the user exists or not
        assert answers[0] == answers[1] == "authentication failed"

        # a request before logging in: refused, and the connection is closed
        client = await WireClient.connect(agent.host, agent.port)
        try:
            with pytest.raises(IllegalSaslStateError):
                await client.call(m.ApiKey.METADATA, m.MetadataRequest(None))
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await client.call(m.ApiKey.METADATA, m.MetadataRequest(None))
        finally:
            await client.close()

    asyncio.run(run())
    log = agent.process.log_text()
    assert "SCRAM login of 'alice'" in log  # the refusal is logged with the user ...
    for password in (*PASSWORDS.values(), "wrong", "whatever"):
        assert password not in log  # ... and never a password


def test_replayed_exchange_is_refused(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    c = _sasl_cluster(processes, zk_chroot, tmp_path)
    agent = c.agents[1]

    async def run() -> None:
        sent: list[m.Message] = []
        client = await WireClient.connect(agent.host, agent.port)
        try:

            async def recording(body: m.Message) -> Any:
                sent.append(body)
                key = next(a.key for a in m.APIS.values() if isinstance(body, a.request))
                return await client.call(key, body)

            await ScramLogin("SCRAM-SHA-256", "alice", PASSWORDS["alice"])(recording)
            md = await client.call(m.ApiKey.METADATA, m.MetadataRequest(["t"]))
            assert md.topics[0].error_code == 0  # logged in
        finally:
            await client.close()
        # the captured exchange, sent again word for word on a new connection
        replay = await WireClient.connect(agent.host, agent.port)
        try:
            handshake, first, final = sent
            await replay.call(m.ApiKey.SASL_HANDSHAKE, handshake)
            await replay.call(m.ApiKey.SASL_AUTHENTICATE, first)  # a new server nonce
            with pytest.raises(AuthenticationFailedError):
                await replay.call(m.ApiKey.SASL_AUTHENTICATE, final)
        finally:
            await replay.close()

    asyncio.run(run())


def test_a_connection_that_never_logs_in_is_closed(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    c = _sasl_cluster(processes, zk_chroot, tmp_path, "sasl.authentication.deadline.ms=500")
    agent = c.agents[1]

    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            async with asyncio.timeout(20):  # the watchdog looks every deadline/4
                assert await client.reader.read(1) == b""
        finally:
            await client.close()

    asyncio.run(run())
    assert "did not authenticate in time" in agent.process.log_text()


@pytest.mark.serial
def test_failed_login_flood_does_not_stall_others(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    c = _sasl_cluster(
        processes,
        zk_chroot,
        tmp_path,
        "sasl.max.concurrent.authentications=1",
        "connection.failed.authentication.delay.ms=200",
    )
    agent = c.agents[1]

    async def latencies(client: WireClient, n: int) -> list[float]:
        out = []
        for i in range(n):
            req = produce_request("t", 0, encode_batch([b"v%d" % i]))
            started = time.perf_counter()
            resp = await client.call(m.ApiKey.PRODUCE, req)
            out.append(time.perf_counter() - started)
            assert resp.topics[0].partitions[0].error_code == 0
        return out

    flooding = asyncio.Event()

    async def attacker(refusals: list[BaseException], stop: asyncio.Event) -> None:
        while not stop.is_set():
            wc = await WireClient.connect(agent.host, agent.port)
            try:
                await wc.login(ScramLogin("SCRAM-SHA-512", "alice", "guess"))
            except (AuthenticationFailedError, IllegalSaslStateError) as exc:
                refusals.append(exc)
                if len(refusals) >= 16:
                    flooding.set()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                await wc.close()

    async def run() -> None:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            await client.login(c.client_login)
            baseline = await latencies(client, 40)
            refusals: list[BaseException] = []
            stop = asyncio.Event()
            flood = [asyncio.create_task(attacker(refusals, stop)) for _ in range(16)]
            try:
                async with asyncio.timeout(30):
                    await flooding.wait()  # the flood is on
                during = await latencies(client, 40)
            finally:
                stop.set()
                await asyncio.gather(*flood, return_exceptions=True)
        finally:
            await client.close()
        assert all(isinstance(r, AuthenticationFailedError) for r in refusals)
        # loose on purpose (a shared machine): the flood is bounded work, not a stall; each
        # failed login waits 200 ms on its own connection and holds nothing meanwhile
        assert statistics.median(during) < statistics.median(baseline) * 5 + 0.05

    asyncio.run(run())


def test_agents_replicate_with_an_inter_agent_user(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    _add_users(zk_chroot, PASSWORDS)
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_login = ScramLogin("SCRAM-SHA-512", "alice", PASSWORDS["alice"])
    for i in (1, 2):
        c.start_agent(
            i,
            *SASL,
            "inter.agent.sasl.username=agents",
            f"inter.agent.sasl.password={PASSWORDS['agents']}",
        )
    c.create_topic("t", 1, replication_factor=2, configs={"min.insync.replicas": 2})
    c.wait_for_leaders("t")
    conf = _conf(c, "alice", PASSWORDS["alice"]) | {"acks": "all"}
    assert asyncio.run(_produce(conf, [b"r%d" % i for i in range(10)])) == list(range(10))
    for a in c.agents.values():
        assert PASSWORDS["agents"] not in a.process.log_text()


def test_kafka_client_with_scram(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    kp = pytest.importorskip("kafka")
    c = _sasl_cluster(processes, zk_chroot, tmp_path, "kafka.listener=127.0.0.1:0")
    conf: dict[str, Any] = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "alice",
        "sasl_plain_password": PASSWORDS["alice"],
        "request_timeout_ms": 10000,
    }
    producer = kp.KafkaProducer(bootstrap_servers=c.kafka_bootstrap, **conf)
    try:
        for i in range(3):
            producer.send("t", b"k%d" % i, partition=0).get(timeout=20)
    finally:
        producer.close()
    consumer = kp.KafkaConsumer(
        bootstrap_servers=c.kafka_bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=15000,
        **conf,
    )
    try:
        consumer.assign([kp.TopicPartition("t", 0)])
        got = []
        for record in consumer:
            got.append(record.value)
            if len(got) == 3:
                break
    finally:
        consumer.close()
    assert got == [b"k0", b"k1", b"k2"]
    bad = conf | {"sasl_plain_password": "wrong"}
    refused_kafka_producer(kp, bootstrap_servers=c.kafka_bootstrap, max_block_ms=5000, **bad)


def test_handlers_reach_a_secured_cluster_with_the_client_environment(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handlers make clients of their own (a group's lag, the delay scheduler, the retry
    router, redrive): on a SASL cluster they log in with STRATA_CLIENT_* from their
    environment, and without it they are refused, not left hanging."""
    c = _sasl_cluster(processes, zk_chroot, tmp_path)
    conf = _conf(c, "alice", PASSWORDS["alice"])
    asyncio.run(_produce(conf, [b"a", b"b", b"c"]))

    async def commit() -> None:
        async with Consumer({**conf, "group.id": "g", "auto.offset.reset": "earliest"}) as cons:
            cons.assign([TopicPartition("t", 0)])
            await cons.commit({TopicPartition("t", 0): OffsetAndMetadata(1)})

    asyncio.run(commit())

    async def describe() -> dict[str, Any]:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            return await GroupAdmin(MetadataStore(zk)).describe("g")
        finally:
            await zk.stop()

    monkeypatch.setenv("STRATA_CLIENT_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("STRATA_CLIENT_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("STRATA_CLIENT_SASL_USERNAME", "alice")
    monkeypatch.setenv("STRATA_CLIENT_SASL_PASSWORD", PASSWORDS["alice"])
    (offsets,) = asyncio.run(describe())["offsets"]
    assert (offsets["committed"], offsets["log_end_offset"], offsets["lag"]) == (1, 3, 2)
    monkeypatch.setenv("STRATA_CLIENT_SASL_PASSWORD", "wrong")
    with pytest.raises(AuthenticationFailedError):
        asyncio.run(describe())
