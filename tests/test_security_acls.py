"""ACLs, checked in the request core, against a real agent and a real ZooKeeper.

A generated matrix: for every guarded API (produce, fetch, list offsets, metadata by name and
all topics, offset commit and fetch, find coordinator for a group and for a transactional id),
each a resource type and operation, a principal of its own for each grant — none, allow
(literal and prefixed), allow of another operation, allow with a deny (deny wins), a prefix
that does not match — logs in and sends the request; each answer is checked: served, or the
typed refusal (TOPIC/GROUP/TRANSACTIONAL_ID_AUTHORIZATION_FAILED), with the refusal logged
with the principal. Plus the pure decision rules (``storage.metadata.acls.authorize``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from scramp import ScramClient

from infra.certs import ThrowawayCA
from sdk import Producer
from sdk.auth import ScramLogin
from storage.codec import encode_batch
from storage.errors import (
    GroupAuthorizationFailedError,
    StrataError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from storage.kafka import frames as kf
from storage.kafka.messages import ApiKey
from storage.metadata import AsyncZooKeeper
from storage.metadata.acls import (
    AclBinding,
    AclStore,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    authorize,
)
from storage.metadata.users import ScramCredential, UserStore
from storage.protocol import messages as m
from storage.tls import TlsFiles, client_context
from tests.cluster import Cluster, WireClient, fetch_request, produce_request
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.kafka_support import read_kafka_frame

TOPIC, GROUP, TXN = "acl-t", "acl-g", "acl-x"
PASSWORD = "pw-3b8e1"


# ---- the decision rules, pure ----------------------------------------------------------------
def _b(op: Operation, perm: Permission = Permission.ALLOW, **kw: Any) -> AclBinding:
    return AclBinding(
        principal=kw.get("principal", "User:u"),
        resource_type=kw.get("rtype", ResourceType.TOPIC),
        name=kw.get("name", "t"),
        operation=op,
        permission=perm,
        pattern_type=kw.get("pattern", PatternType.LITERAL),
    )


@pytest.mark.parametrize(
    ("bindings", "op", "expected"),
    [
        ([], Operation.READ, False),
        ([_b(Operation.READ)], Operation.READ, True),
        ([_b(Operation.READ)], Operation.WRITE, False),
        ([_b(Operation.READ)], Operation.DESCRIBE, True),  # read implies describe
        ([_b(Operation.CREATE)], Operation.DESCRIBE, False),
        ([_b(Operation.ALL)], Operation.DELETE, True),
        ([_b(Operation.READ), _b(Operation.READ, Permission.DENY)], Operation.READ, False),
        ([_b(Operation.ALL), _b(Operation.ALL, Permission.DENY)], Operation.READ, False),
        ([_b(Operation.READ), _b(Operation.WRITE, Permission.DENY)], Operation.READ, True),
        ([_b(Operation.READ, principal="User:*")], Operation.READ, True),
        ([_b(Operation.READ, principal="User:v")], Operation.READ, False),
        ([_b(Operation.READ, name="*")], Operation.READ, True),
        ([_b(Operation.READ, name="t", pattern=PatternType.PREFIXED)], Operation.READ, True),
        ([_b(Operation.READ, name="u", pattern=PatternType.PREFIXED)], Operation.READ, False),
        ([_b(Operation.READ, rtype=ResourceType.GROUP)], Operation.READ, False),
    ],
)
def test_decision_rules(bindings: list[AclBinding], op: Operation, expected: bool) -> None:
    assert authorize(bindings, "User:u", op, ResourceType.TOPIC, "t") is expected


# ---- the matrix against a real agent ---------------------------------------------------------
Call = Callable[[WireClient], Awaitable[int]]
"""Sends one request; returns the error code the answer carries (0: served)."""


async def _produce(c: WireClient) -> int:
    r = await c.call(m.ApiKey.PRODUCE, produce_request(TOPIC, 0, encode_batch([b"v"])))
    return int(r.topics[0].partitions[0].error_code)


async def _fetch(c: WireClient) -> int:
    r = await c.call(m.ApiKey.FETCH, fetch_request(TOPIC, 0, 0))
    return int(r.topics[0].partitions[0].error_code)


async def _list_offsets(c: WireClient) -> int:
    req = m.ListOffsetsRequest(
        [m.ListOffsetsTopic(TOPIC, [m.ListOffsetsPartition(0, m.LATEST_TIMESTAMP)])]
    )
    r = await c.call(m.ApiKey.LIST_OFFSETS, req)
    return int(r.topics[0].partitions[0].error_code)


async def _metadata_named(c: WireClient) -> int:
    r = await c.call(m.ApiKey.METADATA, m.MetadataRequest([TOPIC]))
    return int(r.topics[0].error_code)


async def _metadata_all(c: WireClient) -> int:
    r = await c.call(m.ApiKey.METADATA, m.MetadataRequest(None))
    names = [t.name for t in r.topics]
    # hidden, not refused: the same code as a refusal for the matrix's bookkeeping
    return 0 if TOPIC in names else TopicAuthorizationFailedError.code


async def _raising(c: WireClient, key: int, body: m.Message) -> int:
    try:
        await c.call(key, body)
    except StrataError as exc:
        return exc.code
    return 0


async def _offset_commit(c: WireClient) -> int:
    req = m.OffsetCommitRequest(
        GROUP,
        -1,
        "",
        None,
        [m.OffsetCommitTopic(TOPIC, [m.OffsetCommitPartition(0, 0, None)])],
    )
    return await _raising(c, m.ApiKey.OFFSET_COMMIT, req)


async def _offset_fetch(c: WireClient) -> int:
    return await _raising(c, m.ApiKey.OFFSET_FETCH, m.OffsetFetchRequest(GROUP, None))


async def _find_group(c: WireClient) -> int:
    return await _raising(c, m.ApiKey.FIND_COORDINATOR, m.FindCoordinatorRequest(GROUP))


async def _find_txn(c: WireClient) -> int:
    req = m.FindCoordinatorRequest(TXN, m.COORDINATOR_TRANSACTION)
    return await _raising(c, m.ApiKey.FIND_COORDINATOR, req)


@dataclass(frozen=True)
class Api:
    name: str
    call: Call
    rtype: ResourceType
    resource: str
    op: Operation
    refusal: int  # the error code of a refusal


TOPIC_REFUSED = TopicAuthorizationFailedError.code
GROUP_REFUSED = GroupAuthorizationFailedError.code
APIS = [
    Api("produce", _produce, ResourceType.TOPIC, TOPIC, Operation.WRITE, TOPIC_REFUSED),
    Api("fetch", _fetch, ResourceType.TOPIC, TOPIC, Operation.READ, TOPIC_REFUSED),
    Api(
        "list_offsets", _list_offsets, ResourceType.TOPIC, TOPIC, Operation.DESCRIBE, TOPIC_REFUSED
    ),
    Api("metadata", _metadata_named, ResourceType.TOPIC, TOPIC, Operation.DESCRIBE, TOPIC_REFUSED),
    Api(
        "metadata_all", _metadata_all, ResourceType.TOPIC, TOPIC, Operation.DESCRIBE, TOPIC_REFUSED
    ),
    Api("offset_commit", _offset_commit, ResourceType.GROUP, GROUP, Operation.READ, GROUP_REFUSED),
    Api("offset_fetch", _offset_fetch, ResourceType.GROUP, GROUP, Operation.READ, GROUP_REFUSED),
    Api("find_group", _find_group, ResourceType.GROUP, GROUP, Operation.DESCRIBE, GROUP_REFUSED),
    Api(
        "find_txn",
        _find_txn,
        ResourceType.TRANSACTIONAL_ID,
        TXN,
        Operation.WRITE,
        TransactionalIdAuthorizationFailedError.code,
    ),
]

#: grant name -> (bindings for the principal on the API's resource, whether it is served)
GRANTS: dict[str, tuple[Callable[[str, Api, PatternType], list[AclBinding]], bool]] = {}


def _acl(
    p: str, api: Api, pattern: PatternType, op: Operation, perm: Permission, name: str | None = None
) -> AclBinding:
    if name is None:
        name = api.resource if pattern is PatternType.LITERAL else api.resource[:4]
    return AclBinding(
        principal=p,
        resource_type=api.rtype,
        name=name,
        operation=op,
        permission=perm,
        pattern_type=pattern,
    )


GRANTS = {
    "none": (lambda p, api, pat: [], False),
    "allow": (lambda p, api, pat: [_acl(p, api, pat, api.op, Permission.ALLOW)], True),
    "allow_all": (lambda p, api, pat: [_acl(p, api, pat, Operation.ALL, Permission.ALLOW)], True),
    "allow_other_op": (
        lambda p, api, pat: [_acl(p, api, pat, Operation.CREATE, Permission.ALLOW)],
        False,
    ),
    "deny_wins": (
        lambda p, api, pat: [
            _acl(p, api, pat, api.op, Permission.ALLOW),
            _acl(p, api, PatternType.LITERAL, Operation.ALL, Permission.DENY, api.resource),
        ],
        False,
    ),
    "other_name": (
        lambda p, api, pat: [
            _acl(
                p,
                api,
                pat,
                api.op,
                Permission.ALLOW,
                "zz" if pat is PatternType.PREFIXED else "zz-t",
            )
        ],
        False,
    ),
}

CASES = [
    (api, grant, pattern)
    for api in APIS
    for grant in GRANTS
    for pattern in ([PatternType.LITERAL] if grant == "none" else list(PatternType))
]


def secured_agent(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path, *configs: str
) -> tuple[Cluster, Any]:
    """One agent checking ACLs on a SASL listener, ``User:admin`` its super user (the
    cluster's own client logs in as admin)."""
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.client_login = ScramLogin("SCRAM-SHA-256", "admin", PASSWORD)
    agent = cluster.start_agent(
        1,
        "listener.security.protocol=SASL_PLAINTEXT",
        "authorizer.enable=true",
        "super.users=User:admin",
        *configs,
    )
    return cluster, agent


@pytest.mark.slow
def test_acl_matrix(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> None:
    principals = {case: f"c{i}" for i, case in enumerate(CASES)}

    async def setup() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            users = UserStore(zk)
            names = ["admin", *principals.values()]
            creds = await asyncio.gather(
                *(
                    asyncio.to_thread(ScramCredential.make, "SCRAM-SHA-256", PASSWORD, 4096)
                    for _ in names
                )
            )
            for name, cred in zip(names, creds, strict=True):
                await users.set(name, "SCRAM-SHA-256", cred)
            bindings = []
            for (api, grant, pattern), user in principals.items():
                bindings += GRANTS[grant][0](f"User:{user}", api, pattern)
            await AclStore(zk).add(bindings)
        finally:
            await zk.stop()

    asyncio.run(setup())
    cluster, agent = secured_agent(processes, zk_chroot, tmp_path)
    cluster.create_topic(TOPIC, 1)
    cluster.wait_for_leaders(TOPIC)

    async def run() -> list[str]:
        wrong = []
        for (api, grant, pattern), user in principals.items():
            client = await WireClient.connect(agent.host, agent.port)
            try:
                await client.login(ScramLogin("SCRAM-SHA-256", user, PASSWORD))
                code = await api.call(client)
            finally:
                await client.close()
            served = GRANTS[grant][1]
            expected = 0 if served else api.refusal
            # a served transactional-id lookup may still find no coordinator yet: what matters
            # there is that it was not refused
            ok = code not in _REFUSALS if served and api.name == "find_txn" else code == expected
            if not ok:
                wrong.append(f"{api.name} {grant} {pattern}: code {code}, expected {expected}")
        return wrong

    wrong = asyncio.run(run())
    assert not wrong, "\n".join(wrong)
    log = agent.process.log_text()
    assert "refused: User:c0 may not write topic 'acl-t'" in log  # logged with the principal


_REFUSALS = {
    TopicAuthorizationFailedError.code,
    GroupAuthorizationFailedError.code,
    TransactionalIdAuthorizationFailedError.code,
}


@pytest.mark.slow
def test_kafka_listener_is_checked_too(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """The same guarded core behind the Kafka listener: an unmodified Kafka client with the
    right writes, one without it is refused with Kafka's TOPIC_AUTHORIZATION_FAILED; a
    transactional one needs Write on its transactional id too."""
    kp = pytest.importorskip("kafka")

    async def setup() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            for name in ("admin", "writer", "nobody"):
                cred = await asyncio.to_thread(
                    ScramCredential.make, "SCRAM-SHA-256", PASSWORD, 4096
                )
                await UserStore(zk).set(name, "SCRAM-SHA-256", cred)
            await AclStore(zk).add(
                [
                    AclBinding(
                        principal="User:writer",
                        resource_type=ResourceType.TOPIC,
                        name="acl-",
                        pattern_type=PatternType.PREFIXED,
                        operation=Operation.WRITE,
                    ),
                    AclBinding(
                        principal="User:writer",
                        resource_type=ResourceType.TRANSACTIONAL_ID,
                        name="writer-",
                        pattern_type=PatternType.PREFIXED,
                        operation=Operation.WRITE,
                    ),
                ]
            )
        finally:
            await zk.stop()

    asyncio.run(setup())
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.client_login = ScramLogin("SCRAM-SHA-256", "admin", PASSWORD)
    cluster.start_agent(
        1,
        "listener.security.protocol=SASL_PLAINTEXT",
        "kafka.listener=127.0.0.1:0",
        "authorizer.enable=true",
        "super.users=User:admin",
    )
    cluster.create_topic(TOPIC, 1)
    cluster.wait_for_leaders(TOPIC)

    def producer(user: str, **conf: Any) -> Any:
        settings = {"max_block_ms": 5000, "request_timeout_ms": 5000, "retries": 0, **conf}
        return kp.KafkaProducer(
            bootstrap_servers=cluster.kafka_bootstrap,
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-256",
            sasl_plain_username=user,
            sasl_plain_password=PASSWORD,
            **settings,
        )

    p = producer("writer")
    try:
        assert p.send(TOPIC, b"ok", partition=0).get(timeout=20).offset == 0
    finally:
        p.close()
    p = producer("nobody")
    try:
        with pytest.raises(kp.errors.TopicAuthorizationFailedError):
            p.send(TOPIC, b"no", partition=0).get(timeout=20)
    finally:
        p.close()
    # a Kafka client's transactions need Write on their transactional id (and, being
    # idempotent, retries)
    p = producer("writer", transactional_id="writer-1", retries=3)
    try:
        p.init_transactions()
        p.begin_transaction()
        p.send(TOPIC, b"in a transaction", partition=0)
        p.commit_transaction()
    finally:
        p.close()
    p = producer("writer", transactional_id="someone-else", retries=3)
    try:
        with pytest.raises(kp.errors.TransactionalIdAuthorizationFailedError):
            p.init_transactions()
    finally:
        p.close(timeout=5)
    # and so do transactional batches themselves, as in Kafka: topic Write alone cannot open
    # a transaction that would hold the partition's committed readers back
    address = cluster.kafka_bootstrap.split(",")[0]
    with kafka_session(address, "writer") as call:
        for txn_id, transactional, code in (
            (None, True, 53),
            ("someone-else", True, 53),
            ("someone-else", False, 0),  # not transactional: topic Write is enough
        ):
            got = call(ApiKey.PRODUCE, 3, produce_body(txn_id, transactional))
            (part,) = got["responses"][0]["partition_responses"]
            assert part["error_code"] == code, (txn_id, transactional, part)
        # nothing refused was stored: "ok", the transaction's record and its commit marker,
        # and the plain record end the log at 4
        latest = call(
            ApiKey.LIST_OFFSETS,
            1,
            {
                "replica_id": -1,
                "topics": [
                    {"name": TOPIC, "partitions": [{"partition_index": 0, "timestamp": -1}]}
                ],
            },
        )
        assert latest["topics"][0]["partitions"][0]["offset"] == 4, latest

    # the native listener's rule is the same: the SDK's transactional producer names its id
    # in every Produce, and a raw Produce of transactional batches without a writable id is
    # refused whole
    native = cluster.agents[1]

    async def sdk_transaction() -> None:
        config = {
            "bootstrap.servers": native.address,
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": "writer",
            "sasl.password": PASSWORD,
            "transactional.id": "writer-2",
        }
        async with Producer(config) as producer:
            await producer.init_transactions()
            producer.begin_transaction()
            await producer.send(TOPIC, b"sdk transaction", partition=0)
            await producer.commit_transaction()

    asyncio.run(sdk_transaction())  # record 4 and its commit marker

    async def native_produce() -> list[int]:
        client = await WireClient.connect(native.host, native.port)
        codes = []
        try:
            await client.login(ScramLogin("SCRAM-SHA-256", "writer", PASSWORD))
            for txn_id, transactional in (
                (None, True),
                ("someone-else", True),
                ("someone-else", False),
            ):
                batch = encode_batch(
                    [b"native"],
                    producer_id=11 if transactional else -1,
                    producer_epoch=0 if transactional else -1,
                    base_sequence=0 if transactional else -1,
                    transactional=transactional,
                )
                req = produce_request(TOPIC, 0, batch)
                req.transactional_id = txn_id
                r = await client.call(m.ApiKey.PRODUCE, req)
                codes.append(r.topics[0].partitions[0].error_code)
            req = m.ListOffsetsRequest(
                [m.ListOffsetsTopic(TOPIC, [m.ListOffsetsPartition(0, m.LATEST_TIMESTAMP)])]
            )
            r = await client.call(m.ApiKey.LIST_OFFSETS, req)
            codes.append(r.topics[0].partitions[0].offset)
        finally:
            await client.close()
        return codes

    refused = TransactionalIdAuthorizationFailedError.code
    # the two transactional batches refused; the plain one stored after the marker at 5
    assert asyncio.run(native_produce()) == [refused, refused, 0, 7]

    # the topic admin APIs too: writing a topic is not deleting it, creating one, growing it
    # or reading its configs (each answered per topic with TOPIC_AUTHORIZATION_FAILED)
    ck = pytest.importorskip("confluent_kafka")
    from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic

    def admin(user: str) -> Any:
        return AdminClient(
            {
                "bootstrap.servers": cluster.kafka_bootstrap,
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.username": user,
                "sasl.password": PASSWORD,
            }
        )

    def refused(future: Any) -> None:
        with pytest.raises(ck.KafkaException) as err:
            future.result(30)
        assert err.value.args[0].code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED, err.value

    resource = ConfigResource("topic", TOPIC)
    for user in ("writer", "nobody"):
        a = admin(user)
        refused(a.delete_topics([TOPIC])[TOPIC])
        refused(a.create_topics([NewTopic("acl-new", 1, 1)])["acl-new"])
        refused(a.create_partitions([NewPartitions(TOPIC, 2)])[TOPIC])
        configs = a.describe_configs([resource])[resource]
        if user == "nobody":
            refused(configs)
        else:  # Write implies Describe, as in Kafka
            assert "retention.ms" in configs.result(30)
    a = admin("admin")  # a super user may
    a.create_topics([NewTopic("acl-new", 1, 1)])["acl-new"].result(30)
    a.delete_topics(["acl-new"])["acl-new"].result(30)
    # nothing the refused requests asked for happened: the topic is there, one partition
    assert list(cluster.wait_for_leaders(TOPIC)) == [0]


@contextlib.contextmanager
def kafka_session(address: str, user: str) -> Iterator[Callable[[int, int, dict[str, Any]], Any]]:
    """A raw connection to a SASL_PLAINTEXT Kafka listener, logged in as ``user`` with
    SCRAM-SHA-256 (Kafka's v1 exchange); yields ``call(api key, version, body) -> answer``."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    correlation = iter(range(1, 1 << 30))

    def call(api_key: int, version: int, body: dict[str, Any]) -> Any:
        sock.sendall(kf.encode_request(api_key, version, next(correlation), "acl-test", body))
        return kf.parse_response(read_kafka_frame(sock), api_key, version)[1]

    try:
        shake = call(ApiKey.SASL_HANDSHAKE, 1, {"mechanism": "SCRAM-SHA-256"})
        assert shake["error_code"] == 0, shake
        scram = ScramClient(["SCRAM-SHA-256"], user, PASSWORD)
        first = call(ApiKey.SASL_AUTHENTICATE, 1, {"auth_bytes": scram.get_client_first().encode()})
        scram.set_server_first(bytes(first["auth_bytes"]).decode())
        last = call(ApiKey.SASL_AUTHENTICATE, 1, {"auth_bytes": scram.get_client_final().encode()})
        assert last["error_code"] == 0, last
        scram.set_server_final(bytes(last["auth_bytes"]).decode())
        yield call
    finally:
        sock.close()


def produce_body(txn_id: str | None, transactional: bool) -> dict[str, Any]:
    """A Kafka Produce v3 body: one batch (producer 7, epoch 0) to ``TOPIC``-0."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=transactional,
        producer_id=7 if transactional else -1,
        producer_epoch=0 if transactional else -1,
        base_sequence=0 if transactional else -1,
        batch_size=1 << 20,
    )
    builder.append(
        0, timestamp=None, key=None, value=b"in a txn" if transactional else b"plain", headers=[]
    )
    partition = {"index": 0, "records": bytes(builder.build())}
    topic = {"name": TOPIC, "partition_data": [partition]}
    return {"transactional_id": txn_id, "acks": 1, "timeout_ms": 5000, "topic_data": [topic]}


@pytest.mark.slow
def test_client_certificate_is_the_principal(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """mTLS: on an SSL listener with client certificates, the certificate's CN is the
    principal the ACLs see (``User:<CN>``); no password anywhere."""
    ca = ThrowawayCA.create(tmp_path / "ca")
    agent_cert = ca.issue("agent-1")

    async def setup() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            await AclStore(zk).add(
                [
                    AclBinding(
                        principal="User:alice",
                        resource_type=ResourceType.TOPIC,
                        name=TOPIC,
                        operation=Operation.WRITE,
                    )
                ]
            )
        finally:
            await zk.stop()

    asyncio.run(setup())

    def ctx(name: str) -> Any:
        issued = ca.issue(name)
        return client_context(
            TlsFiles(
                cafile=str(ca.cafile), certfile=str(issued.certfile), keyfile=str(issued.keyfile)
            )
        )

    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    cluster.client_ssl = ctx("admin")
    agent = cluster.start_agent(
        1,
        "listener.security.protocol=SSL",
        f"ssl.certfile={agent_cert.certfile}",
        f"ssl.keyfile={agent_cert.keyfile}",
        f"ssl.cafile={ca.cafile}",
        "ssl.client.auth=required",
        "authorizer.enable=true",
        "super.users=User:admin;User:agent-1",
    )
    cluster.create_topic(TOPIC, 1)
    cluster.wait_for_leaders(TOPIC)

    async def produce_as(name: str) -> int:
        client = await WireClient.connect(agent.host, agent.port, ssl=ctx(name))
        try:
            return await _produce(client)
        finally:
            await client.close()

    assert asyncio.run(produce_as("alice")) == 0
    assert asyncio.run(produce_as("bob")) == TopicAuthorizationFailedError.code
    assert "refused: User:bob may not write topic 'acl-t'" in agent.process.log_text()


@pytest.mark.slow
def test_internal_topics_do_not_carry_writes_past_the_acls(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    """Write on a delay level is not Write on every topic the scheduler delivers to, and
    Write on the failures topic is not a way into every group's retries: a producer that is
    not a super user needs Write on each delayed record's target topic and Read on each
    failure record's group, read from the batch's headers; one record past its rights refuses
    the partition's whole request (nothing of it stored)."""
    from sdk.delays import HEADER_ID, level_topic
    from sdk.retry import FAILURES_TOPIC, H_GROUP

    level = level_topic(0)

    async def setup() -> None:
        zk = AsyncZooKeeper(zk_chroot.connect_string)
        await zk.start()
        try:
            for name in ("admin", "tenant"):
                cred = await asyncio.to_thread(
                    ScramCredential.make, "SCRAM-SHA-256", PASSWORD, 4096
                )
                await UserStore(zk).set(name, "SCRAM-SHA-256", cred)

            def allow(rtype: ResourceType, name: str, op: Operation, pattern: PatternType) -> Any:
                return AclBinding(
                    principal="User:tenant",
                    resource_type=rtype,
                    name=name,
                    operation=op,
                    permission=Permission.ALLOW,
                    pattern_type=pattern,
                )

            await AclStore(zk).add(
                [
                    allow(
                        ResourceType.TOPIC, "__strata_delay_", Operation.WRITE, PatternType.PREFIXED
                    ),
                    allow(ResourceType.TOPIC, FAILURES_TOPIC, Operation.WRITE, PatternType.LITERAL),
                    allow(ResourceType.TOPIC, "mine", Operation.WRITE, PatternType.LITERAL),
                    allow(ResourceType.GROUP, "g-mine", Operation.READ, PatternType.LITERAL),
                ]
            )
        finally:
            await zk.stop()

    asyncio.run(setup())
    cluster, agent = secured_agent(processes, zk_chroot, tmp_path)
    for topic in (level, FAILURES_TOPIC, "mine", "theirs"):
        cluster.create_topic(topic, 1)
        cluster.wait_for_leaders(topic)

    def delayed(*targets: str) -> bytes:
        return encode_batch(
            [b"v"] * len(targets),
            headers=[
                [(HEADER_ID, f"1~0~0000000a~n{i}~{t}".encode())] for i, t in enumerate(targets)
            ],
        )

    def failures(*groups: str) -> bytes:
        return encode_batch([b"v"] * len(groups), headers=[[(H_GROUP, g.encode())] for g in groups])

    async def produce(user: str, topic: str, batch: bytes) -> int:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            await client.login(ScramLogin("SCRAM-SHA-256", user, PASSWORD))
            r = await client.call(m.ApiKey.PRODUCE, produce_request(topic, 0, batch))
            return int(r.topics[0].partitions[0].error_code)
        finally:
            await client.close()

    async def end_offset(topic: str) -> int:
        client = await WireClient.connect(agent.host, agent.port)
        try:
            await client.login(ScramLogin("SCRAM-SHA-256", "admin", PASSWORD))
            req = m.ListOffsetsRequest(
                [m.ListOffsetsTopic(topic, [m.ListOffsetsPartition(0, m.LATEST_TIMESTAMP)])]
            )
            r = await client.call(m.ApiKey.LIST_OFFSETS, req)
            return int(r.topics[0].partitions[0].offset)
        finally:
            await client.close()

    async def run() -> None:
        assert await produce("tenant", level, delayed("mine", "mine")) == 0
        assert await produce("tenant", level, delayed("mine", "theirs")) == TOPIC_REFUSED
        assert await produce("tenant", level, delayed("theirs")) == TOPIC_REFUSED
        bad_id = encode_batch([b"v"], headers=[[(HEADER_ID, b"not-a-schedule-id")]])
        assert await produce("tenant", level, bad_id) not in (0, TOPIC_REFUSED)
        assert await produce("tenant", FAILURES_TOPIC, failures("g-mine")) == 0
        assert await produce("tenant", FAILURES_TOPIC, failures("g-mine", "g-theirs")) == (
            TOPIC_REFUSED
        )
        assert await produce("tenant", "mine", encode_batch([b"plain"])) == 0
        # a super user (the scheduler's, the router's) is not asked
        assert await produce("admin", level, delayed("theirs")) == 0
        assert await end_offset(level) == 3  # two of the tenant's, one of the admin's
        assert await end_offset(FAILURES_TOPIC) == 1

    asyncio.run(run())
    assert "refused: User:tenant may not write topic 'theirs'" in agent.process.log_text()
