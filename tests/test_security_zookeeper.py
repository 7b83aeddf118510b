"""ZooKeeper locked down: with ``STRATA_ZOOKEEPER_AUTH`` every process of the cluster (agents,
the test's own metadata client) authenticates with the digest scheme and every znode it
creates, the chroot included, is theirs alone. A client without the credentials, or with wrong
ones, can neither read nor change anything the cluster keeps there; the cluster itself works."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from infra.zookeeper import ZooKeeperServer
from sdk import Consumer, Producer, TopicPartition
from storage.errors import InvalidConfigError, MetadataError
from storage.metadata import AsyncZooKeeper
from storage.metadata.zk import AUTH_ENV, digest_credentials
from tests.cluster import Cluster, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot, close_client

CREDENTIALS = "strata-agents:correct horse battery staple"
TOPIC = "locked"


def _client(hosts: str, auth: str | None) -> KazooClient:
    client = KazooClient(hosts=hosts, timeout=10, auth_data=[("digest", auth)] if auth else None)
    client.start(timeout=15)
    return client


ATTEMPTS: dict[str, Callable[[KazooClient, str], Any]] = {
    "read": lambda zk, node: zk.get(node),
    "list": lambda zk, node: zk.get_children(node),
    "write": lambda zk, node: zk.set(node, b"forged"),
    "add under": lambda zk, node: zk.create(f"{node.rstrip('/')}/x", b""),
    "delete": lambda zk, node: zk.delete(node),
}


def _all_nodes(client: KazooClient, path: str = "/") -> list[str]:
    out = [path]
    for child in client.get_children(path):
        out += _all_nodes(client, f"{path.rstrip('/')}/{child}")
    return out


def test_a_client_without_the_credentials_cannot_read_or_change_the_cluster_state(
    processes: ProcessGroup,
    zk_server: ZooKeeperServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chroot = ZooKeeperChroot(zk_server.connect_string, f"/strata-secure/{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv(AUTH_ENV, CREDENTIALS)  # the agents inherit it, and so does this process
    owner = _client(chroot.connect_string, CREDENTIALS)
    cluster = Cluster(processes, chroot, tmp_path / "data")
    try:
        cluster.start(2)
        cluster.create_topic(TOPIC, 2, 2)
        cluster.wait_for_leaders(TOPIC)

        async def produce_and_read(count: int) -> list[bytes]:
            async with Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all"}) as p:
                await p.send_and_wait(TOPIC, b"kept", partition=0)
            config = {"bootstrap.servers": cluster.bootstrap, "auto.offset.reset": "earliest"}
            async with Consumer(config) as c:
                c.assign([TopicPartition(TOPIC, 0)])
                return [r.value for r in await read_records(c, count)]

        assert asyncio.run(produce_and_read(1)) == [b"kept"]

        nodes = _all_nodes(owner)
        # the agents wrote what a cluster keeps: registrations, the controller, topics, states
        assert any(n.startswith("/agents/") for n in nodes), nodes
        assert any(n.startswith(f"/topics/{TOPIC}/partitions/") for n in nodes), nodes
        for intruder_auth in (None, "strata-agents:wrong password", "someone:else"):
            # on the server's root (kazoo cannot even start on a chroot it may not see)
            intruder = _client(zk_server.connect_string, intruder_auth)
            try:
                for node in nodes:
                    for what, attempt in ATTEMPTS.items():
                        if what == "delete" and node == "/":
                            continue
                        with pytest.raises(NoAuthError):
                            attempt(intruder, f"{chroot.path}{node}".rstrip("/"))
                            pytest.fail(f"{intruder_auth or 'no credentials'}: {what} {node}")
            finally:
                close_client(intruder)
        assert _all_nodes(owner) == nodes  # nothing added, nothing removed

        # the cluster still works, and this process's metadata client says what is wrong
        assert asyncio.run(produce_and_read(2)) == [b"kept"] * 2

        async def read_as_intruder() -> None:
            zk = AsyncZooKeeper(chroot.connect_string, auth="strata-agents:wrong password")
            await zk.start()
            try:
                await zk.get(f"/topics/{TOPIC}")
            finally:
                await zk.stop()

        with pytest.raises(MetadataError, match="NoAuth"):
            asyncio.run(read_as_intruder())
    finally:
        for agent_id in list(cluster.agents):  # before the chroot goes: they re-register
            cluster.stop(agent_id)
        owner.delete(chroot.path, recursive=True)
        close_client(owner)


def test_malformed_credentials_are_refused_without_echoing_them() -> None:
    messages = set()
    for value in ("n0-secret", ":s3cr3t-pw", "n0body:", "alone"):
        with pytest.raises(InvalidConfigError) as err:
            digest_credentials(value)
        messages.add(str(err.value))
    (message,) = messages  # the same words whatever was given: a secret is never echoed
    assert AUTH_ENV in message and "user:password" in message
    assert digest_credentials("") is None and digest_credentials(None) is None
    assert digest_credentials("a:b:c") == ("a", "b:c")  # a password may hold a colon
