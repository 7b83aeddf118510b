"""TLS on the agents' listeners, against real agent processes and a real ZooKeeper.

* The SDK produces and consumes over TLS (``security.protocol=SSL``), two agents replicate to
  each other over it (acks=all, RF 2), and an unmodified Kafka client does the same on the
  Kafka listener.
* Refused, each with a typed error on the client (``SslAuthenticationError``): a server
  certificate from another CA, an expired one, a self-signed one; with
  ``ssl.client.auth=required``, a client without a certificate, with one from another CA, an
  expired one. A plaintext client on a TLS port is dropped (the agent logs the failed
  handshake) and the agent keeps serving TLS clients.
* Certificates are re-read without a restart when their files change.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from infra.certs import ThrowawayCA
from sdk import Consumer, Producer
from storage.errors import NetworkError, SslAuthenticationError, StrataError
from storage.protocol import messages as m
from storage.tls import TlsFiles, client_context
from tests.cluster import Cluster, WireClient, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.kafka_support import refused_kafka_producer

pytestmark = pytest.mark.slow


@pytest.fixture
def ca(tmp_path: Path) -> ThrowawayCA:
    return ThrowawayCA.create(tmp_path / "ca")


def _agent_tls(ca: ThrowawayCA, name: str = "agent", **extra: str) -> list[str]:
    issued = ca.issue(name)
    out = {
        "listener.security.protocol": "SSL",
        "ssl.certfile": str(issued.certfile),
        "ssl.keyfile": str(issued.keyfile),
        "ssl.cafile": str(ca.cafile),
        **extra,
    }
    return [f"{k}={v}" for k, v in out.items()]


def _tls_cluster(
    processes: ProcessGroup, zk: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA, *configs: str
) -> Cluster:
    c = Cluster(processes, zk, tmp_path / "data")
    c.client_ssl = client_context(TlsFiles(cafile=str(ca.cafile)))
    c.start_agent(1, *_agent_tls(ca), *configs)
    return c


def _client(c: Cluster, ca: ThrowawayCA | None, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": c.bootstrap,
        "security.protocol": "SSL",
        "request.timeout.ms": 5000,
        "retries": 0,
        **extra,
    }
    if ca is not None:
        conf["ssl.cafile"] = str(ca.cafile)
    return conf


async def _produce_one(conf: dict[str, Any], topic: str = "t") -> int:
    producer = Producer(conf)
    try:  # not ``async with``: a producer whose start fails must be closed too
        await producer.start()
        fut = await producer.send(topic, b"secret", partition=0)
        await producer.flush()
        return int(fut.result().offset)
    finally:
        await producer.close()


def test_sdk_round_trip_and_replication_over_tls(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_ssl = client_context(TlsFiles(cafile=str(ca.cafile)))
    for i in (1, 2):
        c.start_agent(i, *_agent_tls(ca, f"agent-{i}"))
    c.create_topic("t", 1, replication_factor=2, configs={"min.insync.replicas": 2})
    c.wait_for_leaders("t")

    async def run() -> None:
        conf = _client(c, ca, acks="all")
        async with Producer(conf) as producer:
            futs = [await producer.send("t", b"v%d" % i, partition=0) for i in range(20)]
            await producer.flush()
        # acks=all with min.insync.replicas=2: the follower fetched them over TLS
        assert [f.result().offset for f in futs] == list(range(20))
        consumer_conf = {k: v for k, v in conf.items() if k not in ("acks", "retries")} | {
            "auto.offset.reset": "earliest"
        }
        async with Consumer(consumer_conf) as consumer:
            consumer.assign([("t", 0)])
            got = await read_records(consumer, 20)
        assert [r.value for r in got] == [b"v%d" % i for i in range(20)]

    asyncio.run(run())


def test_client_refuses_servers_it_cannot_verify(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    other = ThrowawayCA.create(tmp_path / "other-ca", "another CA")
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_ssl = client_context(TlsFiles(cafile=str(ca.cafile)))
    good = c.start_agent(1, *_agent_tls(ca))
    c.create_topic("t", 1)
    c.wait_for_leaders("t")
    # a client that trusts the right CA is served
    assert asyncio.run(_produce_one(_client(c, ca))) == 0
    expired = ca.issue("expired-agent", expired=True)
    # a self-signed certificate: the other CA's own
    bad = {
        "expired": (expired.certfile, expired.keyfile),
        "self-signed": (other.cafile, other.directory / "ca.key"),
    }
    handles = {}
    for i, (name, (cert, key)) in enumerate(bad.items(), start=2):
        handles[name] = c.start_agent(
            i,
            "listener.security.protocol=SSL",
            f"ssl.certfile={cert}",
            f"ssl.keyfile={key}",
        )

    async def refused(address: str, cafile: Path) -> StrataError:
        conf = _client(c, None, **{"bootstrap.servers": address, "ssl.cafile": str(cafile)})
        with pytest.raises(SslAuthenticationError) as info:
            await _produce_one(conf)
        return info.value

    async def run() -> None:
        err = await refused(good.address, other.cafile)  # signed by a CA the client does not trust
        assert "certificate verify failed" in str(err)
        err = await refused(handles["expired"].address, ca.cafile)
        assert "expired" in str(err)
        err = await refused(handles["self-signed"].address, ca.cafile)
        assert "self-signed" in str(err)

    asyncio.run(run())


def test_client_certificates_required(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    other = ThrowawayCA.create(tmp_path / "other-ca", "another CA")
    c = _tls_cluster(processes, zk_chroot, tmp_path, ca, "ssl.client.auth=required")
    mine = ca.issue("alice")
    c.client_ssl = client_context(
        TlsFiles(cafile=str(ca.cafile), certfile=str(mine.certfile), keyfile=str(mine.keyfile))
    )
    c.create_topic("t", 1)
    c.wait_for_leaders("t")
    foreign = other.issue("mallory")
    stale = ca.issue("old-alice", expired=True)

    async def run() -> None:
        for cert in (None, foreign, stale):
            extra = (
                {}
                if cert is None
                else {
                    "ssl.certfile": str(cert.certfile),
                    "ssl.keyfile": str(cert.keyfile),
                }
            )
            # TLS 1.3: the client's side of the handshake is done before the agent checks its
            # certificate, and asyncio drops the agent's alert, so the client sees the
            # connection closed (retriable) rather than the reason; the agent logs the reason
            with pytest.raises((SslAuthenticationError, NetworkError)):
                await _produce_one(_client(c, ca, **extra))
        ok = {"ssl.certfile": str(mine.certfile), "ssl.keyfile": str(mine.keyfile)}
        assert await _produce_one(_client(c, ca, **ok)) == 0

    asyncio.run(run())
    log = c.agents[1].process.log_text()
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log
    assert "certificate verify failed: unable to get local issuer certificate" in log
    assert "certificate verify failed: certificate has expired" in log


def test_plaintext_client_on_a_tls_port_is_dropped(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    c = _tls_cluster(processes, zk_chroot, tmp_path, ca)
    c.create_topic("t", 1)
    c.wait_for_leaders("t")
    agent = c.agents[1]

    async def run() -> None:
        plain = {"bootstrap.servers": c.bootstrap, "request.timeout.ms": 3000, "retries": 0}
        with pytest.raises(NetworkError):
            await _produce_one(plain)
        # a raw request in plaintext: the connection is closed without an answer
        client = await WireClient.connect(agent.host, agent.port)
        try:
            await client.send(m.ApiKey.METADATA, m.MetadataRequest(None))
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await client.receive(wait_s=10)
        finally:
            await client.close()
        assert await _produce_one(_client(c, ca)) == 0

    asyncio.run(run())
    assert "TLS handshake with" in agent.process.log_text()


def _served_cn(host: str, port: int, cafile: Path) -> str:
    ctx = client_context(TlsFiles(cafile=str(cafile)))
    with (
        socket.create_connection((host, port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as s,
    ):
        cert: Any = s.getpeercert()
    return next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName")


def test_certificates_are_reloaded_without_restart(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    first = ca.issue("first", filename="served")
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    c.client_ssl = client_context(TlsFiles(cafile=str(ca.cafile)))
    agent = c.start_agent(
        1,
        "listener.security.protocol=SSL",
        f"ssl.certfile={first.certfile}",
        f"ssl.keyfile={first.keyfile}",
        "ssl.reload.check.interval.ms=100",
    )
    assert _served_cn(agent.host, agent.port, ca.cafile) == "first"
    # renewed the usual way: new files written aside, then renamed over the old ones
    renewed = ca.issue("second", filename="renewed")
    shutil.move(renewed.keyfile, first.keyfile)
    shutil.move(renewed.certfile, first.certfile)
    deadline = time.monotonic() + 20
    while _served_cn(agent.host, agent.port, ca.cafile) != "second":
        assert time.monotonic() < deadline, "the renewed certificate was never served"
        time.sleep(0.1)
    assert agent.process.alive


def test_kafka_client_over_tls(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, ca: ThrowawayCA
) -> None:
    kp = pytest.importorskip("kafka")
    c = _tls_cluster(processes, zk_chroot, tmp_path, ca, "kafka.listener=127.0.0.1:0")
    c.create_topic("k", 1)
    c.wait_for_leaders("k")
    conf: dict[str, Any] = {
        "security_protocol": "SSL",
        "ssl_cafile": str(ca.cafile),
        "request_timeout_ms": 10000,
    }
    producer = kp.KafkaProducer(bootstrap_servers=c.kafka_bootstrap, **conf)
    try:
        for i in range(5):
            producer.send("k", b"m%d" % i, partition=0).get(timeout=20)
    finally:
        producer.close()
    consumer = kp.KafkaConsumer(
        bootstrap_servers=c.kafka_bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=15000,
        **conf,
    )
    try:
        consumer.assign([kp.TopicPartition("k", 0)])
        got = []
        for record in consumer:
            got.append(record.value)
            if len(got) == 5:
                break
    finally:
        consumer.close()
    assert got == [b"m%d" % i for i in range(5)]
    # the Kafka port refuses plaintext too
    refused_kafka_producer(
        kp, bootstrap_servers=c.kafka_bootstrap, request_timeout_ms=3000, max_block_ms=3000
    )
