"""The admin API end to end: ``sdk.admin`` over HTTP to the local runtime, a real child
process, running the same handler as Lambda against a real ZooKeeper.

One runtime process and one chroot serve this module's SDK tests (each uses its own topic
names); ``/agents`` there holds three registrations with no agent behind them, which is all
the admin reads. The last tests start their own runtime: one with tight limits, one next to
a real agent whose controller creates the partition states.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kazoo.client import KazooClient

from infra.local_runtime import command, start_local_runtime, wait_for_listening
from infra.processes import free_port, wait_until_ready
from infra.zookeeper import ZooKeeperServer
from sdk.admin import (
    Admin,
    PartitionInfo,
    PartitionStatus,
    SyncAdmin,
    TopicDescription,
    error_from_body,
)
from storage import errors
from tests.harness import (
    ProcessGroup,
    ZooKeeperChroot,
    close_client,
    create_chroot,
    delete_chroot,
    kazoo_client,
)
from tests.test_admin import register_agents

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def run(fn: Callable[[Admin], Awaitable[T]], url: str, *, timeout: float = 10.0) -> T:
    async def main() -> T:
        async with Admin(url, timeout=timeout) as admin:
            return await fn(admin)

    return asyncio.run(main())


@dataclass(frozen=True)
class Stack:
    url: str
    chroot: ZooKeeperChroot
    zk: KazooClient


@pytest.fixture(scope="module")
def stack(zk_server: ZooKeeperServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = kazoo_client(zk_server.connect_string)
    chroot = create_chroot(root, zk_server.connect_string, "test_admin_http")
    zk = kazoo_client(chroot.connect_string)
    group = ProcessGroup(tmp_path_factory.mktemp("admin-http"))
    try:
        register_agents(zk, [1, 2, 3])
        runtime = group.start(command(chroot.connect_string), name="local-runtime", cwd=ROOT)
        url = wait_for_listening(runtime.popen, runtime.log_path)
        yield Stack(url=url, chroot=chroot, zk=zk)
    finally:
        group.close()
        close_client(zk)
        delete_chroot(root, chroot)
        close_client(root)


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def http(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            status, hdrs, raw = exc.code, dict(exc.headers), exc.read()
    return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(raw) if raw else None


# ---------------------------------------------------------------- through the SDK


def test_topic_lifecycle(stack: Stack, topic: str) -> None:
    async def scenario(admin: Admin) -> None:
        created = await admin.create_topic(topic, 4, configs={"retention.ms": 60_000})
        assert isinstance(created, TopicDescription)
        assert (created.name, created.partitions, created.replication_factor) == (topic, 4, 3)
        assert created.configs["retention.ms"] == 60_000
        assert created.partition_states == tuple(
            PartitionInfo(partition=p, status=PartitionStatus.PENDING) for p in range(4)
        )
        assert topic in await admin.list_topics()

        described = await admin.describe_topic(topic)
        assert described == created

        grown = await admin.create_partitions(topic, 6)
        assert grown.partitions == 6
        assert len(grown.partition_states) == 6

        altered = await admin.alter_configs(topic, {"retention.ms": 120_000, "segment.ms": 1000})
        assert altered.configs["retention.ms"] == 120_000
        assert altered.configs["segment.ms"] == 1000
        assert altered.topic_id == created.topic_id
        restored = await admin.alter_configs(topic, {"retention.ms": None})
        assert restored.configs["retention.ms"] == 14 * 24 * 3600 * 1000

        deleting = await admin.delete_topic(topic)
        assert deleting.deletion is not None and deleting.deletion.step == "stop_serving"
        assert topic not in await admin.list_topics()
        assert topic in await admin.list_deleting_topics()
        # no controller runs in this stack: the delete waits at step 2, the name stays taken
        described = await admin.describe_topic(topic)
        assert described.deletion == deleting.deletion
        with pytest.raises(errors.TopicDeletionInProgressError, match="being deleted"):
            await admin.create_topic(topic, 1)

    run(scenario, stack.url)


@pytest.mark.parametrize(
    "name",
    ["a/b", "", ".", "..", "x" * 250, "héllo", "with space", "tab\t", "a%2Fb", "*"],
    ids=[
        "slash",
        "empty",
        "dot",
        "dotdot",
        "250-chars",
        "non-ascii",
        "space",
        "tab",
        "pct",
        "star",
    ],
)
def test_invalid_topic_names_are_400_invalid_topic(stack: Stack, name: str) -> None:
    async def scenario(admin: Admin) -> None:
        with pytest.raises(errors.InvalidTopicError) as created:
            await admin.create_topic(name, 1)
        assert created.value.code == 17 and not created.value.retriable
        for call in (
            admin.describe_topic(name),
            admin.delete_topic(name),
            admin.create_partitions(name, 2),
            admin.alter_configs(name, {"retention.ms": 1}),
        ):
            with pytest.raises(errors.InvalidTopicError):
                await call

    run(scenario, stack.url)
    status, _, body = http(
        stack.url, "POST", "/topics", json.dumps({"name": name, "partitions": 1}).encode()
    )
    assert status == 400
    assert body["error"]["type"] == "InvalidTopicError"


def test_longest_and_oddest_valid_names_work(stack: Stack) -> None:
    names = ["x" * 249, "A.b_c-9", "-.-", "..."]
    with SyncAdmin(stack.url, timeout=10) as admin:
        for name in names:
            assert admin.create_topic(name, 1, replication_factor=1).name == name
            assert admin.describe_topic(name).name == name
        for name in names:
            admin.delete_topic(name)


def test_duplicate_is_409_topic_already_exists(stack: Stack, topic: str) -> None:
    with SyncAdmin(stack.url) as admin:
        admin.create_topic(topic, 1)
        with pytest.raises(errors.TopicAlreadyExistsError, match="already exists"):
            admin.create_topic(topic, 2)
        assert admin.describe_topic(topic).partitions == 1
    status, _, body = http(
        stack.url, "POST", "/topics", json.dumps({"name": topic, "partitions": 1}).encode()
    )
    assert (status, body["error"]["type"], body["error"]["code"]) == (
        409,
        "TopicAlreadyExistsError",
        36,
    )


def test_unknown_topic_is_404(stack: Stack, topic: str) -> None:
    async def scenario(admin: Admin) -> None:
        for call in (
            admin.describe_topic(topic),
            admin.delete_topic(topic),
            admin.create_partitions(topic, 2),
            admin.alter_configs(topic, {"retention.ms": 1}),
        ):
            with pytest.raises(errors.UnknownTopicOrPartitionError, match=topic):
                await call

    run(scenario, stack.url)
    assert http(stack.url, "GET", f"/topics/{topic}")[0] == 404


def test_add_partitions_only_grows(stack: Stack, topic: str) -> None:
    with SyncAdmin(stack.url) as admin:
        admin.create_topic(topic, 3)
        assert admin.create_partitions(topic, 5).partitions == 5
        for count in (5, 4, 1):
            with pytest.raises(errors.InvalidPartitionsError, match="must be greater"):
                admin.create_partitions(topic, count)
        for count in (0, 10_001):
            with pytest.raises(errors.InvalidPartitionsError):
                admin.create_partitions(topic, count)
        assert admin.describe_topic(topic).partitions == 5


def test_concurrent_alters_all_land(stack: Stack, topic: str) -> None:
    """Compare-and-set with re-reads: racing admins each change a different config."""
    keys = ["retention.ms", "segment.ms", "retention.bytes", "fsync.interval.ms"]

    async def scenario(admin: Admin) -> None:
        await admin.create_topic(topic, 1)
        await asyncio.gather(
            *(admin.alter_configs(topic, {key: 1000 + i}) for i, key in enumerate(keys))
        )
        configs = (await admin.describe_topic(topic)).configs
        assert [configs[k] for k in keys] == [1000, 1001, 1002, 1003]

    run(scenario, stack.url)


def test_alter_configs_validates(stack: Stack, topic: str) -> None:
    with SyncAdmin(stack.url) as admin:
        admin.create_topic(topic, 1, replication_factor=2)
        assert (
            admin.alter_configs(topic, {"min.insync.replicas": 2}).configs["min.insync.replicas"]
            == 2
        )
        with pytest.raises(errors.InvalidConfigError, match="unknown topic config 'retention'"):
            admin.alter_configs(topic, {"retention": 5})
        with pytest.raises(errors.InvalidConfigError, match=r"retention\.ms"):
            admin.alter_configs(topic, {"retention.ms": "soon"})
        with pytest.raises(errors.InvalidConfigError, match=r"fsync\.policy"):
            admin.alter_configs(topic, {"fsync.policy": "sometimes"})
        with pytest.raises(errors.InvalidConfigError, match="replication factor 2"):
            admin.alter_configs(topic, {"min.insync.replicas": 3})
        assert admin.describe_topic(topic).configs["min.insync.replicas"] == 2


def test_create_validates_replication_and_configs(stack: Stack, topic: str) -> None:
    with SyncAdmin(stack.url) as admin:
        with pytest.raises(errors.InvalidRequestError, match=r"larger than .* live agents \(3\)"):
            admin.create_topic(topic, 1, replication_factor=4)
        with pytest.raises(errors.InvalidConfigError, match="unknown topic config"):
            admin.create_topic(topic, 1, configs={"cleanup.policy": "compact"})
        with pytest.raises(errors.InvalidPartitionsError):
            admin.create_topic(topic, 0)
        assert topic not in admin.list_topics()
        assert admin.create_topic(topic, 1, replication_factor=2).replication_factor == 2


# ---------------------------------------------------------------- HTTP edges of the runtime


def test_http_errors_have_the_error_body(stack: Stack) -> None:
    cases: list[tuple[str, str, bytes | None, dict[str, str], int, str]] = [
        ("POST", "/topics", b"{not json", {}, 400, "InvalidRequestError"),
        ("POST", "/topics", b"[]", {}, 400, "InvalidRequestError"),
        ("POST", "/topics", b"\xff\xfe", {}, 400, "InvalidRequestError"),
        ("GET", "/nowhere", None, {}, 404, "RouteNotFoundError"),
        ("PUT", "/topics", b"{}", {}, 405, "MethodNotAllowedError"),
        ("BREW", "/topics", None, {}, 405, "MethodNotAllowedError"),
        ("POST", "/topics", b"x" * ((1 << 20) + 1), {}, 413, "PayloadTooLargeError"),
    ]
    for method, path, body, headers, status, kind in cases:
        got_status, got_headers, got = http(stack.url, method, path, body, headers)
        assert got_status == status, (method, path, got)
        assert got_headers["content-type"] == "application/json"
        assert got["error"]["type"] == kind
        assert got["error"]["retriable"] is False


def test_cluster_routes_check_their_input_and_keep_requests(stack: Stack, topic: str) -> None:
    """Agents, decommission, rebalance plan, preferred leaders, reassignment: bad input gets a
    typed 4xx and writes nothing; good requests land where the controller reads them."""
    with SyncAdmin(stack.url) as admin:
        listed = {a["agent_id"]: a for a in admin.list_agents()}
        assert {1, 2, 3} <= set(listed) and all(listed[a]["alive"] for a in (1, 2, 3))

        entry = admin.decommission_agent(2)
        assert entry["decommissioning"] and stack.zk.exists("/admin/decommission/2")
        assert not admin.recommission_agent(2)["decommissioning"]
        assert not stack.zk.exists("/admin/decommission/2")

        assert admin.rebalance(dry_run=True)["moves"] == []  # no partition states: nothing
        assert not stack.zk.exists("/admin/rebalance")
        admin.elect_preferred_leaders([topic])
        assert json.loads(stack.zk.get("/admin/preferred_leaders")[0]) == [topic]
        admin.elect_preferred_leaders()  # all topics: the pending request widens to all
        assert json.loads(stack.zk.get("/admin/preferred_leaders")[0]) == []
        stack.zk.delete("/admin/preferred_leaders")

        admin.create_topic(topic, 2)
        with pytest.raises(errors.UnknownTopicOrPartitionError):
            admin.reassign_partition(topic, 0, [1, 2])  # no state yet (no controller here)
    cases = [
        ("POST", "/agents/x/decommission", None, 400, "InvalidRequestError"),
        ("POST", "/agents/99/decommission", None, 400, "InvalidRequestError"),
        ("POST", "/cluster/preferred-leaders", b'{"topics": ["a/b"]}', 400, "InvalidTopicError"),
        ("POST", "/cluster/preferred-leaders", b'{"topic": "x"}', 400, "InvalidRequestError"),
        (
            "POST",
            f"/topics/{topic}/partitions/0/reassignment",
            b'{"replicas": [1, 1]}',
            400,
            "InvalidReplicationFactorError",
        ),
        (
            "POST",
            f"/topics/{topic}/partitions/0/reassignment",
            b'{"replicas": [7]}',
            400,
            "InvalidReplicationFactorError",
        ),
        (
            "POST",
            f"/topics/{topic}/partitions/9/reassignment",
            b'{"replicas": [1]}',
            400,
            "InvalidPartitionsError",
        ),
        ("POST", f"/topics/{topic}/partitions/0/reassignment", b'{"replicas": []}', 400, None),
        ("POST", "/topics/nope/partitions/0/reassignment", b'{"replicas": [1]}', 404, None),
    ]
    for method, path, body, status, kind in cases:
        headers = {"content-type": "application/json"} if body else {}
        got_status, _, got = http(stack.url, method, path, body, headers)
        assert got_status == status, (path, body, got)
        if kind is not None:
            assert got["error"]["type"] == kind, (path, got)
    assert not stack.zk.exists("/admin/decommission/99")


def test_admin_client_errors_without_a_server() -> None:
    with pytest.raises(errors.NetworkError) as refused:
        SyncAdmin(f"http://127.0.0.1:{free_port()}", timeout=2).list_topics()
    assert refused.value.retriable
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(errors.RequestTimedOutError):
            run(lambda admin: admin.list_topics(), url, timeout=0.3)
        assert time.monotonic() - started < 2
    with pytest.raises(errors.InvalidRequestError):
        SyncAdmin("localhost:8080")


def test_error_bodies_map_back_to_the_storage_classes() -> None:
    def body(cls: type[errors.StrataError], retriable: bool) -> bytes:
        err = {"type": cls.__name__, "code": cls.code, "message": "m", "retriable": retriable}
        return json.dumps({"error": err}).encode()

    for cls in (
        errors.InvalidTopicError,
        errors.InvalidConfigError,
        errors.InvalidPartitionsError,
        errors.TopicAlreadyExistsError,
        errors.UnknownTopicOrPartitionError,
        errors.RequestTimedOutError,
    ):
        exc = error_from_body(400, body(cls, cls.retriable))
        assert type(exc) is cls and str(exc) == "m"
    unavailable = error_from_body(503, body(errors.MetadataUnavailableError, True))
    assert isinstance(unavailable, errors.MetadataError) and unavailable.retriable
    assert type(error_from_body(502, b"<html>bad gateway")) is errors.NetworkError
    assert type(error_from_body(504, b"")) is errors.RequestTimedOutError
    assert type(error_from_body(418, b"teapot")) is errors.InvalidRequestError


def test_sdk_admin_imports_neither_kazoo_nor_the_agents() -> None:
    code = (
        "import sys, sdk.admin; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('kazoo', 'broker_agents')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=30)


def test_runtime_limits_slow_clients_and_connection_count(
    zk_chroot: ZooKeeperChroot, processes: ProcessGroup
) -> None:
    runtime = processes.start(
        command(
            zk_chroot.connect_string,
            extra=("--request-timeout", "0.5", "--max-connections", "2", "--max-body-bytes", "64"),
        ),
        name="local-runtime",
        cwd=ROOT,
    )
    url = wait_for_listening(runtime.popen, runtime.log_path)
    host, port = url.removeprefix("http://").split(":")

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=5)

    def read_all(sock: socket.socket) -> bytes:
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)

    # a body that never arrives: 408 after the request timeout, then the connection closes
    with connect() as slow:
        slow.sendall(b"POST /topics HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{")
        started = time.monotonic()
        answer = read_all(slow)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"RequestReadTimeoutError" in answer
        assert 0.3 < time.monotonic() - started < 3

    def until_slots_free() -> None:
        # a thread gives its slot back just after closing its socket: poll, as a client would
        deadline = time.monotonic() + 5
        while http(url, "GET", "/topics")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    until_slots_free()
    # idle connections take the slots (2); the next one is refused at once with a 503
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            conn = connect()
            conn.settimeout(0.2)
            try:
                refused = read_all(conn)
            except TimeoutError:
                held.append(conn)  # accepted, and waiting for a request
                continue
            conn.close()
            break
        else:
            pytest.fail("three idle connections were all accepted")
        assert 1 <= len(held) <= 2  # 1: the poll's own slot was not given back yet
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert b"too many connections" in refused
        for idle in held:  # idle connections are closed after the request timeout
            idle.settimeout(5)
            assert read_all(idle) == b""
    finally:
        for conn in held:
            conn.close()
    until_slots_free()
    assert http(url, "POST", "/topics", b"{" + b" " * 64 + b"}")[0] == 413
    assert runtime.alive


# ---------------------------------------------------------------- with a real agent


def test_describe_shows_the_states_a_real_controller_creates(
    zk_chroot: ZooKeeperChroot, processes: ProcessGroup, tmp_path: Path
) -> None:
    agent = processes.start(
        [
            sys.executable,
            "-m",
            "broker_agents.main",
            "--agent-id",
            "7",
            "--zookeeper",
            zk_chroot.connect_string,
            "--data-dir",
            str(tmp_path / "agent-7"),
        ],
        name="agent-7",
        cwd=ROOT,
    )
    wait_until_ready(
        agent.popen,
        lambda: '"event": "listening"' in agent.log_text(),
        what="agent 7",
        log_path=agent.log_path,
        timeout=20,
    )
    with (
        start_local_runtime(zk_chroot.connect_string, log_path=tmp_path / "runtime.log") as runtime,
        SyncAdmin(runtime.url, timeout=10) as admin,
    ):
        created = admin.create_topic("events", 2)
        assert created.replication_factor == 1  # min(3, one live agent)

        def online(count: int) -> TopicDescription:
            deadline = time.monotonic() + 10
            while True:
                described = admin.describe_topic("events")
                states = described.partition_states
                if len(states) == count and all(p.status is PartitionStatus.ONLINE for p in states):
                    return described
                assert time.monotonic() < deadline, described
                time.sleep(0.05)

        described = online(2)
        assert [
            (p.leader, p.leader_epoch, p.replicas, p.isr) for p in described.partition_states
        ] == [(7, 0, (7,), (7,))] * 2
        admin.create_partitions("events", 3)
        assert online(3).partition_states[2].leader == 7


def test_users_and_acls_routes(stack: Stack) -> None:
    """Users are stored salted (the password never in ZooKeeper nor in any answer); ACLs are
    added, listed and removed; bad input is a typed 400 and writes nothing."""
    password = "route-secret-5c1d"
    acl = {
        "principal": "User:carol",
        "resource_type": "topic",
        "name": "orders-",
        "pattern_type": "prefixed",
        "operation": "write",
        "permission": "allow",
    }

    async def body(admin: Admin) -> None:
        assert await admin.set_user("carol", password) == {
            "name": "carol",
            "mechanisms": ["SCRAM-SHA-256", "SCRAM-SHA-512"],
        }
        assert (await admin.list_users())["carol"] == ["SCRAM-SHA-256", "SCRAM-SHA-512"]
        assert await admin.add_acls([acl]) == [acl]
        assert acl in await admin.list_acls()
        with pytest.raises(errors.InvalidRequestError):
            await admin.add_acls([{**acl, "operation": "fly"}])
        with pytest.raises(errors.InvalidRequestError):
            await admin.set_user("carol", "")
        with pytest.raises(errors.InvalidRequestError):
            await admin.set_user("a/b", password)
        assert await admin.remove_acls([acl]) == 1
        assert acl not in await admin.list_acls()
        assert await admin.delete_user("carol") is True
        assert await admin.delete_user("carol") is False

    async def set_dave(admin: Admin) -> None:
        await admin.set_user("dave", password, ["SCRAM-SHA-256"])

    run(body, stack.url)
    run(set_dave, stack.url)
    stored, _ = stack.zk.get("/config/users/dave")
    assert password.encode() not in stored
    assert b"stored_key" in stored and b"SCRAM-SHA-256" in stored
    status, _, answer = http(
        stack.url, "PUT", "/users/dave", json.dumps({"password": "x" * 2000}).encode()
    )
    assert status == 400 and "x" * 20 not in json.dumps(answer)  # never quoted back


def test_users_and_acls_cli(stack: Stack) -> None:
    """``strata users`` and ``strata acls`` through the admin API (the password from the
    environment, never echoed)."""

    def cli(*args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "infra.cli", "--admin-url", stack.url, "-o", "json", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **(env or {})},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    secret = "cli-secret-0a9f"
    out = cli("users", "set", "erin", env={"STRATA_USER_PASSWORD": secret})
    assert json.loads(out)["name"] == "erin" and secret not in out
    assert "erin" in json.loads(cli("users", "list"))["users"]
    rule = ("--principal", "User:erin", "--resource", "group:billing-", "--operation", "read")
    cli("acls", "add", *rule, "--prefixed")
    listed = json.loads(cli("acls", "list"))["acls"]
    assert {
        "principal": "User:erin",
        "resource_type": "group",
        "name": "billing-",
        "pattern_type": "prefixed",
        "operation": "read",
        "permission": "allow",
    } in listed
    assert json.loads(cli("acls", "remove", *rule, "--prefixed"))["removed"] == 1
    assert json.loads(cli("users", "delete", "erin"))["deleted"] is True
