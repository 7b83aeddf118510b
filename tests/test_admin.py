"""The admin handler invoked directly, as Lambda does, against a real ZooKeeper.

Events come from ``tests/events/`` (API Gateway proxy events, payload 1.0 and 2.0). There are
no agents here, so no controller: agent registrations are written into ``/agents`` (all the
admin reads of them), and where a test needs partition states it writes them as the
controller would.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from handlers import runtime
from handlers.admin import handler, replication_factor_for, topic_config
from handlers.http import (
    InternalError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    Request,
    RouteNotFoundError,
    status_for,
)
from infra.local_runtime import LambdaContext
from infra.processes import free_port
from storage import errors
from storage.metadata.models import AgentRegistration, PartitionState, TopicSpec, dump
from tests.harness import ZooKeeperChroot

EVENTS = Path(__file__).parent / "events"


def load_event(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / f"{name}.json").read_text())
    return event


def context(timeout: float = 10.0) -> LambdaContext:
    return LambdaContext(
        function_name="strata-admin", aws_request_id=uuid.uuid4().hex, timeout=timeout
    )


def invoke(event: dict[str, Any], *, timeout: float = 10.0) -> tuple[int, Any, dict[str, str]]:
    response = handler(event, context(timeout))
    assert set(response) == {"statusCode", "headers", "body", "isBase64Encoded"}
    body = json.loads(response["body"]) if response["body"] else None
    return response["statusCode"], body, response["headers"]


def event(method: str, path: str, body: Any = None) -> dict[str, Any]:
    """A minimal HTTP API (2.0) event built from the captured one."""
    e = load_event("create_topic")
    e["rawPath"] = e["requestContext"]["http"]["path"] = path
    e["requestContext"]["http"]["method"] = method
    e["body"] = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    return e


def assert_error(
    got: tuple[int, Any, dict[str, str]], status: int, cls: type[errors.StrataError]
) -> str:
    code, body, headers = got
    assert code == status, body
    assert headers["content-type"] == "application/json"
    assert set(body) == {"error"}
    err = body["error"]
    assert err["type"] == cls.__name__
    assert err["code"] == cls.code
    assert err["retriable"] is cls.retriable
    message: str = err["message"]
    assert message
    return message


def register_agents(client: KazooClient, ids: list[int]) -> None:
    """``/agents/<id>`` registrations (ephemeral, as agents write them) with no agent behind."""
    client.ensure_path("/agents")
    for i in ids:
        reg = AgentRegistration(agent_id=i, host="127.0.0.1", port=9000 + i, started_ms=0)
        client.create(f"/agents/{i}", dump(reg), ephemeral=True)


@pytest.fixture
def admin_env(zk_chroot: ZooKeeperChroot, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The handlers' environment pointed at this test's chroot; their runtime closed after."""
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", zk_chroot.connect_string)
    runtime.close_shared_runtime()
    yield zk_chroot.connect_string
    runtime.close_shared_runtime()


@pytest.fixture
def agents(admin_env: str, zk_client: KazooClient) -> KazooClient:
    register_agents(zk_client, [1, 2, 3])
    return zk_client


# ---------------------------------------------------------------- captured events


def test_create_topic_event(agents: KazooClient) -> None:
    status, body, headers = invoke(load_event("create_topic"))

    assert status == 201, body
    assert headers["location"] == "/topics/orders"
    assert body["name"] == "orders"
    assert body["partitions"] == 3
    assert body["replication_factor"] == 3  # default: min(3, live agents)
    assert body["configs"]["retention.ms"] == 86_400_000
    assert body["configs"]["min.insync.replicas"] == 2
    assert body["configs"]["segment.bytes"] == 1 << 30  # every config shown, by dotted name
    assert len(body["topic_id"]) == 32
    # no controller here: the partitions have no state yet
    assert body["partition_states"] == [
        {
            "partition": p,
            "status": "pending",
            "leader": -1,
            "leader_epoch": -1,
            "replicas": [],
            "isr": [],
        }
        for p in range(3)
    ]
    data, _ = agents.get("/topics/orders")
    spec = TopicSpec.model_validate_json(data)
    assert (spec.partitions, spec.replication_factor) == (3, 3)
    assert spec.config.retention_ms == 86_400_000
    assert spec.topic_id == body["topic_id"]
    assert agents.exists("/topics/orders/partitions") is not None


def test_create_topic_bad_name_event(agents: KazooClient) -> None:
    message = assert_error(
        invoke(load_event("create_topic_bad_name")), 400, errors.InvalidTopicError
    )
    assert "orders/eu" in message
    assert agents.exists("/topics") is None  # rejected before ZooKeeper was touched


def test_list_topics_event_with_a_named_stage(agents: KazooClient) -> None:
    invoke(load_event("create_topic"))
    status, body, _ = invoke(load_event("list_topics"))  # rawPath /prod/topics, stage prod
    assert (status, body) == (200, {"topics": ["orders"], "deleting": []})


def test_describe_event_shows_partition_states_the_controller_wrote(agents: KazooClient) -> None:
    assert invoke(load_event("create_topic"))[0] == 201
    state = PartitionState(
        leader=2, leader_epoch=4, replicas=[2, 3, 1], isr=[2, 3], controller_epoch=7
    )
    agents.create("/topics/orders/partitions/0/state", dump(state), makepath=True)
    offline = PartitionState(leader=-1, leader_epoch=5, replicas=[3], isr=[3], controller_epoch=7)
    agents.create("/topics/orders/partitions/1/state", dump(offline), makepath=True)

    status, body, _ = invoke(load_event("describe_topic"))  # REST API payload 1.0

    assert status == 200, body
    assert body["name"] == "orders"
    assert body["partition_states"] == [
        {
            "partition": 0,
            "status": "online",
            "leader": 2,
            "leader_epoch": 4,
            "replicas": [2, 3, 1],
            "isr": [2, 3],
        },
        {
            "partition": 1,
            "status": "offline",
            "leader": -1,
            "leader_epoch": 5,
            "replicas": [3],
            "isr": [3],
        },
        {
            "partition": 2,
            "status": "pending",
            "leader": -1,
            "leader_epoch": -1,
            "replicas": [],
            "isr": [],
        },
    ]


def test_alter_configs_event_with_a_base64_body(agents: KazooClient) -> None:
    invoke(load_event("create_topic"))
    e = load_event("alter_configs")
    assert e["isBase64Encoded"] is True
    status, body, _ = invoke(e)
    assert status == 200, body
    assert body["configs"]["retention.ms"] == 3_600_000
    assert body["configs"]["min.insync.replicas"] == 2  # untouched
    spec = TopicSpec.model_validate_json(agents.get("/topics/orders")[0])
    assert spec.config.retention_ms == 3_600_000


def test_delete_event_marks_the_topic_and_holds_the_name_until_the_delete_completes(
    agents: KazooClient,
) -> None:
    """Step 1 of a delete is the admin's: the spec gets ``deletion`` and the answer says so.
    No controller runs here, so the delete stays at step 2: the name stays taken meanwhile."""
    _, created, _ = invoke(load_event("create_topic"))

    status, body, _ = invoke(load_event("delete_topic"))

    assert status == 202, body
    assert body["topic_id"] == created["topic_id"]
    assert body["deletion"]["step"] == "stop_serving"
    assert body["deletion"]["step_number"] == 2
    assert body["deletion"]["objects_left"] == -1
    spec = TopicSpec.model_validate_json(agents.get("/topics/orders")[0])
    assert spec.deletion is not None and spec.topic_id == created["topic_id"]
    # a second delete is the same delete; lists show the topic as being deleted only
    again = invoke(load_event("delete_topic"))
    assert again[0] == 202 and again[1]["deletion"]["requested_ms"] == spec.deletion.requested_ms
    assert invoke(load_event("list_topics"))[1] == {"topics": [], "deleting": ["orders"]}
    assert invoke(load_event("describe_topic"))[1]["deletion"]["step"] == "stop_serving"
    # the name is taken until the controller has finished: create and changes are refused
    message = assert_error(invoke(load_event("create_topic")), 409, TopicDeletionInProgress)
    assert "being deleted" in message and "step 2 of 7" in message
    assert_error(invoke(load_event("alter_configs")), 409, TopicDeletionInProgress)
    # once step 7 has removed the topic node, the name is free and a new id is given
    agents.delete("/topics/orders", recursive=True)
    assert_error(invoke(load_event("delete_topic")), 404, errors.UnknownTopicOrPartitionError)
    status, recreated, _ = invoke(load_event("create_topic"))
    assert status == 201 and recreated["topic_id"] != created["topic_id"]


TopicDeletionInProgress = errors.TopicDeletionInProgressError


# ---------------------------------------------------------------- the runtime


def test_one_loop_and_one_session_across_invocations(agents: KazooClient) -> None:
    invoke(load_event("list_topics"))
    first = runtime.shared_runtime()
    session = first.session_id
    assert session is not None
    for _ in range(5):
        assert invoke(load_event("list_topics"))[0] == 200
    assert runtime.shared_runtime() is first
    assert first.session_id == session
    loops = [t for t in threading.enumerate() if t.name == "strata-handlers"]
    assert len(loops) == 1


def test_invocations_from_many_threads_share_the_runtime(agents: KazooClient) -> None:
    invoke(load_event("create_topic"))
    results: list[int] = []

    def describe() -> None:
        results.append(invoke(load_event("describe_topic"))[0])

    threads = [threading.Thread(target=describe) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [200] * 16
    assert len([t for t in threading.enumerate() if t.name == "strata-handlers"]) == 1


def test_zookeeper_down_is_503_and_bad_input_is_still_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", f"127.0.0.1:{free_port()}/nothing-here")
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT_TIMEOUT_MS", "300")
    runtime.close_shared_runtime()
    try:
        got = invoke(event("GET", "/topics"))
        assert_error(got, 503, errors.MetadataUnavailableError)
        assert got[2]["retry-after"] == "1"
        # checked before ZooKeeper is needed
        assert_error(
            invoke(event("POST", "/topics", {"name": "..", "partitions": 1})),
            400,
            errors.InvalidTopicError,
        )
        assert_error(invoke(event("GET", "/topics/a%2Fb")), 400, errors.InvalidTopicError)
    finally:
        runtime.close_shared_runtime()


def test_missing_zookeeper_setting_is_a_500_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATA_ZOOKEEPER_CONNECT", raising=False)
    runtime.close_shared_runtime()
    message = assert_error(invoke(event("GET", "/topics")), 500, InternalError)
    assert "STRATA_ZOOKEEPER_CONNECT" in message
    assert_error(
        invoke(event("POST", "/topics", {"name": "", "partitions": 1})),
        400,
        errors.InvalidTopicError,
    )


def test_the_lambda_deadline_bounds_the_work(agents: KazooClient) -> None:
    got = invoke(event("GET", "/topics"), timeout=0.1)  # less than the answer margin
    assert_error(got, 504, errors.RequestTimedOutError)


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("name", "status", "cls"),
    [
        ("not json", 400, errors.InvalidRequestError),
        ("json array", 400, errors.InvalidRequestError),
        ("deep json", 400, errors.InvalidRequestError),
        ("no body", 400, errors.InvalidRequestError),
        ("bad base64", 400, errors.InvalidRequestError),
        ("no method", 400, errors.InvalidRequestError),
        ("not an event", 400, errors.InvalidRequestError),
        ("unknown path", 404, RouteNotFoundError),
        ("wrong method", 405, MethodNotAllowedError),
        ("unknown field", 400, errors.InvalidRequestError),
        ("partitions as text", 400, errors.InvalidPartitionsError),
        ("partitions 0", 400, errors.InvalidPartitionsError),
        ("configs not an object", 400, errors.InvalidConfigError),
    ],
)
def test_malformed_requests_get_typed_errors_never_500(
    monkeypatch: pytest.MonkeyPatch, name: str, status: int, cls: type[errors.StrataError]
) -> None:
    # none of these needs ZooKeeper: they fail before it is touched
    monkeypatch.setenv("STRATA_ZOOKEEPER_CONNECT", "127.0.0.1:1/unused")
    runtime.close_shared_runtime()
    e: Any
    match name:
        case "not json":
            e = event("POST", "/topics", "{name: orders")
        case "json array":
            e = event("POST", "/topics", "[1, 2]")
        case "deep json":
            e = event("POST", "/topics", "[" * 200_000 + "]" * 200_000)
        case "no body":
            e = event("POST", "/topics")
        case "bad base64":
            e = event("POST", "/topics", "!!!")
            e["isBase64Encoded"] = True
        case "no method":
            e = event("GET", "/topics")
            del e["requestContext"]["http"]["method"]
        case "not an event":
            e = ["GET", "/topics"]
        case "unknown path":
            e = event("GET", "/no-such-thing")
        case "wrong method":
            e = event("PUT", "/topics/orders")
        case "unknown field":
            e = event("POST", "/topics", {"name": "a", "partitions": 1, "colour": "red"})
        case "partitions as text":
            e = event("POST", "/topics", {"name": "a", "partitions": "3"})
        case "partitions 0":
            e = event("POST", "/topics", {"name": "a", "partitions": 0})
        case "configs not an object":
            e = event("POST", "/topics", {"name": "a", "partitions": 1, "configs": [1]})
    got = invoke(e)
    assert_error(got, status, cls)
    if cls is MethodNotAllowedError:
        assert got[2]["allow"] == "GET, DELETE"
    runtime.close_shared_runtime()


def test_event_body_base64_and_path_decoding() -> None:
    e = event("POST", "/topics/a%2Fb/partitions")
    e["body"] = base64.b64encode(b'{"count": 2}').decode()
    e["isBase64Encoded"] = True
    request = Request.from_event(e)
    assert request.segments == ("topics", "a/b", "partitions")
    assert request.json() == {"count": 2}
    v1 = load_event("describe_topic")
    assert Request.from_event(v1).segments == ("topics", "orders")
    assert Request.from_event(v1).headers["user-agent"] == "Python-urllib/3.11"


# ---------------------------------------------------------------- pure pieces


def test_every_error_class_has_a_status_and_bad_input_is_never_5xx() -> None:
    def subclasses(cls: type[errors.StrataError]) -> Iterator[type[errors.StrataError]]:
        yield cls
        for sub in cls.__subclasses__():
            yield from subclasses(sub)

    for cls in subclasses(errors.StrataError):
        exc = cls.__new__(cls)
        status = status_for(exc)
        if issubclass(cls, errors.InvalidRequestError):
            assert 400 <= status < 500, cls
        elif cls is errors.TopicDeletionInProgressError:
            assert status == 409, cls  # the name is taken, for now: retry later
        elif cls.retriable:
            assert status in (404, 503, 504), cls
    expected = {
        errors.InvalidTopicError: 400,
        errors.InvalidConfigError: 400,
        errors.InvalidPartitionsError: 400,
        errors.InvalidRequestError: 400,
        errors.TopicAlreadyExistsError: 409,
        errors.UnknownTopicOrPartitionError: 404,
        errors.MetadataUnavailableError: 503,
        errors.VersionConflictError: 503,
        errors.RequestTimedOutError: 504,
        PayloadTooLargeError: 413,
        InternalError: 500,
        errors.MetadataError: 500,
    }
    assert {cls: status_for(cls.__new__(cls)) for cls in expected} == expected


def test_topic_config_takes_dotted_names_only() -> None:
    assert topic_config({"retention.ms": "1000"}).retention_ms == 1000
    with pytest.raises(errors.InvalidConfigError, match="unknown topic config 'retention_ms'"):
        topic_config({"retention_ms": 1000})
    with pytest.raises(errors.InvalidConfigError, match=r"retention\.ms: .*greater than"):
        topic_config({"retention.ms": -5})
    assert topic_config({}).kafka_batch_storage == "as-sent"
    assert topic_config({"kafka.batch.storage": "columnar"}).kafka_batch_storage == "columnar"
    with pytest.raises(errors.InvalidConfigError, match=r"kafka\.batch\.storage"):
        topic_config({"kafka.batch.storage": "kafka"})
    base = topic_config({"retention.ms": 1000, "segment.bytes": 8192})
    restored = topic_config({"retention.ms": None}, base)
    assert restored.retention_ms == 14 * 24 * 3600 * 1000
    assert restored.segment_bytes == 8192


def test_replication_factor_rules() -> None:
    assert replication_factor_for(None, 1) == 1
    assert replication_factor_for(None, 5) == 3
    assert replication_factor_for(2, 2) == 2
    with pytest.raises(
        errors.InvalidReplicationFactorError, match="larger than the number of live agents"
    ):
        replication_factor_for(3, 2)
    with pytest.raises(errors.InvalidRequestError, match="no live agents"):
        replication_factor_for(None, 0)
    with pytest.raises(errors.InvalidRequestError, match="between 1 and 16"):
        replication_factor_for(0, 3)
