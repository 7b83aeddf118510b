"""The admin API: create, list, describe and delete topics, add partitions, alter configs.

    POST   /topics                    {"name", "partitions", "replication_factor"?, "configs"?}
                                       -> 201 TopicDescription
    GET    /topics                    -> 200 {"topics": [names], "deleting": [names]}
    GET    /topics/{name}             -> 200 TopicDescription (with ``deletion`` while deleting)
    DELETE /topics/{name}             -> 202 TopicDescription with ``deletion``
    POST   /topics/{name}/partitions  {"count": N}       -> 200 TopicDescription
    PATCH  /topics/{name}/configs     {"configs": {...}} -> 200 TopicDescription
    /groups...                        consumer groups: see ``handlers.groups``
    /delays...                        delay levels, cancel, status: see ``handlers.delays``

The admin writes topic specs only (``/topics/<name>`` in ZooKeeper); the controller notices
and creates the partition states (leader, replicas, ISR). Until it has, a describe shows
those partitions as ``pending`` with leader -1 — as it does in a cluster with no agents.

Changes to an existing topic are compare-and-set on the topic znode's version: read the spec,
derive the new one, write it with the version read; if another admin got there first, read
again (``CAS_ATTEMPTS`` times, then ``VersionConflictError``, 503).

A delete only marks the topic (step 1 of ``docs/operations.md``, *Deleting a topic*): it
writes ``deletion`` into the spec (compare-and-set) and answers 202 with the description; the
controller does the rest. Until the delete completes the name is taken: creating it again is
refused with ``TopicDeletionInProgressError`` (409, retriable), and so are changes to it; a
second delete answers the status again. Lists show the topic under ``deleting`` only.

Every route carries the rule of what its caller needs (``TOPIC_ROUTES`` below, and the other
modules' route tables); with ``STRATA_ADMIN_AUTHORIZER=1`` the router's guard
(``handlers.access``) checks it against the ACLs before the endpoint runs.

Input is checked before ZooKeeper is touched wherever that is possible (a bad name, count or
config is a 400 even when ZooKeeper is down). Configs use Kafka's dotted names only
(``retention.ms``); ``null`` in an alter restores a config's default.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from handlers.access import GUARD
from handlers.cluster import CLUSTER_ROUTES
from handlers.delays import ROUTES as DELAY_ROUTES
from handlers.groups import ROUTES as GROUP_ROUTES
from handlers.http import (
    AnyOf,
    Listing,
    Request,
    Response,
    Route,
    Router,
    body_field,
    describe_errors,
    needs,
    on_cluster,
    on_topic,
    parse_body,
    path_param,
)
from handlers.retries import ROUTES as RETRY_ROUTES
from handlers.runtime import Invocation
from handlers.security import ROUTES as SECURITY_ROUTES
from sdk.admin import DeletionStatus, PartitionInfo, PartitionStatus, TopicDescription
from storage.errors import (
    InvalidConfigError,
    InvalidPartitionsError,
    InvalidTopicError,
    NodeNotFoundError,
    TopicAlreadyExistsError,
    TopicDeletionInProgressError,
    UnknownTopicOrPartitionError,
    VersionConflictError,
)
from storage.metadata import MetadataStore, PartitionState, TopicConfig, TopicSpec
from storage.metadata.acls import Operation, ResourceType
from storage.metadata.models import MAX_PARTITIONS, TopicDeletion, validate_topic_name
from storage.metadata.topic_rules import check_min_insync as check_min_insync
from storage.metadata.topic_rules import replication_factor_for as replication_factor_for

CAS_ATTEMPTS = 5
STATE_READS_IN_FLIGHT = 32
"""Topic specs read concurrently by a list."""
_jitter = random.Random()

_DEFAULTS: dict[str, Any] = {
    f.alias: f.default for f in TopicConfig.model_fields.values() if f.alias is not None
}
CONFIG_NAMES: frozenset[str] = frozenset(_DEFAULTS)


# ---------------------------------------------------------------- validation (no I/O)


def topic_config(configs: Mapping[str, Any], base: TopicConfig | None = None) -> TopicConfig:
    """``base`` (default: the defaults) with ``configs`` applied; ``None`` restores a default."""
    unknown = sorted(k for k in configs if k not in CONFIG_NAMES)
    if unknown:
        raise InvalidConfigError(
            f"unknown topic config {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(CONFIG_NAMES))}"
        )
    changes = {k: (_DEFAULTS[k] if v is None else v) for k, v in configs.items()}
    merged = changes if base is None else {**base.to_wire(), **changes}
    try:
        return TopicConfig.model_validate(merged)
    except ValidationError as exc:
        raise InvalidConfigError(describe_errors(exc)) from None


def describe(spec: TopicSpec, states: Mapping[int, PartitionState]) -> TopicDescription:
    infos = []
    for p in range(spec.partitions):
        state = states.get(p)
        if state is None:
            infos.append(PartitionInfo(partition=p, status=PartitionStatus.PENDING))
            continue
        infos.append(
            PartitionInfo(
                partition=p,
                status=PartitionStatus.ONLINE if state.leader >= 0 else PartitionStatus.OFFLINE,
                leader=state.leader,
                leader_epoch=state.leader_epoch,
                replicas=tuple(state.replicas),
                isr=tuple(state.isr),
            )
        )
    return TopicDescription(
        name=spec.name,
        topic_id=spec.topic_id,
        created_ms=spec.created_ms,
        partitions=spec.partitions,
        replication_factor=spec.replication_factor,
        configs=spec.config.to_wire(),
        partition_states=tuple(infos),
        deletion=None if spec.deletion is None else deletion_status(spec.deletion),
    )


def deletion_status(d: TopicDeletion) -> DeletionStatus:
    return DeletionStatus(
        step=d.step.value,
        step_number=d.step.number,
        requested_ms=d.requested_ms,
        updated_ms=d.updated_ms,
        objects_total=d.objects_total,
        objects_deleted=d.objects_deleted,
        objects_left=d.objects_left,
        waiting_for=tuple(d.waiting_for),
        last_error=d.last_error,
    )


def deleting_error(spec: TopicSpec) -> TopicDeletionInProgressError:
    assert spec.deletion is not None
    d = spec.deletion
    left = f", {d.objects_left} segment objects left" if d.objects_left > 0 else ""
    return TopicDeletionInProgressError(
        f"topic {spec.name!r} is being deleted (step {d.step.number} of 7: {d.step.value}"
        f"{left}); it can be created again once the delete completes"
    )


def respec(spec: TopicSpec, **changes: Any) -> TopicSpec:
    """A validated copy of ``spec`` with ``changes`` (``model_copy`` would not validate)."""
    return TopicSpec.build(**{**dict(spec), **changes})


# ---------------------------------------------------------------- operations on ZooKeeper


class TopicAdmin:
    """Topic administration over a :class:`MetadataStore` (typed values in and out)."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    async def create_topic(
        self, name: str, partitions: int, replication_factor: int | None, config: TopicConfig
    ) -> TopicDescription:
        live = len(await self.store.list_agents())
        rf = replication_factor_for(replication_factor, live)
        check_min_insync(config, rf)
        spec = TopicSpec.build(
            name=name,
            partitions=partitions,
            replication_factor=rf,
            config=config,
            topic_id=uuid.uuid4().hex,
            created_ms=int(time.time() * 1000),
        )
        for _ in range(CAS_ATTEMPTS):
            try:
                await self.store.create_topic(spec)
                return await self._describe(spec)
            except TopicAlreadyExistsError:
                try:
                    existing, _ = await self.store.get_topic(name)
                except UnknownTopicOrPartitionError:
                    continue  # the name's delete completed between the two: it is free now
                if existing.deletion is not None:
                    raise deleting_error(existing) from None
                raise
        raise TopicAlreadyExistsError(
            f"topic {name!r} appeared and vanished {CAS_ATTEMPTS} times in a row; try again"
        )

    async def list_topics(self) -> tuple[list[str], list[str]]:
        """(topics, topics being deleted)."""
        names = await self.store.list_topics()
        slots = asyncio.Semaphore(STATE_READS_IN_FLIGHT)

        async def deleting(name: str) -> bool:
            async with slots:
                try:
                    spec, _ = await self.store.get_topic(name)
                except UnknownTopicOrPartitionError:
                    return True  # gone meanwhile: not a topic any more
            return spec.deletion is not None

        marked = await asyncio.gather(*(deleting(n) for n in names))
        live = [n for n, gone in zip(names, marked, strict=True) if not gone]
        return live, [n for n, gone in zip(names, marked, strict=True) if gone]

    async def describe_topic(self, name: str) -> TopicDescription:
        spec, _ = await self.store.get_topic(name)
        return await self._describe(spec)

    async def delete_topic(self, name: str) -> TopicDescription:
        """Step 1 of a delete: mark the topic (the controller does the rest)."""
        return await self._describe(await self.store.mark_deleted(name, CAS_ATTEMPTS))

    async def create_partitions(self, name: str, count: int) -> TopicDescription:
        def grow(spec: TopicSpec) -> TopicSpec:
            if count <= spec.partitions:
                raise InvalidPartitionsError(
                    f"topic {name!r} has {spec.partitions} partitions; the new count must be "
                    f"greater, got {count}"
                )
            return respec(spec, partitions=count)

        return await self._describe(await self._update(name, grow))

    async def alter_configs(self, name: str, configs: Mapping[str, Any]) -> TopicDescription:
        def alter(spec: TopicSpec) -> TopicSpec:
            config = topic_config(configs, spec.config)
            check_min_insync(config, spec.replication_factor)
            return respec(spec, config=config)

        return await self._describe(await self._update(name, alter))

    async def _update(self, name: str, change: Callable[[TopicSpec], TopicSpec]) -> TopicSpec:
        """Compare-and-set the topic spec with ``change`` applied, re-reading on conflict."""
        for attempt in range(CAS_ATTEMPTS):
            spec, stat = await self.store.get_topic(name)
            if spec.deletion is not None:
                raise deleting_error(spec)
            new = change(spec)
            if new == spec:
                return spec
            try:
                await self.store.update_topic(new, stat.version)
                return new
            except NodeNotFoundError:
                raise UnknownTopicOrPartitionError(f"unknown topic {name!r}") from None
            except VersionConflictError:
                await asyncio.sleep(_jitter.uniform(0, 0.01 * 2**attempt))
        raise VersionConflictError(
            f"topic {name!r} changed under {CAS_ATTEMPTS} attempts in a row; try again"
        )

    async def _describe(self, spec: TopicSpec) -> TopicDescription:
        """``spec`` with its partitions' states, read pipelined (those the controller has
        not written yet are pending: right after a create, all of them, read in one call)."""
        found = await self.store.partition_states(spec.name)
        return describe(spec, {p: state for p, (state, _) in found.items()})


# ---------------------------------------------------------------- HTTP endpoints


class CreateTopicBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: StrictStr
    partitions: StrictInt = Field(ge=1, le=MAX_PARTITIONS)
    replication_factor: StrictInt | None = None
    configs: dict[str, Any] = Field(default_factory=dict)


class CreatePartitionsBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    count: StrictInt = Field(ge=1, le=MAX_PARTITIONS)


class AlterConfigsBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    configs: dict[str, Any]


def _create_topic(request: Request, invocation: Invocation) -> Response:
    body = parse_body(
        CreateTopicBody,
        request.json(),
        errors={
            "name": InvalidTopicError,
            "partitions": InvalidPartitionsError,
            "configs": InvalidConfigError,
        },
    )
    name = validate_topic_name(body.name)
    config = topic_config(body.configs)
    created = invocation.run(
        lambda store: TopicAdmin(store).create_topic(
            name, body.partitions, body.replication_factor, config
        )
    )
    return Response(201, created.to_json(), headers={"location": f"/topics/{name}"})


def _list_topics(request: Request, invocation: Invocation) -> Response:
    names, deleting = invocation.run(lambda store: TopicAdmin(store).list_topics())
    return Response(200, {"topics": names, "deleting": deleting})


def _describe_topic(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_topic_name(name)
    described = invocation.run(lambda store: TopicAdmin(store).describe_topic(name))
    return Response(200, described.to_json())


def _delete_topic(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_topic_name(name)
    deleting = invocation.run(lambda store: TopicAdmin(store).delete_topic(name))
    return Response(202, deleting.to_json())


def _create_partitions(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_topic_name(name)
    body = parse_body(
        CreatePartitionsBody, request.json(), errors={"count": InvalidPartitionsError}
    )
    described = invocation.run(lambda store: TopicAdmin(store).create_partitions(name, body.count))
    return Response(200, described.to_json())


def _alter_configs(request: Request, invocation: Invocation, name: str) -> Response:
    name = validate_topic_name(name)
    body = parse_body(AlterConfigsBody, request.json(), errors={"configs": InvalidConfigError})
    topic_config(body.configs)  # unknown keys and bad values are 400s before ZooKeeper
    described = invocation.run(lambda store: TopicAdmin(store).alter_configs(name, body.configs))
    return Response(200, described.to_json())


NAME = path_param("name")
TOPIC_ROUTES = [
    Route(
        "POST",
        "/topics",
        _create_topic,
        needs(
            AnyOf((on_topic(Operation.CREATE, body_field("name")), on_cluster(Operation.CREATE)))
        ),
    ),
    Route(
        "GET",
        "/topics",
        _list_topics,
        needs(
            shows=(Listing("topics", ResourceType.TOPIC), Listing("deleting", ResourceType.TOPIC))
        ),
    ),
    Route("GET", "/topics/{name}", _describe_topic, needs(on_topic(Operation.DESCRIBE, NAME))),
    Route("DELETE", "/topics/{name}", _delete_topic, needs(on_topic(Operation.DELETE, NAME))),
    Route(
        "POST",
        "/topics/{name}/partitions",
        _create_partitions,
        needs(on_topic(Operation.ALTER, NAME)),
    ),
    Route(
        "PATCH", "/topics/{name}/configs", _alter_configs, needs(on_topic(Operation.ALTER, NAME))
    ),
]
"""The topic routes; each says what its caller needs (``handlers.access``)."""

ROUTER = Router(
    [
        *TOPIC_ROUTES,
        *GROUP_ROUTES,
        *CLUSTER_ROUTES,
        *DELAY_ROUTES,
        *RETRY_ROUTES,
        *SECURITY_ROUTES,
    ],
    invocation=Invocation,
    guard=GUARD,
)


def handler(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
    """The Lambda entry point (API Gateway proxy integration, payload 1.0 or 2.0)."""
    return ROUTER.serve(event, context)
