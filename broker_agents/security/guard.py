"""ACL checks around the request core, once for both listeners.

The server puts each request's principal in ``current_principal`` (a context variable: one
per handler task) before the codec calls the core. ``Authorizer`` answers "may the current
principal do this" from the ACLs it keeps in step with ZooKeeper (``/config/acls``, watched)
and ``super.users``. ``Guard`` wraps the core's entry points, the ones the native handlers
and the Kafka listener's translations both call (``Apis``, ``GroupCoordinator``, the
transaction coordinator), so one check covers every listener:

==========================  =====================================================================
request                     needs
==========================  =====================================================================
Metadata                    Describe on each topic; all-topics requests leave out the topics the
                            principal may not describe, named ones answer TOPIC_AUTHORIZATION_FAILED
Produce                     Write on the topic (per partition: TOPIC_AUTHORIZATION_FAILED); to
                            a delay level or the failures topic, by a user who is not a super
                            user, also Write on each record's target topic / Read on its group
                            (``targets``: where the scheduler and the router write them next)
Fetch (consumer)            Read on the topic (per partition)
Fetch / OffsetForLeaderEpoch  from a replica: a super user (agents are listed in ``super.users``)
ListOffsets                 Describe on the topic (per partition)
FindCoordinator             Describe on the group (or the transactional id)
Join/Sync/Heartbeat/Leave,  Read on the group (GROUP_AUTHORIZATION_FAILED for the request)
OffsetCommit, OffsetFetch,
ConsumerProgress
InitProducerId              Write on the transactional id, when it names one
AddPartitionsToTxn, EndTxn, Write on the transactional id (TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
AddOffsetsToTxn,            (and Read on the group for the last two)
TxnOffsetCommit
WriteTxnMarkers             a super user (CLUSTER_AUTHORIZATION_FAILED)
Kafka CreateTopics,         Create (topic or cluster), Delete, Alter, Describe on each topic
DeleteTopics,               (checked in ``broker_agents.kafka.admin``, which gets the
CreatePartitions,           ``Authorizer``; TOPIC_AUTHORIZATION_FAILED per topic)
DescribeConfigs
==========================  =====================================================================

Every refusal is logged with the principal, the operation and the resource.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from broker_agents.security.targets import indirect_targets
from storage.codec.batch import batch_headers
from storage.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    StrataError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from storage.metadata.acls import (
    AclBinding,
    Operation,
    ResourceType,
    authorize,
    decode_acls,
)
from storage.protocol import messages as m

log = logging.getLogger(__name__)

#: the principal of the request being handled (set by the server per handler task)
current_principal: contextvars.ContextVar[str] = contextvars.ContextVar(
    "current_principal", default="User:ANONYMOUS"
)

_TOPIC = TopicAuthorizationFailedError.code


class Authorizer:
    def __init__(self, super_users: frozenset[str]) -> None:
        self.super_users = super_users
        self.bindings: list[AclBinding] = []

    def update(self, data: bytes | None) -> None:
        """The ACL znode changed (a watch); a list that does not parse keeps the old one."""
        try:
            self.bindings = decode_acls(data)
        except (ValueError, TypeError) as exc:
            log.error("the ACLs in ZooKeeper do not parse; keeping the previous ones: %s", exc)

    @property
    def principal(self) -> str:
        return current_principal.get()

    @property
    def is_super(self) -> bool:
        return self.principal in self.super_users

    def allows(self, op: Operation, rtype: ResourceType, name: str) -> bool:
        principal = self.principal
        if principal in self.super_users:
            return True
        ok = authorize(self.bindings, principal, op, rtype, name)
        if not ok:
            log.warning("refused: %s may not %s %s %r", principal, op, rtype, name)
        return ok

    def allows_quietly(self, op: Operation, rtype: ResourceType, name: str) -> bool:
        principal = self.principal
        return principal in self.super_users or authorize(self.bindings, principal, op, rtype, name)

    def require_super(self, what: str) -> None:
        if not self.is_super:
            log.warning("refused: %s may not %s (not a super user)", self.principal, what)
            raise ClusterAuthorizationFailedError(f"{what} needs a super user")

    def require_group(self, group: str, op: Operation = Operation.READ) -> None:
        if not self.allows(op, ResourceType.GROUP, group):
            raise GroupAuthorizationFailedError(f"not authorized to {op} group {group!r}")

    def require_txn(self, txn_id: str) -> None:
        if not self.allows(Operation.WRITE, ResourceType.TRANSACTIONAL_ID, txn_id):
            raise TransactionalIdAuthorizationFailedError(
                f"not authorized to use transactional id {txn_id!r}"
            )


def _refusal(partition: int, message: str = "", code: int = _TOPIC) -> m.ProducePartitionResult:
    return m.ProducePartitionResult(partition, code, message, -1, -1, -1, -1)


def transactional_refusal(
    az: Authorizer, transactional_id: str | None, carries_transactional: Callable[[], bool]
) -> TransactionalIdAuthorizationFailedError | None:
    """As Kafka: a produce carrying transactional batches needs a transactional id the
    principal may write, so that topic Write alone cannot open transactions that hold the
    partitions' committed readers back (``carries_transactional`` is asked only when that
    id is missing or not allowed)."""
    if az.is_super or (
        transactional_id is not None
        and az.allows(Operation.WRITE, ResourceType.TRANSACTIONAL_ID, transactional_id)
    ):
        return None
    if not carries_transactional():
        return None
    return TransactionalIdAuthorizationFailedError(
        f"not authorized to write transactional batches as transactional id {transactional_id!r}"
    )


def _carries_transactional(req: m.ProduceRequest) -> Callable[[], bool]:
    def any_transactional() -> bool:
        for t in req.topics:
            for p in t.partitions:
                if p.records is None:
                    continue
                try:
                    if any(h.is_transactional for h in batch_headers(p.records)):
                        return True
                except StrataError:
                    continue  # refused as corrupt by the core
        return False

    return any_transactional


class GuardedApis:
    """``Apis``'s entry points with ACL checks (everything else passes through)."""

    def __init__(self, inner: Any, authz: Authorizer) -> None:
        self._inner = inner
        self._authz = authz

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def metadata(self, req: m.MetadataRequest) -> m.MetadataResponse:
        resp: m.MetadataResponse = await self._inner.metadata(req)
        az = self._authz
        if req.topics is None:
            resp.topics = [
                t
                for t in resp.topics
                if az.allows_quietly(Operation.DESCRIBE, ResourceType.TOPIC, t.name)
            ]
        else:
            resp.topics = [
                t
                if az.allows(Operation.DESCRIBE, ResourceType.TOPIC, t.name)
                else m.TopicMetadata(_TOPIC, t.name, [])
                for t in resp.topics
            ]
        return resp

    async def produce(self, req: m.ProduceRequest, *, checked: bool = False) -> m.ProduceResponse:
        az = self._authz
        txn = transactional_refusal(az, req.transactional_id, _carries_transactional(req))
        if txn is not None:  # every partition refused, nothing stored
            return m.ProduceResponse(
                [
                    m.ProduceTopicResult(
                        t.name, [_refusal(p.partition, str(txn), txn.code) for p in t.partitions]
                    )
                    for t in req.topics
                ]
            )
        allowed: list[m.ProduceTopic] = []
        refused: list[m.ProduceTopicResult] = []
        for t in req.topics:
            if not az.allows(Operation.WRITE, ResourceType.TOPIC, t.name):
                refused.append(
                    m.ProduceTopicResult(
                        t.name,
                        [_refusal(p.partition, "not authorized to write") for p in t.partitions],
                    )
                )
                continue
            if az.is_super:
                allowed.append(t)
                continue
            # a delay level or the failures topic: where its records go next, too
            ok, bad = [], []
            for p in t.partitions:
                why = self._indirect_refusal(t.name, p.records)
                if why is None:
                    ok.append(p)
                else:
                    bad.append(_refusal(p.partition, why[1], why[0]))
            if ok:
                allowed.append(m.ProduceTopic(t.name, ok, t.topic_id) if bad else t)
            if bad:
                refused.append(m.ProduceTopicResult(t.name, bad))
        if not refused:
            resp: m.ProduceResponse = await self._inner.produce(req, checked=checked)
            return resp
        resp = m.ProduceResponse([])
        if allowed:
            req.topics = allowed
            resp = await self._inner.produce(req, checked=checked)
        for r in refused:  # a topic both stored and refused in part answers as one
            mine = next((x for x in resp.topics if x.name == r.name), None)
            if mine is None:
                resp.topics.append(r)
            else:
                mine.partitions.extend(r.partitions)
        return resp

    def _indirect_refusal(self, topic: str, records: Any) -> tuple[int, str] | None:
        """None if the principal may write ``records`` to ``topic`` and everywhere they go
        next (``targets``), else the refusal's (error code, message)."""
        try:
            need = indirect_targets(topic, records)
        except StrataError as exc:
            return exc.code, str(exc)
        if need is None:
            return None
        op, rtype, names = need
        for name in sorted(names):
            if not self._authz.allows(op, rtype, name):
                what = "write to topic" if rtype is ResourceType.TOPIC else "read as group"
                return _TOPIC, f"not authorized to {what} {name!r}, where {topic} delivers"
        return None

    async def fetch(self, req: m.FetchRequest) -> m.FetchResponse:
        if req.replica_id >= 0:
            self._authz.require_super("fetch as a replica")
            resp: m.FetchResponse = await self._inner.fetch(req)
            return resp
        allowed, refused = [], []
        for t in req.topics:
            if self._authz.allows(Operation.READ, ResourceType.TOPIC, t.name):
                allowed.append(t)
            else:
                refused.append(
                    m.FetchTopicResult(
                        t.name,
                        [
                            m.FetchPartitionResult(p.partition, _TOPIC, -1, -1, -1, -1, None)
                            for p in t.partitions
                        ],
                    )
                )
        if not refused:
            resp = await self._inner.fetch(req)
            return resp
        resp = m.FetchResponse([])
        if allowed:
            req.topics = allowed
            resp = await self._inner.fetch(req)
        resp.topics.extend(refused)
        return resp

    async def list_offsets(self, req: m.ListOffsetsRequest) -> m.ListOffsetsResponse:
        allowed, refused = [], []
        for t in req.topics:
            if self._authz.allows(Operation.DESCRIBE, ResourceType.TOPIC, t.name):
                allowed.append(t)
            else:
                refused.append(
                    m.ListOffsetsTopicResult(
                        t.name,
                        [
                            m.ListOffsetsPartitionResult(p.partition, _TOPIC, -1, -1, -1, -1)
                            for p in t.partitions
                        ],
                    )
                )
        resp = m.ListOffsetsResponse([])
        if allowed:
            req.topics = allowed
            resp = await self._inner.list_offsets(req)
        resp.topics.extend(refused)
        return resp

    async def offset_for_leader_epoch(self, req: Any) -> Any:
        self._authz.require_super("ask for leader epochs as a replica")
        return await self._inner.offset_for_leader_epoch(req)


class GuardedGroups:
    """The group coordinator's entry points with ACL checks."""

    def __init__(self, inner: Any, authz: Authorizer) -> None:
        self._inner = inner
        self._authz = authz

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _group(self, fn: str) -> Callable[[Any], Awaitable[Any]]:
        inner = getattr(self._inner, fn)

        async def guarded(req: Any, *args: Any, **kwargs: Any) -> Any:
            self._authz.require_group(req.group_id)
            return await inner(req, *args, **kwargs)

        return guarded

    async def join_group(self, req: Any, *a: Any) -> Any:
        return await self._group("join_group")(req, *a)

    async def sync_group(self, req: Any, *a: Any) -> Any:
        return await self._group("sync_group")(req, *a)

    async def heartbeat(self, req: Any, *a: Any) -> Any:
        return await self._group("heartbeat")(req, *a)

    async def leave_group(self, req: Any, *a: Any) -> Any:
        return await self._group("leave_group")(req, *a)

    async def consumer_progress(self, req: Any, *a: Any) -> Any:
        return await self._group("consumer_progress")(req, *a)

    async def offset_commit(self, req: Any, *a: Any) -> Any:
        return await self._group("offset_commit")(req, *a)

    async def offset_fetch(self, req: Any, *a: Any) -> Any:
        return await self._group("offset_fetch")(req, *a)

    async def txn_offset_commit(self, req: Any, *a: Any, **kw: Any) -> Any:
        self._authz.require_txn(req.transactional_id)
        return await self._group("txn_offset_commit")(req, *a, **kw)

    async def describe_group(self, group_id: str) -> Any:
        if not self._authz.allows(Operation.DESCRIBE, ResourceType.GROUP, group_id):
            raise GroupAuthorizationFailedError(f"not authorized to describe group {group_id!r}")
        return await self._inner.describe_group(group_id)

    async def find_coordinator(self, req: m.FindCoordinatorRequest) -> Any:
        if req.key_type == m.COORDINATOR_TRANSACTION:
            if not self._authz.allows(
                Operation.DESCRIBE, ResourceType.TRANSACTIONAL_ID, req.key
            ) and not self._authz.allows(Operation.WRITE, ResourceType.TRANSACTIONAL_ID, req.key):
                raise TransactionalIdAuthorizationFailedError(
                    f"not authorized to use transactional id {req.key!r}"
                )
        else:
            self._authz.require_group(req.key, Operation.DESCRIBE)
        return await self._inner.find_coordinator(req)


class GuardedTxns:
    """The transaction coordinator's entry points with ACL checks."""

    def __init__(self, inner: Any, authz: Authorizer) -> None:
        self._inner = inner
        self._authz = authz

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def find_coordinator(self, req: m.FindCoordinatorRequest) -> Any:
        if not self._authz.allows(Operation.WRITE, ResourceType.TRANSACTIONAL_ID, req.key):
            raise TransactionalIdAuthorizationFailedError(
                f"not authorized to use transactional id {req.key!r}"
            )
        return await self._inner.find_coordinator(req)

    async def init_producer_id(self, req: m.InitProducerIdRequest) -> Any:
        if req.transactional_id is not None:
            self._authz.require_txn(req.transactional_id)
        return await self._inner.init_producer_id(req)

    async def add_partitions_to_txn(self, req: m.AddPartitionsToTxnRequest) -> Any:
        self._authz.require_txn(req.transactional_id)
        for t in req.topics:
            if not self._authz.allows(Operation.WRITE, ResourceType.TOPIC, t.name):
                raise TopicAuthorizationFailedError(f"not authorized to write {t.name!r}")
        return await self._inner.add_partitions_to_txn(req)

    async def add_offsets_to_txn(self, req: m.AddOffsetsToTxnRequest) -> Any:
        self._authz.require_txn(req.transactional_id)
        self._authz.require_group(req.group_id)
        return await self._inner.add_offsets_to_txn(req)

    async def end_txn(self, req: m.EndTxnRequest, **kw: Any) -> Any:
        self._authz.require_txn(req.transactional_id)
        return await self._inner.end_txn(req, **kw)


class Guard:
    """Wires the guarded entry points into the native handler table (``handlers``)."""

    def __init__(self, authz: Authorizer, apis: Any, groups: Any, txns: Any) -> None:
        self.authz = authz
        self.core = GuardedApis(apis, authz)
        self.groups = GuardedGroups(groups, authz)
        self.txns = GuardedTxns(txns, authz)

    def handlers(self, existing: dict[int, Any]) -> dict[int, Any]:
        """``existing`` (the native table) with every entry point guarded."""
        az = self.authz
        txns = self.txns
        out = dict(existing)
        out.update(
            {
                m.ApiKey.METADATA: self.core.metadata,
                m.ApiKey.PRODUCE: self.core.produce,
                m.ApiKey.FETCH: self.core.fetch,
                m.ApiKey.LIST_OFFSETS: self.core.list_offsets,
                m.ApiKey.OFFSET_FOR_LEADER_EPOCH: self.core.offset_for_leader_epoch,
                m.ApiKey.JOIN_GROUP: self.groups.join_group,
                m.ApiKey.SYNC_GROUP: self.groups.sync_group,
                m.ApiKey.HEARTBEAT: self.groups.heartbeat,
                m.ApiKey.LEAVE_GROUP: self.groups.leave_group,
                m.ApiKey.CONSUMER_PROGRESS: self.groups.consumer_progress,
                m.ApiKey.OFFSET_COMMIT: self.groups.offset_commit,
                m.ApiKey.OFFSET_FETCH: self.groups.offset_fetch,
                m.ApiKey.TXN_OFFSET_COMMIT: self.groups.txn_offset_commit,
            }
        )
        route = existing[m.ApiKey.FIND_COORDINATOR]

        async def find_coordinator(req: m.FindCoordinatorRequest) -> Any:
            if req.key_type == m.COORDINATOR_TRANSACTION:
                if not az.allows(Operation.WRITE, ResourceType.TRANSACTIONAL_ID, req.key):
                    raise TransactionalIdAuthorizationFailedError(
                        f"not authorized to use transactional id {req.key!r}"
                    )
            else:
                az.require_group(req.key, Operation.DESCRIBE)
            return await route(req)

        markers = existing[m.ApiKey.WRITE_TXN_MARKERS]

        async def write_txn_markers(req: Any) -> Any:
            az.require_super("write transaction markers")
            return await markers(req)

        out.update(
            {
                m.ApiKey.FIND_COORDINATOR: find_coordinator,
                m.ApiKey.INIT_PRODUCER_ID: txns.init_producer_id,
                m.ApiKey.ADD_PARTITIONS_TO_TXN: txns.add_partitions_to_txn,
                m.ApiKey.ADD_OFFSETS_TO_TXN: txns.add_offsets_to_txn,
                m.ApiKey.END_TXN: txns.end_txn,
                m.ApiKey.WRITE_TXN_MARKERS: write_txn_markers,
            }
        )
        return out
