"""The admin API's delay endpoints (routes added to ``handlers.admin.ROUTER``).

    POST /delays/topics   {"partitions"?, "replication_factor"?}
                          -> 200 {"created": [names], "existing": [names]}
    POST /delays/cancel   {"schedule_id"} -> 200 {"schedule_id", "cancelled": bool, "reason"}
    GET  /delays/status   -> 200 {"levels": [{"topic", "delay_ms", "pending"}], "pending",
                                  "cancels", "schedulers": {name: stats}}

**Cancel** (``docs/delays.md`` has the argument). The cancel node is created first; ZooKeeper
orders it against every lane intent. A forward honours the cancels created before its intent,
so the record is delivered only by a forward whose intent came before the cancel node. The
handler then reads, in every level, the intent of the record's lane:

* if no lane's plan time reaches the record's due time (``now < due``), no forward
  so far could deliver it, and none later will: *cancelled in time*;
* otherwise a forward may have delivered it. The handler waits until each such lane's forwards
  from before the cancel are complete (the runner committed past the intent, or a newer intent
  exists), then looks for the
  schedule id on the target partition from the due time on: found, *too late*; not found,
  *cancelled in time*.

Waiting is bounded (``CANCEL_WAIT_S``): a lane whose scheduler is down answers 503 (try again).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from handlers.http import (
    Request,
    Response,
    Route,
    computed,
    needs,
    on_cluster,
    on_topic,
    parse_body,
)
from handlers.runtime import Invocation
from sdk import Consumer, TopicPartition
from sdk import delays as d
from sdk.config import client_config
from storage.errors import (
    InvalidDelayError,
    InvalidReplicationFactorError,
    InvalidRequestError,
    MetadataUnavailableError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)
from storage.metadata import MetadataStore, TopicConfig, TopicSpec
from storage.metadata.acls import Operation
from storage.metadata.delays import DelayStore
from storage.metadata.groups import GroupStore
from storage.metadata.models import DAY_MS

SCHEDULER_GROUP = "__strata_scheduler"
DEFAULT_LANES = 4
CANCEL_WAIT_S = 6.0
SCAN_LIMIT = 5_000_000
"""Most target records a cancel reads to find out whether its record was delivered."""


LEVEL_FSYNC = "interval"
"""Level topics are not fsynced per write: like Kafka, they rely on replication (acks=all to
min.insync.replicas) for durability and fsync in the background. Every record hops through
several levels, and a per-write fsync on each hop would be most of the lateness."""


def level_retention_ms(level: int) -> int:
    """A level keeps records twice its delay plus a week: long enough for a scheduler that
    was down for days to find them."""
    return 2 * d.level_delay_ms(level) + 7 * DAY_MS


async def _bootstrap(store: MetadataStore) -> str:
    agents = await store.list_agents()
    if not agents:
        raise InvalidRequestError("no live agents")
    return ",".join(f"{a.host}:{a.port}" for a in agents.values())


class DelayAdmin:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.delays = DelayStore(store.zk)
        self._lane_counts: dict[int, int | None] = {}

    async def ensure_topics(
        self,
        partitions: int = DEFAULT_LANES,
        replication_factor: int | None = None,
        configs: dict[str, Any] | None = None,
    ) -> dict[str, list[str]]:
        """Create the level topics that do not exist yet (all with ``partitions`` lanes; the
        replication factor defaults to min(3, live agents); ``configs`` are added to each)."""
        live = len(await self.store.list_agents())
        rf = replication_factor or min(3, live)
        if not 1 <= rf <= max(live, 1) or live == 0:
            raise InvalidReplicationFactorError(
                f"replication factor {rf} for the delay levels, with {live} live agent(s)"
            )
        created, existing = [], []
        for level in d.LEVELS:
            name = d.level_topic(level)
            spec = TopicSpec.build(
                name=name,
                partitions=partitions,
                replication_factor=rf,
                config=TopicConfig.model_validate(
                    {
                        "retention.ms": level_retention_ms(level),
                        "fsync.policy": LEVEL_FSYNC,
                        **(configs or {}),
                    }
                ),
                topic_id=uuid.uuid4().hex,
                created_ms=int(time.time() * 1000),
            )
            try:
                await self.store.create_topic(spec)
                created.append(name)
            except TopicAlreadyExistsError:
                existing.append(name)
        return {"created": created, "existing": existing}

    async def _lanes(self, level: int) -> int | None:
        if level not in self._lane_counts:
            try:
                spec, _ = await self.store.get_topic(d.level_topic(level))
            except UnknownTopicOrPartitionError:
                return None
            self._lane_counts[level] = spec.partitions
        return self._lane_counts[level]

    async def cancel(self, schedule_id: str) -> dict[str, Any]:
        sid = d.ScheduleId.parse(schedule_id)
        czxid = await self.delays.create_cancel(sid.encode(), sid.due_ms)
        deadline = time.monotonic() + CANCEL_WAIT_S
        groups = GroupStore(self.store.zk)

        async def may_have_delivered(level: int) -> bool:
            """Whether a forward of the record's lane in ``level`` from before the cancel may
            have delivered it; waits for such a forward to be complete."""
            lanes = await self._lanes(level)
            if not lanes:
                return False
            topic = d.level_topic(level)
            lane = sid.lane_in(lanes)
            while True:
                intent, _ = await self.delays.read_lane(topic, lane)
                if intent is None or intent.now < sid.due_ms:
                    return False  # no forward of this lane has reached the due time
                if intent.zxid > czxid:
                    return True  # the forwards from before the cancel are complete
                committed = (await groups.visible_offsets(SCHEDULER_GROUP, topic)).get(lane)
                if committed is not None and committed.offset >= intent.b:
                    return True  # so is this one
                if time.monotonic() > deadline:
                    raise MetadataUnavailableError(
                        f"a forward of {topic}[{lane}] from before the cancel is not complete "
                        "(is the scheduler running?); try again"
                    )
                await asyncio.sleep(0.05)

        maybe_delivered = any(await asyncio.gather(*map(may_have_delivered, d.LEVELS)))
        if maybe_delivered and await self._delivered(sid):
            return {"schedule_id": sid.encode(), "cancelled": False, "reason": "delivered"}
        return {"schedule_id": sid.encode(), "cancelled": True, "reason": "in time"}

    async def _delivered(self, sid: d.ScheduleId) -> bool:
        """Whether the target partition holds the record (read from its due time on)."""
        tp = TopicPartition(sid.topic, sid.partition)
        wanted = sid.encode().encode()
        consumer = Consumer(
            client_config(await _bootstrap(self.store), {"enable.auto.commit": False})
        )
        async with consumer:
            consumer.assign([tp])
            found = await consumer.offsets_for_times({tp: sid.due_ms})
            start = found.get(tp)
            if start is None:
                return False
            end = (await consumer.end_offsets([tp]))[tp]
            consumer.seek(tp, start.offset)
            if end - start.offset > SCAN_LIMIT:
                raise InvalidDelayError(
                    f"{end - start.offset} records to search on {sid.topic}[{sid.partition}]: "
                    "too many to tell whether the record was delivered"
                )
            position = start.offset
            while position < end:
                got = await consumer.getmany(tp, timeout_ms=2000, max_records=10_000)
                records = got.get(tp, [])
                if not records:
                    continue
                for r in records:
                    if r.offset >= end:
                        return False
                    for k, v in r.headers:
                        if k == d.HEADER_ID and v == wanted:
                            return True
                position = records[-1].offset + 1
        return False

    async def status(self) -> dict[str, Any]:
        groups = GroupStore(self.store.zk)
        levels = []
        total = 0
        consumer: Consumer | None = None
        try:
            for level in d.LEVELS:
                lanes = await self._lanes(level)
                if not lanes:
                    continue
                topic = d.level_topic(level)
                if consumer is None:
                    consumer = Consumer(client_config(await _bootstrap(self.store)))
                    await consumer.start()
                tps = [TopicPartition(topic, p) for p in range(lanes)]
                ends = await consumer.end_offsets(tps)
                starts = await consumer.beginning_offsets(tps)
                committed = await groups.visible_offsets(SCHEDULER_GROUP, topic)
                pending = 0
                for tp in tps:
                    c = committed.get(tp.partition)
                    done = max(starts[tp], c.offset if c else 0)
                    pending += max(0, ends[tp] - done)
                total += pending
                levels.append(
                    {"topic": topic, "delay_ms": d.level_delay_ms(level), "pending": pending}
                )
        finally:
            if consumer is not None:
                await consumer.close()
        return {
            "levels": levels,
            "pending": total,
            "cancels": await self.delays.count_cancels(),
            "schedulers": await self.delays.read_stats(),
        }


class EnsureTopicsBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    partitions: StrictInt = Field(DEFAULT_LANES, ge=1, le=1024)
    replication_factor: StrictInt | None = None


class CancelBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule_id: StrictStr


def _ensure_topics(request: Request, invocation: Invocation) -> Response:
    body = parse_body(EnsureTopicsBody, request.json() if request.body.strip() else {})
    result = invocation.run(
        lambda store: DelayAdmin(store).ensure_topics(body.partitions, body.replication_factor)
    )
    return Response(200, result)


def _cancel(request: Request, invocation: Invocation) -> Response:
    body = parse_body(CancelBody, request.json(), errors={"schedule_id": InvalidDelayError})
    d.ScheduleId.parse(body.schedule_id)  # a malformed id is a 400 before ZooKeeper
    return Response(200, invocation.run(lambda store: DelayAdmin(store).cancel(body.schedule_id)))


def _status(request: Request, invocation: Invocation) -> Response:
    return Response(200, invocation.run(lambda store: DelayAdmin(store).status()))


def _scheduled_topic(request: Request, params: object) -> str:
    schedule_id = request.json().get("schedule_id")
    if not isinstance(schedule_id, str):
        raise InvalidDelayError("schedule_id: a string is required")
    return d.ScheduleId.parse(schedule_id).topic


ROUTES = [
    Route("POST", "/delays/topics", _ensure_topics, needs(on_cluster(Operation.CREATE))),
    Route(
        "POST",
        "/delays/cancel",
        _cancel,
        needs(on_topic(Operation.WRITE, computed("the schedule id's topic", _scheduled_topic))),
    ),
    Route("GET", "/delays/status", _status, needs(on_cluster(Operation.DESCRIBE))),
]
"""The level topics are internal, so making them needs Create on the cluster; a cancel needs
Write on the topic the record was scheduled for (who could send it may take it back)."""
