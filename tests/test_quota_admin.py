"""Managing quotas: the admin API's ``/quotas`` routes, ``sdk.admin`` and ``strata quotas``.

Everything goes through a real local runtime (a child process serving the Lambda handler on
loopback) over a real ZooKeeper, and the stored ``/config/quotas`` znode is read back with
kazoo: what an answer claims is what the agents will see. One test invokes the handler as
Lambda does, to show that both path spellings API Gateway may deliver (a principal encoded or
not) reach the same quota. Enforcement by the agents is tested elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.client import KazooClient

from handlers import runtime
from infra.local_runtime import command, wait_for_listening
from infra.zookeeper import ZooKeeperServer
from sdk.admin import Admin, SyncAdmin
from storage import errors
from storage.metadata.quotas import QUOTAS
from tests.harness import (
    ProcessGroup,
    ZooKeeperChroot,
    close_client,
    create_chroot,
    delete_chroot,
    kazoo_client,
)
from tests.test_admin import event, invoke
from tests.test_admin_http import ROOT, Stack, http, run

MiB = 1 << 20


@pytest.fixture(scope="module")
def stack(zk_server: ZooKeeperServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = kazoo_client(zk_server.connect_string)
    chroot = create_chroot(root, zk_server.connect_string, "test_quota_admin")
    zk = kazoo_client(chroot.connect_string)
    group = ProcessGroup(tmp_path_factory.mktemp("quota-admin"))
    try:
        process = group.start(command(chroot.connect_string), name="local-runtime", cwd=ROOT)
        url = wait_for_listening(process.popen, process.log_path)
        yield Stack(url=url, chroot=chroot, zk=zk)
    finally:
        group.close()
        close_client(zk)
        delete_chroot(root, chroot)
        close_client(root)


def stored(zk: KazooClient) -> tuple[dict[str, Any], int]:
    """``/config/quotas`` as the agents read it, and its version ({} and -1: never written)."""
    if zk.exists(QUOTAS) is None:
        return {}, -1
    data, stat = zk.get(QUOTAS)
    return json.loads(data), stat.version


def put(stack: Stack, principal_path: str, body: bytes) -> tuple[int, Any]:
    status, headers, answer = http(stack.url, "PUT", f"/quotas/{principal_path}", body)
    assert headers["content-type"] == "application/json"
    return status, answer


# ---------------------------------------------------------------- the HTTP routes


def test_set_list_delete_over_http(stack: Stack) -> None:
    """PUT replaces a principal's whole quota, GET lists them all, DELETE removes one; the
    principal travels percent-encoded (``:`` and the default's ``*``)."""
    status, answer = put(
        stack, "User%3Ahttp-alice", json.dumps({"producer_byte_rate": MiB}).encode()
    )
    assert (status, answer) == (
        200,
        {"principal": "User:http-alice", "quota": {"producer_byte_rate": MiB}},
    )
    both = {"consumer_byte_rate": 10 * MiB, "request_rate": 1000}
    status, answer = put(stack, "User%3A%2A", json.dumps(both).encode())
    assert (status, answer) == (200, {"principal": "User:*", "quota": both})

    status, _, listed = http(stack.url, "GET", "/quotas")
    assert status == 200
    assert listed["quotas"]["User:http-alice"] == {"producer_byte_rate": MiB}
    assert listed["quotas"]["User:*"] == both
    assert stored(stack.zk)[0] == listed["quotas"]

    # a PUT replaces: the rate left out is unlimited again
    status, answer = put(stack, "User%3Ahttp-alice", b'{"request_rate": 5}')
    assert status == 200 and answer["quota"] == {"request_rate": 5}
    assert stored(stack.zk)[0]["User:http-alice"] == {"request_rate": 5}
    # an empty quota removes the entry
    status, answer = put(stack, "User%3Ahttp-alice", b"{}")
    assert (status, answer) == (200, {"principal": "User:http-alice", "quota": {}})
    assert "User:http-alice" not in stored(stack.zk)[0]

    put(stack, "User%3Ahttp-alice", b'{"consumer_byte_rate": 4096}')
    assert http(stack.url, "DELETE", "/quotas/User%3Ahttp-alice")[::2] == (200, {"deleted": True})
    assert http(stack.url, "DELETE", "/quotas/User%3Ahttp-alice")[::2] == (200, {"deleted": False})
    assert http(stack.url, "DELETE", "/quotas/User%3A%2A")[::2] == (200, {"deleted": True})
    quotas, _ = stored(stack.zk)
    assert "User:http-alice" not in quotas and "User:*" not in quotas
    assert "User:http-alice" not in http(stack.url, "GET", "/quotas")[2]["quotas"]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("alice", b'{"request_rate": 1}', "User:<name>"),
        ("Group%3Aops", b'{"request_rate": 1}', "User:<name>"),
        ("User%3A", b'{"request_rate": 1}', "User:<name>"),
        ("User%3Aa%20b", b'{"request_rate": 1}', "without spaces"),
        ("User%3Abad-rates", b'{"producer_byte_rate": -1}', "producer_byte_rate"),
        ("User%3Abad-rates", b'{"request_rate": 0}', "request_rate"),
        ("User%3Abad-rates", b'{"request_rate": 2.5}', "request_rate"),
        ("User%3Abad-rates", b'{"consumer_byte_rate": 2199023255553}', "consumer_byte_rate"),
        (
            "User%3Abad-rates",
            b'{"request_rate": 10, "bytes_rate": 5}',
            "unknown quota key 'bytes_rate'; known: producer_byte_rate",
        ),
        ("User%3Abad-rates", b'{"request_rate": true}', "request_rate: a whole number"),
        ("User%3Abad-rates", b'{"request_rate": "100"}', "request_rate: a whole number"),
        ("User%3Abad-rates", b"[1, 2]", "must be a JSON object, not list"),
        ("User%3Abad-rates", b'"fast"', "must be a JSON object, not str"),
        ("User%3Abad-rates", b"{not json", "not valid JSON"),
        ("User%3Abad-rates", b"", "needs a JSON object"),
    ],
)
def test_bad_input_is_400_and_changes_nothing(
    stack: Stack, path: str, body: bytes, says: str
) -> None:
    put(stack, "User%3Akeep", b'{"producer_byte_rate": 2048}')
    before = stored(stack.zk)
    status, answer = put(stack, path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "InvalidRequestError"
    assert answer["error"]["retriable"] is False
    assert says in answer["error"]["message"]
    assert stored(stack.zk) == before


def test_delete_with_a_bad_principal_is_400(stack: Stack) -> None:
    put(stack, "User%3Akeep", b'{"producer_byte_rate": 2048}')
    before = stored(stack.zk)
    status, _, answer = http(stack.url, "DELETE", "/quotas/alice")
    assert status == 400 and "User:<name>" in answer["error"]["message"]
    assert stored(stack.zk) == before


def test_lambda_events_with_encoded_and_plain_principals(
    zk_chroot: ZooKeeperChroot, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API Gateway may hand the path over encoded (HTTP API's ``rawPath``) or not: both name
    the same principal."""
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", zk_chroot.connect_string)
    runtime.close_shared_runtime()
    try:
        code, body, _ = invoke(event("PUT", "/quotas/User%3A%2A", {"request_rate": 100}))
        assert (code, body) == (200, {"principal": "User:*", "quota": {"request_rate": 100}})
        code, body, _ = invoke(event("PUT", "/quotas/User:*", {"request_rate": 200}))
        assert (code, body) == (200, {"principal": "User:*", "quota": {"request_rate": 200}})
        assert stored(zk_client)[0] == {"User:*": {"request_rate": 200}}
        assert invoke(event("GET", "/quotas"))[:2] == (
            200,
            {"quotas": {"User:*": {"request_rate": 200}}},
        )
        assert invoke(event("DELETE", "/quotas/User:*"))[:2] == (200, {"deleted": True})
        assert stored(zk_client)[0] == {}
    finally:
        runtime.close_shared_runtime()


# ---------------------------------------------------------------- the SDK


def test_sdk_round_trip(stack: Stack) -> None:
    async def scenario(admin: Admin) -> None:
        assert await admin.set_quota("User:sdk-bob", producer_byte_rate=MiB, request_rate=50) == {
            "principal": "User:sdk-bob",
            "quota": {"producer_byte_rate": MiB, "request_rate": 50},
        }
        assert (await admin.list_quotas())["User:sdk-bob"] == {
            "producer_byte_rate": MiB,
            "request_rate": 50,
        }
        with pytest.raises(errors.InvalidRequestError, match="consumer_byte_rate"):
            await admin.set_quota("User:sdk-bob", consumer_byte_rate=-5)
        with pytest.raises(errors.InvalidRequestError, match="User:<name>"):
            await admin.set_quota("bob", request_rate=1)
        assert (await admin.list_quotas())["User:sdk-bob"] == {
            "producer_byte_rate": MiB,
            "request_rate": 50,
        }
        assert await admin.delete_quota("User:sdk-bob") is True
        assert await admin.delete_quota("User:sdk-bob") is False
        assert "User:sdk-bob" not in await admin.list_quotas()

    run(scenario, stack.url)

    # the blocking client, with the default principal and a name that needs quoting
    with SyncAdmin(stack.url, timeout=10) as admin:
        for principal in ("User:*", "User:CN=carol,O=acme/ops?x#y%"):
            answer = admin.set_quota(principal, consumer_byte_rate=3 * MiB)
            assert answer == {"principal": principal, "quota": {"consumer_byte_rate": 3 * MiB}}
            assert admin.list_quotas()[principal] == {"consumer_byte_rate": 3 * MiB}
            assert stored(stack.zk)[0][principal] == {"consumer_byte_rate": 3 * MiB}
            assert admin.set_quota(principal) == {"principal": principal, "quota": {}}
            assert principal not in admin.list_quotas()
            assert admin.delete_quota(principal) is False


# ---------------------------------------------------------------- the CLI


def cli(stack: Stack, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "infra.cli", "--admin-url", stack.url, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert (done.returncode == 0) is ok, (done.returncode, done.stdout, done.stderr)
    return done


def test_cli_round_trip(stack: Stack) -> None:
    """``strata quotas set|list|delete`` with ``-o json`` and as text; bad input exits 1 with
    the server's message and stores nothing."""
    done = cli(
        stack, "-o", "json", "quotas", "set", "--principal", "User:cli-erin",
        "--producer-byte-rate", str(MiB), "--request-rate", "20",
    )  # fmt: skip
    assert json.loads(done.stdout) == {
        "principal": "User:cli-erin",
        "quota": {"producer_byte_rate": MiB, "request_rate": 20},
    }
    listed = json.loads(cli(stack, "-o", "json", "quotas", "list").stdout)["quotas"]
    assert listed["User:cli-erin"] == {"producer_byte_rate": MiB, "request_rate": 20}
    assert stored(stack.zk)[0]["User:cli-erin"] == listed["User:cli-erin"]

    done = cli(stack, "quotas", "set", "--principal", "User:*", "--consumer-byte-rate", "4096")
    assert "quota of User:*: consumer_byte_rate=4096" in done.stdout
    table = cli(stack, "quotas", "list").stdout
    assert "User:cli-erin" in table and "User:*" in table and "4096" in table

    before = stored(stack.zk)
    bad = cli(
        stack, "quotas", "set", "--principal", "User:cli-erin", "--request-rate", "-3", ok=False
    )
    assert bad.returncode == 1 and "request_rate" in bad.stderr and "error" in bad.stderr
    bad = cli(stack, "quotas", "delete", "--principal", "erin", ok=False)
    assert bad.returncode == 1 and "User:<name>" in bad.stderr
    assert stored(stack.zk) == before

    done = cli(stack, "-o", "json", "quotas", "delete", "--principal", "User:cli-erin")
    assert json.loads(done.stdout) == {"deleted": True}
    done = cli(stack, "quotas", "delete", "--principal", "User:cli-erin")
    assert "quota of User:cli-erin did not exist" in done.stdout
    done = cli(stack, "quotas", "set", "--principal", "User:cli-erin")
    assert "quota of User:cli-erin removed" in done.stdout
    done = cli(stack, "quotas", "delete", "--principal", "User:*")
    assert "quota of User:* deleted" in done.stdout
    quotas, _ = stored(stack.zk)
    assert "User:cli-erin" not in quotas and "User:*" not in quotas
