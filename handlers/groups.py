"""The admin API's consumer-group endpoints (routes added to ``handlers.admin.ROUTER``).

    GET    /groups                    -> 200 {"groups": [{"group_id", "phase", "members"}]}
    GET    /groups/{group}            -> 200 description: phase, generation, protocol, leader,
                                          members with their assignment, and per partition the
                                          committed offset, log end offset, lag in messages and
                                          lag in seconds (now - timestamp of the first
                                          unconsumed record; 0 when caught up)
    POST   /groups/{group}/offsets    {"topic", "to": "earliest" | "latest" |
                                        {"timestamp": ms} | {"offset": n}, "partitions"?}
                                      -> 200 {"offsets": {"<partition>": offset}}
    DELETE /groups/{group}            -> 204

Membership and offsets are read from ZooKeeper (``storage.metadata.groups``): a describe
shows offsets only of topics that exist, are not being deleted, and whose offsets belong to
the topic's current incarnation (its id); a reset of a topic being deleted is refused, and a
reset writes the offsets for the current incarnation only. Log end offsets
and record timestamps come from the partition leaders through the SDK consumer (bootstrapped
from the live agents' registrations). Resets and deletes are for inactive groups only: a
group with members answers ``NON_EMPTY_GROUP`` (409), since its coordinator would otherwise
race the admin. A reset writes with the znode versions it read (compare-and-set), so a
concurrent commit makes it fail rather than be lost.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from handlers.http import (
    Listing,
    Request,
    Response,
    Route,
    body_field,
    needs,
    on_group,
    on_topic,
    parse_body,
    path_param,
)
from handlers.runtime import Invocation
from sdk import Consumer, TopicPartition
from sdk.config import client_config
from storage.errors import (
    GroupIdNotFoundError,
    InvalidRequestError,
    NonEmptyGroupError,
    UnknownTopicOrPartitionError,
)
from storage.metadata import MetadataStore
from storage.metadata.acls import Operation, ResourceType
from storage.metadata.groups import (
    CommittedOffset,
    GroupStore,
    TopicCommits,
    unb64,
    validate_group_id,
)
from storage.protocol.consumer import ConsumerAssignment

LAG_PROBE_S = 2.0


async def _consumer(store: MetadataStore) -> Consumer:
    agents = await store.list_agents()
    if not agents:
        raise InvalidRequestError("no live agents: log end offsets are unknown")
    servers = ",".join(f"{a.host}:{a.port}" for a in agents.values())
    consumer = Consumer(client_config(servers, {"request.timeout.ms": 5000}))
    await consumer.start()
    return consumer


class GroupAdmin:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.groups = GroupStore(store.zk)

    async def list_groups(self) -> list[dict[str, Any]]:
        out = []
        for name in await self.groups.list_groups():
            record, _ = await self.groups.get_state(name)
            out.append(
                {
                    "group_id": name,
                    "phase": record.phase if record else "empty",
                    "members": len(record.members) if record else 0,
                }
            )
        return out

    async def _state(self, group: str) -> Any:
        validate_group_id(group)
        if not await self.groups.exists(group):
            raise GroupIdNotFoundError(f"no group {group!r}")
        record, version = await self.groups.get_state(group)
        return record, version

    async def describe(self, group: str) -> dict[str, Any]:
        record, _ = await self._state(group)
        offsets = await self.groups.live_offsets(group)
        members = []
        for mr in record.members if record else []:
            parts: list[list[Any]] = []
            if mr.assignment:
                a = ConsumerAssignment.decode(unb64(mr.assignment))
                parts = [[tp.topic, p] for tp in a.partitions for p in tp.partitions]
            members.append(
                {
                    "member_id": mr.member_id,
                    "group_instance_id": mr.group_instance_id,
                    "assignment": parts,
                }
            )
        partitions = await self._lag(offsets)
        return {
            "group_id": group,
            "phase": record.phase if record else "empty",
            "generation": record.generation if record else 0,
            "protocol": record.protocol if record else None,
            "leader": record.leader if record else None,
            "members": members,
            "offsets": partitions,
        }

    async def _lag(self, offsets: dict[str, dict[int, CommittedOffset]]) -> list[dict[str, Any]]:
        tps = {TopicPartition(t, p): c for t, ps in offsets.items() for p, c in ps.items()}
        if not tps:
            return []
        consumer = await _consumer(self.store)
        try:
            ends = await consumer.end_offsets(list(tps))
            behind = {tp: c.offset for tp, c in tps.items() if ends.get(tp, -1) > c.offset}
            first_ts: dict[TopicPartition, int] = {}
            if behind:
                consumer.assign(list(behind))
                for tp, offset in behind.items():
                    consumer.seek(tp, offset)
                deadline = time.monotonic() + LAG_PROBE_S
                while len(first_ts) < len(behind) and time.monotonic() < deadline:
                    got = await consumer.getmany(timeout_ms=200)
                    for tp, records in got.items():
                        first_ts.setdefault(tp, records[0].timestamp)
        finally:
            await consumer.close()
        now_ms = int(time.time() * 1000)
        out = []
        for tp, c in sorted(tps.items()):
            end = ends.get(tp, -1)
            ts = first_ts.get(tp)
            out.append(
                {
                    "topic": tp.topic,
                    "partition": tp.partition,
                    "committed": c.offset,
                    "metadata": c.metadata,
                    "log_end_offset": end,
                    "lag": max(end - c.offset, 0) if end >= 0 else None,
                    "lag_seconds": 0.0
                    if end >= 0 and end <= c.offset
                    else (round(max(now_ms - ts, 0) / 1000, 3) if ts is not None else None),
                }
            )
        return out

    async def reset_offsets(
        self, group: str, topic: str, to: Any, partitions: list[int] | None
    ) -> dict[int, int]:
        record, state_version = await self._state(group)
        if record is not None and record.members:
            raise NonEmptyGroupError(
                f"group {group!r} has {len(record.members)} members: stop them before a reset"
            )
        spec, _ = await self.store.get_topic(topic)
        if spec.deletion is not None:
            raise UnknownTopicOrPartitionError(f"topic {topic!r} is being deleted")
        tps = [TopicPartition(topic, p) for p in (partitions or range(spec.partitions))]
        if isinstance(to, dict) and "offset" in to:
            targets = {tp: int(to["offset"]) for tp in tps}
        else:
            consumer = await _consumer(self.store)
            try:
                if to == "earliest":
                    found = await consumer.beginning_offsets(tps)
                elif to == "latest":
                    found = await consumer.end_offsets(tps)
                else:
                    ts = await consumer.offsets_for_times({tp: int(to["timestamp"]) for tp in tps})
                    ends = await consumer.end_offsets(tps)
                    found = {tp: (ends[tp] if v is None else v.offset) for tp, v in ts.items()}
            finally:
                await consumer.close()
            targets = dict(found)
        stored, version = await self.groups.get_offsets(group, topic)
        current = dict(stored.offsets) if stored.belongs_to(spec.topic_id) else {}
        now_ms = int(time.time() * 1000)
        for tp, offset in targets.items():
            current[tp.partition] = CommittedOffset(offset, "reset by admin", now_ms)
        await self.groups.write_offsets(
            group,
            {topic: (TopicCommits(spec.topic_id, current), version)},
            state_version=state_version,
        )
        return {tp.partition: o for tp, o in targets.items()}

    async def delete(self, group: str) -> None:
        record, _ = await self._state(group)
        if record is not None and record.members:
            raise NonEmptyGroupError(f"group {group!r} has {len(record.members)} members")
        await self.groups.delete_group(group)


class ResetBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: StrictStr
    to: StrictStr | dict[str, StrictInt]
    partitions: list[StrictInt] | None = None


def _check_target(to: Any) -> None:
    if isinstance(to, str) and to in ("earliest", "latest"):
        return
    if isinstance(to, dict) and len(to) == 1:
        ((key, value),) = to.items()
        if key in ("timestamp", "offset") and value >= 0:
            return
    raise InvalidRequestError(
        f"'to' must be 'earliest', 'latest', {{'timestamp': ms}} or {{'offset': n}}, got {to!r}"
    )


def _list_groups(request: Request, invocation: Invocation) -> Response:
    groups = invocation.run(lambda store: GroupAdmin(store).list_groups())
    return Response(200, {"groups": groups})


def _describe_group(request: Request, invocation: Invocation, group: str) -> Response:
    validate_group_id(group)
    return Response(200, invocation.run(lambda store: GroupAdmin(store).describe(group)))


def _reset_offsets(request: Request, invocation: Invocation, group: str) -> Response:
    validate_group_id(group)
    body = parse_body(ResetBody, request.json())
    _check_target(body.to)
    done = invocation.run(
        lambda store: GroupAdmin(store).reset_offsets(group, body.topic, body.to, body.partitions)
    )
    return Response(200, {"offsets": {str(p): o for p, o in sorted(done.items())}})


def _delete_group(request: Request, invocation: Invocation, group: str) -> Response:
    validate_group_id(group)
    invocation.run(lambda store: GroupAdmin(store).delete(group))
    return Response(204)


GROUP = path_param("group")
ROUTES = [
    Route(
        "GET",
        "/groups",
        _list_groups,
        needs(shows=(Listing("groups", ResourceType.GROUP, "group_id"),)),
    ),
    Route(
        "GET",
        "/groups/{group}",
        _describe_group,
        needs(
            on_group(Operation.DESCRIBE, GROUP),
            shows=(Listing("offsets", ResourceType.TOPIC, "topic"),),
        ),
    ),
    Route(
        "POST",
        "/groups/{group}/offsets",
        _reset_offsets,
        needs(on_group(Operation.READ, GROUP), on_topic(Operation.READ, body_field("topic"))),
    ),
    Route("DELETE", "/groups/{group}", _delete_group, needs(on_group(Operation.DELETE, GROUP))),
]
"""Each route says what its caller needs (``handlers.access``): as Kafka's OffsetCommit, a
reset needs Read on the group and on the topic; a describe shows only the offsets of topics
the caller may describe."""
