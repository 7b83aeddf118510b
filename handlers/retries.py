"""The admin API's retry and dead-letter endpoints (routes added to ``handlers.admin.ROUTER``).

    PUT    /groups/{group}/retry/{topic}   RetryPolicy JSON -> 200 {"policy", "created": [names]}
    GET    /groups/{group}/retry/{topic}   -> 200 the policy (404 if the group has none for it)
    GET    /groups/{group}/retry           -> 200 {"policies": {topic: policy}}
    DELETE /groups/{group}/retry/{topic}   -> 204
    GET    /retry/status                   -> 200 {"routers": {name: counters}}
    GET    /dlq/{topic}/count              -> 200 {"topic", "count", "partitions": {p: n}}
    GET    /dlq/{topic}/peek?limit=N       -> 200 {"records": [...]} (the oldest N, per partition)
    POST   /dlq/{topic}/redrive            {"to", "rate", "filter"?, "dry_run"?} -> 200 the task
    GET    /dlq/redrives                   -> 200 {"tasks": [...]}
    GET    /dlq/redrives/{id}              -> 200 the task: state, total, scanned, moved, skipped
    POST   /dlq/redrives/{id}/run          -> 200 the task, after running it for this invocation
    DELETE /dlq/redrives/{id}              -> 200 the task, cancelled

A redrive (``handlers.redrive``) is a task in ZooKeeper; ``POST .../run`` moves records for as
long as the invocation allows and is called again until the task is ``done``: ``strata dlq
redrive`` does that with a progress bar.

Setting a policy checks it (``storage.retry_policy``: a negative backoff, ``max_attempts`` 0
and a dead-letter topic equal to the source are refused with ``InvalidRetryPolicyError``, 400)
and creates what it needs and is missing: the failures topic the router reads, the group's
retry topic and the dead-letter topic (as many partitions as the source topic).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from handlers import redrive
from handlers.http import (
    AnyOf,
    Listing,
    Request,
    Response,
    Route,
    Source,
    body_field,
    computed,
    needs,
    on_cluster,
    on_group,
    on_topic,
    parse_body,
    path_param,
)
from handlers.runtime import Invocation
from sdk import Consumer, TopicPartition
from sdk import retry as r
from sdk.config import client_config
from storage.errors import (
    InvalidReplicationFactorError,
    InvalidRequestError,
    NodeNotFoundError,
    TopicAlreadyExistsError,
)
from storage.metadata import MetadataStore, TopicConfig, TopicSpec
from storage.metadata.acls import Operation, ResourceType
from storage.metadata.groups import validate_group_id
from storage.metadata.retry import RetryStore
from storage.names import validate_topic_name
from storage.retry_policy import RetryPolicy

PEEK_MAX = 1000


async def bootstrap_of(store: MetadataStore) -> str:
    agents = await store.list_agents()
    if not agents:
        raise InvalidRequestError("no live agents")
    return ",".join(f"{a.host}:{a.port}" for a in agents.values())


FAILURES_CONFIG = {"fsync.policy": "interval"}
"""Like the delay levels, the failures topic relies on replication rather than an fsync per
write: every failed record passes through it once per attempt."""


async def ensure_topic(
    store: MetadataStore, name: str, partitions: int, configs: dict[str, Any] | None = None
) -> bool:
    """Create ``name`` if it does not exist (replication min(3, live agents)); True if made."""
    live = len(await store.list_agents())
    if live == 0:
        raise InvalidReplicationFactorError("no live agents to place the topic on")
    spec = TopicSpec.build(
        name=name,
        partitions=partitions,
        replication_factor=min(3, live),
        config=TopicConfig.model_validate(configs or {}),
        topic_id=uuid.uuid4().hex,
        created_ms=int(time.time() * 1000),
    )
    try:
        await store.create_topic(spec)
    except TopicAlreadyExistsError:
        return False
    return True


class RetryAdmin:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.retry = RetryStore(store.zk)

    async def set_policy(self, group: str, topic: str, body: Any) -> dict[str, Any]:
        policy = RetryPolicy.parse(body, topic=topic)
        spec, _ = await self.store.get_topic(topic)
        created = []
        wanted = [
            (r.FAILURES_TOPIC, r.FAILURES_PARTITIONS, FAILURES_CONFIG),
            (r.retry_topic(group), spec.partitions, None),
            (policy.dlq_for(topic), spec.partitions, None),
        ]
        for name, partitions, configs in wanted:
            if await ensure_topic(self.store, name, partitions, configs):
                created.append(name)
        await self.retry.set_policy(group, topic, policy)
        return {"policy": policy.to_json(), "created": created}

    async def get_policy(self, group: str, topic: str) -> dict[str, Any]:
        policy = await self.retry.get_policy(group, topic)
        if policy is None:
            raise NodeNotFoundError(f"group {group!r} has no retry policy for {topic!r}")
        return policy.to_json()

    async def list_policies(self, group: str) -> dict[str, Any]:
        found = await self.retry.list_policies(group)
        return {"policies": {t: p.to_json() for t, p in found.items()}}

    async def delete_policy(self, group: str, topic: str) -> None:
        if not await self.retry.delete_policy(group, topic):
            raise NodeNotFoundError(f"group {group!r} has no retry policy for {topic!r}")

    async def status(self) -> dict[str, Any]:
        return {"routers": await self.retry.read_stats()}

    async def _consumer(self) -> Consumer:
        consumer = Consumer(
            client_config(await bootstrap_of(self.store), {"enable.auto.commit": False})
        )
        await consumer.start()
        return consumer

    async def dlq_count(self, topic: str) -> dict[str, Any]:
        spec, _ = await self.store.get_topic(topic)
        tps = [TopicPartition(topic, p) for p in range(spec.partitions)]
        consumer = await self._consumer()
        try:
            starts = await consumer.beginning_offsets(tps)
            ends = await consumer.end_offsets(tps)
        finally:
            await consumer.close()
        per = {str(tp.partition): max(0, ends[tp] - starts[tp]) for tp in tps}
        return {"topic": topic, "count": sum(per.values()), "partitions": per}

    async def dlq_peek(self, topic: str, limit: int) -> dict[str, Any]:
        spec, _ = await self.store.get_topic(topic)
        tps = [TopicPartition(topic, p) for p in range(spec.partitions)]
        consumer = await self._consumer()
        out: list[dict[str, Any]] = []
        try:
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            consumer.seek_to_beginning(*tps)
            for tp in tps:
                position = await consumer.position(tp)
                while position < ends[tp] and len(out) < limit:
                    got = await consumer.getmany(tp, timeout_ms=2000, max_records=limit - len(out))
                    recs = got.get(tp, [])
                    if not recs:
                        break
                    out += [describe(x) for x in recs]
                    position = recs[-1].offset + 1
        finally:
            await consumer.close()
        return {"topic": topic, "records": out[:limit]}


def describe(rec: Any) -> dict[str, Any]:
    """A DLQ record as JSON: where it is, where it came from, why it failed."""
    info = r.retry_info(rec._replace(topic=r.FAILURES_TOPIC))
    return {
        "partition": rec.partition,
        "offset": rec.offset,
        "timestamp": rec.timestamp,
        "key": None if rec.key is None else base64.b64encode(rec.key).decode(),
        "value": None if rec.value is None else base64.b64encode(rec.value).decode(),
        "group": (r.header(rec.headers, r.H_GROUP) or b"").decode(),
        "original": {"topic": info.topic, "partition": info.partition, "offset": info.offset},
        "attempts": info.attempt - 1,
        "first_failure_ms": info.first_failure_ms,
        "last_error": info.last_error,
        "headers": {k: bytes(v).decode(errors="replace") for k, v in rec.headers},
    }


def _names(group: str, topic: str | None = None) -> None:
    validate_group_id(group)
    if topic is not None:
        validate_topic_name(topic)


def _set(request: Request, invocation: Invocation, group: str, topic: str) -> Response:
    _names(group, topic)
    body = request.json()
    RetryPolicy.parse(body, topic=topic)  # a bad policy is a 400 before ZooKeeper
    return Response(
        200, invocation.run(lambda store: RetryAdmin(store).set_policy(group, topic, body))
    )


def _get(request: Request, invocation: Invocation, group: str, topic: str) -> Response:
    _names(group, topic)
    return Response(200, invocation.run(lambda store: RetryAdmin(store).get_policy(group, topic)))


def _list(request: Request, invocation: Invocation, group: str) -> Response:
    _names(group)
    return Response(200, invocation.run(lambda store: RetryAdmin(store).list_policies(group)))


def _delete(request: Request, invocation: Invocation, group: str, topic: str) -> Response:
    _names(group, topic)
    invocation.run(lambda store: RetryAdmin(store).delete_policy(group, topic))
    return Response(204)


def _status(request: Request, invocation: Invocation) -> Response:
    return Response(200, invocation.run(lambda store: RetryAdmin(store).status()))


def _count(request: Request, invocation: Invocation, topic: str) -> Response:
    validate_topic_name(topic)
    return Response(200, invocation.run(lambda store: RetryAdmin(store).dlq_count(topic)))


def _peek(request: Request, invocation: Invocation, topic: str) -> Response:
    validate_topic_name(topic)
    text = request.query.get("limit", "10")
    if not text.isdigit() or not 1 <= int(text) <= PEEK_MAX:
        raise InvalidRequestError(f"limit must be 1..{PEEK_MAX}, got {text!r}")
    limit = int(text)
    return Response(200, invocation.run(lambda store: RetryAdmin(store).dlq_peek(topic, limit)))


class RedriveBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    to: StrictStr
    rate: StrictInt = Field(100, ge=1, le=redrive.MAX_RATE)
    filter: StrictStr | None = None
    dry_run: StrictBool = False


def _redrive(request: Request, invocation: Invocation, topic: str) -> Response:
    validate_topic_name(topic)
    body = parse_body(RedriveBody, request.json())
    redrive.parse_filter(body.filter)
    doc = invocation.run(
        lambda store: redrive.new_task(store, topic, body.to, body.rate, body.filter, body.dry_run)
    )
    return Response(200, redrive.describe(doc))


def _task_id(task_id: str) -> str:
    if not task_id.isalnum() or len(task_id) > 64:
        raise InvalidRequestError(f"bad redrive id {task_id!r}")
    return task_id


def _tasks(request: Request, invocation: Invocation) -> Response:
    found = invocation.run(lambda store: RetryStore(store.zk).list_tasks())
    return Response(200, {"tasks": [redrive.describe(d) for d in found.values()]})


def _task(request: Request, invocation: Invocation, task_id: str) -> Response:
    _task_id(task_id)
    doc, _ = invocation.run(lambda store: RetryStore(store.zk).read_task(task_id))
    return Response(200, redrive.describe(doc))


def _run_task(request: Request, invocation: Invocation, task_id: str) -> Response:
    _task_id(task_id)
    doc = invocation.run(lambda store: redrive.WORKER.run(store, task_id, invocation.budget()))
    return Response(200, redrive.describe(doc))


def _cancel_task(request: Request, invocation: Invocation, task_id: str) -> Response:
    _task_id(task_id)
    doc = invocation.run(lambda store: redrive.cancel_task(store, task_id))
    return Response(200, redrive.describe(doc))


def _task_topic(end: str) -> Source:
    """The ``source`` or ``target`` topic of the redrive task ``{task_id}`` names."""

    async def resolve(request: Request, params: Mapping[str, str], store: Any) -> str:
        doc, _ = await RetryStore(store.zk).read_task(_task_id(params["task_id"]))
        return str(doc[end])

    return Source(f"the task's {end} topic", resolve)


def _dead_letter_topic(request: Request, params: Mapping[str, str]) -> str:
    _names(params["group"], params["topic"])
    return RetryPolicy.parse(request.json(), topic=params["topic"]).dlq_for(params["topic"])


GROUP = path_param("group")
TOPIC = path_param("topic")
SOURCE, TARGET = _task_topic("source"), _task_topic("target")
REDRIVE = needs(on_topic(Operation.READ, SOURCE), on_topic(Operation.WRITE, TARGET))
ROUTES = [
    Route(
        "POST",
        "/dlq/{topic}/redrive",
        _redrive,
        needs(on_topic(Operation.READ, TOPIC), on_topic(Operation.WRITE, body_field("to"))),
    ),
    Route(
        "GET",
        "/dlq/redrives",
        _tasks,
        needs(shows=(Listing("tasks", ResourceType.TOPIC, "source"),)),
    ),
    Route("GET", "/dlq/redrives/{task_id}", _task, needs(on_topic(Operation.DESCRIBE, SOURCE))),
    Route("POST", "/dlq/redrives/{task_id}/run", _run_task, REDRIVE),
    Route("DELETE", "/dlq/redrives/{task_id}", _cancel_task, REDRIVE),
    Route("GET", "/groups/{group}/retry", _list, needs(on_group(Operation.DESCRIBE, GROUP))),
    Route(
        "PUT",
        "/groups/{group}/retry/{topic}",
        _set,
        needs(
            on_group(Operation.ALTER, GROUP),
            AnyOf(
                (
                    on_topic(
                        Operation.CREATE,
                        computed("the policy's dead-letter topic", _dead_letter_topic),
                    ),
                    on_cluster(Operation.CREATE),
                )
            ),
        ),
    ),
    Route("GET", "/groups/{group}/retry/{topic}", _get, needs(on_group(Operation.DESCRIBE, GROUP))),
    Route(
        "DELETE", "/groups/{group}/retry/{topic}", _delete, needs(on_group(Operation.ALTER, GROUP))
    ),
    Route("GET", "/retry/status", _status, needs(on_cluster(Operation.DESCRIBE))),
    Route("GET", "/dlq/{topic}/count", _count, needs(on_topic(Operation.READ, TOPIC))),
    Route("GET", "/dlq/{topic}/peek", _peek, needs(on_topic(Operation.READ, TOPIC))),
]
"""What each route's caller needs (``handlers.access``). A policy is the group's (Alter on it)
and may create its dead-letter topic (Create on that topic, or on the cluster); a redrive
reads its source and writes its target, whether it is made, run or cancelled; a task is
described to whoever may describe its source."""
