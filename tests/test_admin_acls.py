"""ACL checks on the admin API's own routes (``handlers.access``), against a real ZooKeeper.

**The matrix** is generated from the route table (``handlers.admin.ROUTER``): for every route,
the admin handler is invoked as Lambda invokes it (as ``tests/test_admin.py`` does) by a super
user, by a principal granted what the route's rule needs (literally, and by prefix), by one
granted only the same operations on other names, by one granted it and denied it too, and,
where a route needs several things or one of several, by principals that lack one or hold
only the other. Each case starts from the same state in a fresh chroot (topics, a group, a
retry policy, a redrive task, a user, a quota, ACLs). Every allowed case answers what the
super user's does (``CALLS`` lists it); every refused one answers 403 with the resource
type's error and leaves every znode of the chroot as it was. A route with no entry in
``CALLS`` (or a rule that needs nothing and filters nothing) fails the test.

Around it: the route -> permission table of ``docs/security.md`` is the one the rules make;
listings leave out what the caller may not describe; the principal comes from IAM ARNs, a
Lambda authorizer or nowhere; and the real local runtime, over HTTP, asks for Basic
credentials of the SCRAM users in ZooKeeper and hands the principal on.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from handlers import access, runtime
from handlers.admin import ROUTER
from handlers.http import AnyOf, Need, Request, Route, iam_principal, principal_of
from infra.basic_auth import BasicAuthenticator, parse_basic
from infra.local_runtime import command, wait_for_listening
from sdk import delays
from sdk.admin import AdminConfig, SyncAdmin
from storage import errors
from storage.metadata.acls import (
    ACLS,
    CLUSTER_NAME,
    AclBinding,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    encode_acls,
)
from storage.metadata.groups import GroupRecord
from storage.metadata.models import PartitionState, dump
from storage.metadata.retry import REDRIVES
from storage.metadata.users import USERS, ScramCredential, encode_user
from tests.delay_support import wait_until
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.test_admin import context, event, load_event, register_agents
from tests.test_admin_http import http

ROOT = Path(__file__).resolve().parent.parent
SUPER = "User:root"
CAROL = "User:carol"
TASK = "a1b2c3d4e5f6"
TOPIC, DLQ, GROUP = "orders-1", "orders-1.dlq", "billing-1"
SCHEDULE = delays.ScheduleId.new(4_000_000_000_000, TOPIC, 0, b"k", "n0nce").encode()


# ---------------------------------------------------------------- one request per route


@dataclass(frozen=True)
class Call:
    """A request for one route, the super user's status for it in the fixture state, and the
    resources its rule names (``type:name``, in the rule's order; an AnyOf's first option)."""

    path: str
    expect: int
    names: tuple[str, ...]
    body: Any = None
    agents: bool = True
    """Agent registrations stay (no agent behind them). Routes that ask agents for offsets
    run without, and answer "no live agents" (400) instead of waiting for a dead one."""


T, G, C = f"topic:{TOPIC}", f"group:{GROUP}", f"cluster:{CLUSTER_NAME}"
POLICY = {"max_attempts": 3, "initial_ms": 10}
CALLS: dict[tuple[str, str], Call] = {
    ("POST", "/topics"): Call(
        "/topics", 201, ("topic:orders-9",), {"name": "orders-9", "partitions": 1}
    ),
    ("GET", "/topics"): Call("/topics", 200, ()),
    ("GET", "/topics/{name}"): Call(f"/topics/{TOPIC}", 200, (T,)),
    ("DELETE", "/topics/{name}"): Call(f"/topics/{TOPIC}", 202, (T,)),
    ("POST", "/topics/{name}/partitions"): Call(
        f"/topics/{TOPIC}/partitions", 200, (T,), {"count": 4}
    ),
    ("PATCH", "/topics/{name}/configs"): Call(
        f"/topics/{TOPIC}/configs", 200, (T,), {"configs": {"retention.ms": 60_000}}
    ),
    ("GET", "/groups"): Call("/groups", 200, ()),
    ("GET", "/groups/{group}"): Call(f"/groups/{GROUP}", 200, (G,)),
    ("POST", "/groups/{group}/offsets"): Call(
        f"/groups/{GROUP}/offsets", 200, (G, T), {"topic": TOPIC, "to": {"offset": 0}}
    ),
    ("DELETE", "/groups/{group}"): Call(f"/groups/{GROUP}", 204, (G,)),
    ("GET", "/agents"): Call("/agents", 200, (C,)),
    ("POST", "/agents/{agent}/decommission"): Call("/agents/2/decommission", 202, (C,)),
    ("DELETE", "/agents/{agent}/decommission"): Call("/agents/2/decommission", 200, (C,)),
    ("GET", "/cluster/rebalance"): Call("/cluster/rebalance", 200, (C,)),
    ("POST", "/cluster/rebalance"): Call("/cluster/rebalance", 202, (C,)),
    ("POST", "/cluster/preferred-leaders"): Call("/cluster/preferred-leaders", 202, (C,), {}),
    ("POST", "/topics/{name}/partitions/{partition}/reassignment"): Call(
        f"/topics/{TOPIC}/partitions/0/reassignment", 202, (C,), {"replicas": [1, 2]}
    ),
    ("POST", "/delays/topics"): Call("/delays/topics", 200, (C,), {}),
    ("POST", "/delays/cancel"): Call("/delays/cancel", 200, (T,), {"schedule_id": SCHEDULE}),
    ("GET", "/delays/status"): Call("/delays/status", 200, (C,)),
    ("POST", "/dlq/{topic}/redrive"): Call(
        f"/dlq/{DLQ}/redrive", 400, (f"topic:{DLQ}", T), {"to": TOPIC}, agents=False
    ),
    ("GET", "/dlq/redrives"): Call("/dlq/redrives", 200, ()),
    ("GET", "/dlq/redrives/{task_id}"): Call(f"/dlq/redrives/{TASK}", 200, (f"topic:{DLQ}",)),
    ("POST", "/dlq/redrives/{task_id}/run"): Call(
        f"/dlq/redrives/{TASK}/run", 400, (f"topic:{DLQ}", T), agents=False
    ),
    ("DELETE", "/dlq/redrives/{task_id}"): Call(f"/dlq/redrives/{TASK}", 200, (f"topic:{DLQ}", T)),
    ("GET", "/groups/{group}/retry"): Call(f"/groups/{GROUP}/retry", 200, (G,)),
    ("PUT", "/groups/{group}/retry/{topic}"): Call(
        f"/groups/{GROUP}/retry/{TOPIC}",
        200,
        (G, "topic:orders-1.dead"),
        {**POLICY, "dead_letter_topic": "orders-1.dead"},
    ),
    ("GET", "/groups/{group}/retry/{topic}"): Call(f"/groups/{GROUP}/retry/{TOPIC}", 200, (G,)),
    ("DELETE", "/groups/{group}/retry/{topic}"): Call(f"/groups/{GROUP}/retry/{TOPIC}", 204, (G,)),
    ("GET", "/retry/status"): Call("/retry/status", 200, (C,)),
    ("GET", "/dlq/{topic}/count"): Call(f"/dlq/{DLQ}/count", 400, (f"topic:{DLQ}",), agents=False),
    ("GET", "/dlq/{topic}/peek"): Call(f"/dlq/{DLQ}/peek", 400, (f"topic:{DLQ}",), agents=False),
    ("GET", "/users"): Call("/users", 200, (C,)),
    ("PUT", "/users/{name}"): Call(
        "/users/dave", 200, (C,), {"password": "dave's secret", "iterations": 4096}
    ),
    ("DELETE", "/users/{name}"): Call("/users/erin", 200, (C,)),
    ("GET", "/acls"): Call("/acls", 200, (C,)),
    ("POST", "/acls"): Call(
        "/acls",
        201,
        (C,),
        {
            "acls": [
                {"principal": "User:x", "resource_type": "topic", "name": "x", "operation": "read"}
            ]
        },
    ),
    ("DELETE", "/acls"): Call(
        "/acls",
        200,
        (C,),
        {
            "acls": [
                {
                    "principal": "User:erin",
                    "resource_type": "group",
                    "name": "g",
                    "operation": "read",
                }
            ]
        },
    ),
    ("GET", "/quotas"): Call("/quotas", 200, (C,)),
    ("PUT", "/quotas/{principal}"): Call("/quotas/User%3Aalice", 200, (C,), {"request_rate": 5}),
    ("DELETE", "/quotas/{principal}"): Call("/quotas/User%3Aerin", 200, (C,)),
}
"""Keyed by (method, pattern); every route of ``ROUTER`` must have one."""

FIXTURE_ACLS = [
    AclBinding(
        principal="User:erin",
        resource_type=ResourceType.GROUP,
        name="g",
        operation=Operation.READ,
    )
]


# ---------------------------------------------------------------- the fixture state


def admin_event(
    method: str, path: str, body: Any = None, principal: str | None = None
) -> dict[str, Any]:
    e = event(method, path, body)
    e["rawPath"] = path.split("?")[0]
    e["requestContext"]["http"]["path"] = urllib.parse.unquote(e["rawPath"])
    if principal is not None:
        e["requestContext"]["authorizer"] = {"lambda": {"principal": principal}}
    return e


def call(method: str, path: str, body: Any = None, principal: str = SUPER) -> tuple[int, Any]:
    response = ROUTER.serve(admin_event(method, path, body, principal), context(15.0))
    payload = json.loads(response["body"]) if response["body"] else None
    return response["statusCode"], payload


@pytest.fixture
def admin(zk_chroot: ZooKeeperChroot, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The handlers pointed at this test's chroot with the authorizer on (ACLs never cached,
    so each write counts at once); their runtime and the guard's settings reset after."""
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", zk_chroot.connect_string)
    monkeypatch.setenv(access.AUTHORIZER_ENV, "1")
    monkeypatch.setenv(access.SUPER_USERS_ENV, f"{SUPER};User:agents")
    monkeypatch.setenv(access.CACHE_ENV, "0")
    runtime.close_shared_runtime()
    access.reset()
    yield zk_chroot.connect_string
    runtime.close_shared_runtime()
    access.reset()


def build_state(zk: KazooClient) -> None:
    """Topics, a group, a retry policy, a redrive task, a user and a quota (made as the
    super user through the handler where it can be), and one ACL."""
    register_agents(zk, [1, 2, 3])
    for name, partitions in ((TOPIC, 2), (DLQ, 2)):
        assert call("POST", "/topics", {"name": name, "partitions": partitions})[0] == 201
    # partition 0's state, as the controller would write it (there is no controller here)
    state = PartitionState(
        leader=1, leader_epoch=0, replicas=[1, 2, 3], isr=[1, 2, 3], controller_epoch=1
    )
    zk.create(f"/topics/{TOPIC}/partitions/0/state", dump(state), makepath=True)
    zk.ensure_path(f"/groups/{GROUP}/offsets")
    zk.create(f"/groups/{GROUP}/state", dump(GroupRecord(group_id=GROUP)))
    assert call("PUT", f"/groups/{GROUP}/retry/{TOPIC}", POLICY)[0] == 200
    task = {
        "id": TASK,
        "source": DLQ,
        "target": TOPIC,
        "rate": 100,
        "filter": None,
        "dry_run": False,
        "state": "running",
        "created_ms": 0,
        "end": {"0": 0, "1": 0},
        "next": {"0": 0, "1": 0},
        "total": 0,
        "scanned": 0,
        "moved": 0,
        "skipped": 0,
        "intent": None,
        "last_chunk_ms": None,
    }
    zk.create(f"{REDRIVES}/{TASK}", json.dumps(task).encode(), makepath=True)
    cred = ScramCredential.make("SCRAM-SHA-256", "erin's secret", 4096)
    zk.create(f"{USERS}/erin", encode_user({"SCRAM-SHA-256": cred}), makepath=True)
    assert call("PUT", "/quotas/User%3Aerin", {"request_rate": 1})[0] == 200
    zk.create(ACLS, encode_acls(FIXTURE_ACLS), makepath=True)


def snapshot(zk: KazooClient, path: str = "/") -> dict[str, bytes]:
    """Every znode's data under ``path``."""
    data, _ = zk.get(path)
    out = {path: data}
    for child in zk.get_children(path):
        out.update(snapshot(zk, f"{path.rstrip('/')}/{child}"))
    return out


def set_acls(zk: KazooClient, bindings: list[AclBinding]) -> None:
    zk.set(ACLS, encode_acls(FIXTURE_ACLS + bindings))


# ---------------------------------------------------------------- generating the cases


def _options(item: Need | AnyOf) -> tuple[Need, ...]:
    return item.needs if isinstance(item, AnyOf) else (item,)


def grant(need: Need, name: str, *, prefixed: bool = False, deny: bool = False) -> AclBinding:
    return AclBinding(
        principal=CAROL,
        resource_type=need.resource,
        name=name[: max(1, len(name) // 2)] if prefixed else name,
        operation=need.operation,
        permission=Permission.DENY if deny else Permission.ALLOW,
        pattern_type=PatternType.PREFIXED if prefixed else PatternType.LITERAL,
    )


@dataclass(frozen=True)
class Case:
    """``chosen[i]``: which option of the rule's i-th need is granted (None: none of them)."""

    kind: str
    allowed: bool
    chosen: tuple[int | None, ...] = ()
    prefixed: bool = False
    decoy: bool = False
    deny: bool = False
    refused_by: int = 0
    """When refused: the index of the need that refuses."""


def cases_for(route: Route) -> list[Case]:
    n = len(route.rule.needs)
    first = tuple(0 for _ in range(n))
    out = [
        Case("super", True),
        Case("literal", True, first),
        Case("prefixed", True, first, prefixed=True),
    ]
    if n == 0:
        return out
    out += [
        Case("other-names", False, first, decoy=True),
        Case("allow-and-deny", False, first, deny=True),
        Case("no-acls", False, tuple(None for _ in range(n))),
    ]
    for i, item in enumerate(route.rule.needs):
        if n > 1:
            lacking = tuple(None if j == i else 0 for j in range(n))
            out.append(Case(f"lacks-need-{i}", False, lacking, refused_by=i))
        for k in range(1, len(_options(item))):
            other = tuple(k if j == i else 0 for j in range(n))
            out.append(Case(f"need-{i}-option-{k}", True, other))
    return out


MATRIX = [
    pytest.param(route, case, id=f"{route.method} {route.pattern} [{case.kind}]")
    for route in ROUTER.routes
    for case in cases_for(route)
]


def resolved(route: Route, call_: Call) -> list[list[tuple[Need, str]]]:
    """Each need's options with the names they resolve to for this call."""
    request = Request.from_event(admin_event(route.method, call_.path, call_.body))
    params = ROUTER.match(request)[1]
    out = []
    for item in route.rule.needs:
        names = []
        for need in _options(item):
            name = runtime.shared_runtime().call(
                lambda store, need=need: need.name.resolve(request, params, store), timeout=10
            )
            names.append((need, name))
        out.append(names)
    return out


def acls_for(case: Case, needs: list[list[tuple[Need, str]]]) -> list[AclBinding]:
    out = []
    for option, choices in zip(case.chosen, needs, strict=True):
        if option is None:
            continue
        need, name = choices[option]
        if case.decoy:
            out += [grant(need, f"zz-{name}"), grant(need, f"zz-{name}", prefixed=True)]
            continue
        out.append(grant(need, name, prefixed=case.prefixed))
    if case.deny:
        need, name = needs[0][0]
        out.append(grant(need, name, deny=True))
    return out


def test_every_route_has_a_rule_and_a_case() -> None:
    patterns = [(r.method, r.pattern) for r in ROUTER.routes]
    assert len(set(patterns)) == len(patterns)
    assert sorted(patterns) == sorted(CALLS), "a route without a CALLS entry, or a stale one"
    for route in ROUTER.routes:
        assert route.rule.needs or route.rule.shows, f"{route.pattern} needs nothing"


@pytest.mark.parametrize(("route", "case"), MATRIX)
def test_matrix(admin: str, zk_client: KazooClient, route: Route, case: Case) -> None:
    c = CALLS[(route.method, route.pattern)]
    build_state(zk_client)
    needs = resolved(route, c)
    got_names = tuple(f"{opts[0][0].resource}:{opts[0][1]}" for opts in needs)
    assert got_names == c.names, "the rule names other resources than the call's"
    principal = SUPER if case.kind == "super" else CAROL
    set_acls(zk_client, [] if case.kind == "super" else acls_for(case, needs))
    if not c.agents:
        for agent in zk_client.get_children("/agents"):
            zk_client.delete(f"/agents/{agent}")
    before = snapshot(zk_client)

    status, body = call(route.method, c.path, c.body, principal)

    if case.allowed:
        assert status == c.expect, body
        return
    assert status == 403, body
    need = _options(route.rule.needs[case.refused_by])[0]
    assert body["error"]["type"] == access.REFUSALS[need.resource].__name__
    assert CAROL in body["error"]["message"]
    assert snapshot(zk_client) == before, "a refused request changed ZooKeeper"


# ---------------------------------------------------------------- listings, docs, settings


def test_listings_leave_out_what_the_caller_may_not_describe(
    admin: str, zk_client: KazooClient
) -> None:
    build_state(zk_client)
    assert call("POST", "/topics", {"name": "payments", "partitions": 1})[0] == 201
    zk_client.ensure_path("/groups/other-group/offsets")
    topics = sorted(call("GET", "/topics")[1]["topics"])
    assert "payments" in topics and TOPIC in topics

    set_acls(
        zk_client,
        [
            AclBinding(
                principal=CAROL,
                resource_type=ResourceType.TOPIC,
                name="orders-",
                operation=Operation.READ,
                pattern_type=PatternType.PREFIXED,
            ),
            AclBinding(
                principal=CAROL,
                resource_type=ResourceType.TOPIC,
                name=DLQ,
                operation=Operation.ALL,
                permission=Permission.DENY,
            ),
            AclBinding(
                principal="User:*",
                resource_type=ResourceType.GROUP,
                name=GROUP,
                operation=Operation.DESCRIBE,
            ),
        ],
    )
    status, listed = call("GET", "/topics", principal=CAROL)
    assert status == 200
    assert listed["topics"] == [TOPIC], "prefix allows orders-*, the deny takes the DLQ away"
    assert call("GET", "/topics", principal="User:nobody")[1]["topics"] == []
    groups = call("GET", "/groups", principal=CAROL)[1]["groups"]
    assert [g["group_id"] for g in groups] == [GROUP]
    assert {g["group_id"] for g in call("GET", "/groups")[1]["groups"]} == {GROUP, "other-group"}
    tasks = call("GET", "/dlq/redrives", principal=CAROL)[1]["tasks"]
    assert tasks == [], "the task's source is the denied DLQ"
    assert [t["id"] for t in call("GET", "/dlq/redrives")[1]["tasks"]] == [TASK]


def test_the_docs_show_the_rules_of_every_route() -> None:
    docs = (ROOT / "docs" / "security.md").read_text()
    assert access.rule_table(ROUTER.routes) in docs, (
        "docs/security.md's route table differs from the routes' rules; paste:\n"
        + access.rule_table(ROUTER.routes)
    )


def test_off_by_default_and_super_users_from_the_environment() -> None:
    assert access.AccessConfig.from_env({}) == access.AccessConfig()
    config = access.AccessConfig.from_env(
        {
            access.AUTHORIZER_ENV: "1",
            access.SUPER_USERS_ENV: "User:admin, User:agents;User:ops",
            access.CACHE_ENV: "250",
        }
    )
    assert config.enabled and config.cache_s == 0.25
    assert config.super_users == {"User:admin", "User:agents", "User:ops"}
    with pytest.raises(errors.InvalidRequestError):
        access.AccessConfig.from_env({access.SUPER_USERS_ENV: "admin"})
    with pytest.raises(errors.InvalidRequestError):
        access.AccessConfig.from_env({access.AUTHORIZER_ENV: "maybe"})


def test_the_authorizer_off_lets_anyone_in(
    zk_chroot: ZooKeeperChroot, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", zk_chroot.connect_string)
    monkeypatch.delenv(access.AUTHORIZER_ENV, raising=False)
    runtime.close_shared_runtime()
    access.reset()
    try:
        register_agents(zk_client, [1])
        assert call("POST", "/topics", {"name": "t", "partitions": 1}, "User:ANONYMOUS")[0] == 201
        assert call("DELETE", "/topics/t", principal="User:ANONYMOUS")[0] == 202
    finally:
        runtime.close_shared_runtime()
        access.reset()


def test_acl_changes_count_within_the_cache_time(
    admin: str, zk_client: KazooClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(access.CACHE_ENV, "300")
    access.reset()
    build_state(zk_client)
    assert call("GET", f"/topics/{TOPIC}", principal=CAROL)[0] == 403
    set_acls(
        zk_client,
        [
            AclBinding(
                principal=CAROL,
                resource_type=ResourceType.TOPIC,
                name=TOPIC,
                operation=Operation.DESCRIBE,
            )
        ],
    )
    wait_until(
        lambda: call("GET", f"/topics/{TOPIC}", principal=CAROL)[0] == 200, 5.0, "the new ACL"
    )


# ---------------------------------------------------------------- who is calling


def with_context(base: str, **context: Any) -> dict[str, Any]:
    e = load_event(base)
    e["requestContext"].update(context)
    return e


ROLE_SESSION = "arn:aws:sts::123456789012:assumed-role/strata-operators/alice@example.com"


@pytest.mark.parametrize(
    ("event_", "principal"),
    [
        (
            with_context(
                "create_topic",
                authorizer={"iam": {"userArn": "arn:aws:iam::123456789012:user/alice"}},
            ),
            "User:arn:aws:iam::123456789012:user/alice",
        ),
        (
            with_context("create_topic", authorizer={"iam": {"userArn": ROLE_SESSION}}),
            "User:arn:aws:iam::123456789012:role/strata-operators",
        ),
        (
            with_context(
                "describe_topic",
                identity={"userArn": "arn:aws:iam::123456789012:user/bob", "sourceIp": "1.2.3.4"},
            ),
            "User:arn:aws:iam::123456789012:user/bob",
        ),
        (
            with_context(
                "describe_topic",
                identity={
                    "userArn": "arn:aws-us-gov:sts::123456789012:assumed-role/ops/s1",
                },
            ),
            "User:arn:aws-us-gov:iam::123456789012:role/ops",
        ),
        (with_context("create_topic", authorizer={"lambda": {"principal": "User:carol"}}), CAROL),
        (with_context("create_topic", authorizer={"lambda": {"principal": "carol"}}), CAROL),
        (with_context("describe_topic", authorizer={"principal": "carol"}), CAROL),
        (with_context("create_topic", authorizer={"lambda": {"principal": ""}}), "User:ANONYMOUS"),
        (with_context("create_topic", authorizer={"lambda": {"principal": 7}}), "User:ANONYMOUS"),
        (with_context("describe_topic", identity={"userArn": None}), "User:ANONYMOUS"),
        (load_event("create_topic"), "User:ANONYMOUS"),
        (load_event("describe_topic"), "User:ANONYMOUS"),
    ],
    ids=[
        "iam-user-2.0",
        "assumed-role-2.0",
        "iam-user-1.0",
        "assumed-role-govcloud-1.0",
        "lambda-authorizer-2.0",
        "lambda-authorizer-bare-name",
        "lambda-authorizer-1.0",
        "lambda-authorizer-empty",
        "lambda-authorizer-not-a-string",
        "no-iam-user-1.0",
        "none-2.0",
        "none-1.0",
    ],
)
def test_principal_of_the_event(event_: dict[str, Any], principal: str) -> None:
    assert principal_of(event_) == principal
    assert Request.from_event(event_).principal == principal


def test_an_assumed_role_arn_with_a_path_like_session_is_not_mistaken() -> None:
    assert iam_principal("arn:aws:iam::123456789012:role/ops") == (
        "User:arn:aws:iam::123456789012:role/ops"
    )
    # not an STS session ARN: kept as it is
    assert iam_principal("arn:aws:sts::123456789012:federated-user/bob") == (
        "User:arn:aws:sts::123456789012:federated-user/bob"
    )


# ---------------------------------------------------------------- Basic auth


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer abc",
        "Basic",
        "Basic !!!not-base64!!!",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b":no-user").decode(),
        "Basic " + base64.b64encode(b"\xff\xfe:x").decode(),
    ],
)
def test_malformed_or_missing_basic_credentials_are_refused(header: str | None) -> None:
    with pytest.raises(errors.AuthenticationFailedError):
        parse_basic(header)


def test_basic_auth_derives_once_per_right_password_and_every_time_for_a_wrong_one() -> None:
    creds = {"carol": {"SCRAM-SHA-512": ScramCredential.make("SCRAM-SHA-512", "pw:1 é", 4096)}}
    auth = BasicAuthenticator(creds.get)
    assert auth.authenticate(basic("carol", "pw:1 é")) == CAROL
    assert auth.authenticate(basic("carol", "pw:1 é")) == CAROL
    assert auth.derivations == 1, "a known password is not derived again"
    for _ in range(3):
        with pytest.raises(errors.AuthenticationFailedError):
            auth.authenticate(basic("carol", "wrong"))
    with pytest.raises(errors.AuthenticationFailedError):
        auth.authenticate(basic("mallory", "pw:1 é"))
    assert auth.derivations == 5, "failures are not cached (they cannot push successes out)"
    # a changed password: the old one is refused although it was cached
    creds["carol"] = {"SCRAM-SHA-512": ScramCredential.make("SCRAM-SHA-512", "new", 4096)}
    with pytest.raises(errors.AuthenticationFailedError):
        auth.authenticate(basic("carol", "pw:1 é"))
    assert auth.authenticate(basic("carol", "new")) == CAROL


def test_basic_auth_bounds_concurrent_derivations() -> None:
    """With every derivation slot held, an uncached login waits at most the bound and is
    told to try again; a cached one goes through."""
    creds = {"carol": {"SCRAM-SHA-256": ScramCredential.make("SCRAM-SHA-256", "pw", 4096)}}
    auth = BasicAuthenticator(creds.get, max_derivations=1, derivation_wait_s=0.2)
    assert auth.authenticate(basic("carol", "pw")) == CAROL
    auth._slots.acquire()
    try:
        with pytest.raises(errors.NetworkError) as refused:
            auth.authenticate(basic("carol", "other"))
        assert refused.value.retriable
        assert auth.authenticate(basic("carol", "pw")) == CAROL
    finally:
        auth._slots.release()


# ---------------------------------------------------------------- the real local runtime


@dataclass
class Runtime:
    url: str
    processes: ProcessGroup
    log_path: Path
    passwords: dict[str, str] = field(default_factory=dict)


@pytest.fixture
def secured_runtime(
    zk_chroot: ZooKeeperChroot, zk_client: KazooClient, tmp_path: Path
) -> Iterator[Runtime]:
    passwords = {"root": uuid.uuid4().hex, "carol": "carol's pässword"}
    for user, password in passwords.items():
        cred = ScramCredential.make("SCRAM-SHA-512", password, 4096)
        zk_client.create(f"{USERS}/{user}", encode_user({"SCRAM-SHA-512": cred}), makepath=True)
    register_agents(zk_client, [1, 2, 3])
    group = ProcessGroup(tmp_path)
    try:
        proc = group.start(
            command(zk_chroot.connect_string, extra=("--authenticate",)),
            name="local-runtime",
            cwd=ROOT,
            env={
                access.AUTHORIZER_ENV: "1",
                access.SUPER_USERS_ENV: SUPER,
                access.CACHE_ENV: "0",
            },
        )
        url = wait_for_listening(proc.popen, proc.log_path)
        yield Runtime(url, group, proc.log_path, passwords)
    finally:
        group.close()


def test_the_local_runtime_authenticates_and_authorizes_over_http(
    secured_runtime: Runtime, zk_client: KazooClient
) -> None:
    rt = secured_runtime
    root = {"authorization": basic("root", rt.passwords["root"])}
    carol = {"authorization": basic("carol", rt.passwords["carol"])}
    body = json.dumps({"name": TOPIC, "partitions": 1}).encode()
    assert http(rt.url, "POST", "/topics", body, root)[0] == 201

    for headers, why in [
        ({}, "no credentials"),
        ({"authorization": "Bearer x"}, "another scheme"),
        ({"authorization": "Basic %%%"}, "not base64"),
        ({"authorization": basic("carol", "wrong")}, "a wrong password"),
        ({"authorization": basic("nobody", rt.passwords["carol"])}, "an unknown user"),
    ]:
        status, got_headers, answer = http(rt.url, "DELETE", f"/topics/{TOPIC}", None, headers)
        assert status == 401, why
        assert answer["error"]["type"] == "AuthenticationFailedError", why
        assert got_headers["www-authenticate"].startswith("Basic"), why

    status, _, answer = http(rt.url, "DELETE", f"/topics/{TOPIC}", None, carol)
    assert (status, answer["error"]["type"]) == (403, "TopicAuthorizationFailedError")
    assert http(rt.url, "GET", f"/topics/{TOPIC}", None, root)[2]["deletion"] is None

    may_delete = AclBinding(
        principal=CAROL,
        resource_type=ResourceType.TOPIC,
        name="orders-",
        operation=Operation.DELETE,
        pattern_type=PatternType.PREFIXED,
    )
    zk_client.create(ACLS, encode_acls([may_delete]), makepath=True)
    # through the SDK, which sends the credentials of its config as Basic
    as_carol = {"sasl.username": "carol", "sasl.password": rt.passwords["carol"]}
    with SyncAdmin(rt.url, timeout=10, config=as_carol) as sdk:
        assert sdk.list_topics() == [TOPIC], "Delete implies Describe"
        assert sdk.delete_topic(TOPIC).deletion is not None
        with pytest.raises(errors.ClusterAuthorizationFailedError):
            sdk.list_acls()
    with (
        SyncAdmin(
            rt.url, timeout=10, config={"sasl.username": "carol", "sasl.password": "x"}
        ) as sdk,
        pytest.raises(errors.AuthenticationFailedError),
    ):
        sdk.list_topics()

    log_text = rt.log_path.read_text()
    assert "User:carol" in log_text and "refused" in log_text
    assert rt.passwords["carol"] not in log_text and rt.passwords["root"] not in log_text


def test_the_sdk_sends_basic_credentials_only_where_they_are_safe() -> None:
    with pytest.raises(errors.InvalidConfigError):
        SyncAdmin(
            "http://admin.example.com:8080", config={"sasl.username": "a", "sasl.password": "b"}
        )
    with pytest.raises(errors.InvalidConfigError):
        AdminConfig.parse({"sasl.username": "a"})
    with pytest.raises(errors.InvalidConfigError):
        AdminConfig.parse({"sasl.username": "a:b", "sasl.password": "c"})
    with pytest.raises(errors.InvalidConfigError):
        AdminConfig.parse({"bootstrap.servers": "x:1"})
    settings = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "admin",
        "sasl.password": "s3cret",
    }
    config = AdminConfig.parse(settings)
    assert config.basic_auth() == basic("admin", "s3cret")
    assert "s3cret" not in repr(config)
    SyncAdmin("https://admin.example.com", config=settings)  # https: fine
    SyncAdmin("http://[::1]:8080", config=settings)  # loopback: fine
