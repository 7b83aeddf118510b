"""The Kafka listener's request handlers: Kafka's fields in, the request core called, Kafka's
fields out.

Nothing here stores, replicates or coordinates anything. Each handler translates a decoded
Kafka request (``storage.kafka.messages``) into the core's own requests — the same
``Apis.produce`` / ``fetch`` / ``list_offsets`` / ``metadata`` and ``GroupCoordinator``
calls the native listener makes, in Strata's types (``storage.protocol.messages``) — and
the answer back. So a Kafka producer's batch goes through the same leader checks, WAL,
group commit, ISR wait and idempotence check (``storage/wal/producers.py``) as the SDK's,
and a group joined by a Kafka consumer is the same group, with the same committed offsets,
as one joined by the SDK.

The one thing done here per batch is the record conversion (``storage.kafka.records``):
produce converts each Kafka batch to a Strata batch before the core sees it (its CRC checked
first, its size against the topic's ``max.message.bytes``), fetch converts the Strata batches
the core returns into Kafka batches (their CRCs checked first).

Transactions: FindCoordinator (key type 1), InitProducerId with a ``transactional.id``,
AddPartitionsToTxn, AddOffsetsToTxn, EndTxn and TxnOffsetCommit go to the same transaction
and group coordinators as the SDK's, so a Kafka client's transaction is fenced, timed out,
recovered and marked exactly as the SDK's is. Two differences follow from the versions
served (those before KIP-890): an abort keeps the producer's epoch (the EndTxn answer
cannot tell a client a new one), and a fenced producer is answered INVALID_PRODUCER_EPOCH
(47), the code clients of those versions read as fencing.

Error codes: the core's are Strata's, which are Kafka's where Kafka has the same error;
``storage.kafka.errors.kafka_code`` maps the rest.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker_agents.security.guard import transactional_refusal
from storage.errors import (
    BatchTooLargeError,
    CoordinatorNotAvailableError,
    InvalidProducerEpochError,
    InvalidRequestError,
    InvalidRequiredAcksError,
    ProducerFencedError,
    StrataError,
)
from storage.kafka import records as kr
from storage.kafka.errors import UNKNOWN_SERVER_ERROR, code_of, kafka_code
from storage.kafka.frames import served_versions
from storage.kafka.messages import ApiKey
from storage.protocol import messages as m

if TYPE_CHECKING:
    from broker_agents.groups.coordinator import GroupCoordinator
    from broker_agents.kafka.admin import KafkaTopicAdmin
    from broker_agents.security.guard import Authorizer
    from broker_agents.transactions.coordinator import TransactionCoordinator
    from broker_agents.view import ClusterView

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], int], Awaitable[dict[str, Any] | None]]

#: what DescribeGroups reports for each of the coordinator's phases
_KAFKA_STATE = {
    "empty": "Empty",
    "preparing_rebalance": "PreparingRebalance",
    "completing_rebalance": "CompletingRebalance",
    "stable": "Stable",
    "dead": "Dead",
}
CLUSTER_ID = "strata"


def txn_code(code: int) -> int:
    """A Strata error code as a Kafka client of the versions served reads it: Kafka's, with
    PRODUCER_FENCED (90, KIP-588) given as INVALID_PRODUCER_EPOCH (47)."""
    code = kafka_code(code)
    return InvalidProducerEpochError.code if code == ProducerFencedError.code else code


class RequestCore(Protocol):
    """What the Kafka handlers need of the request core (``broker_agents.apis.Apis``)."""

    async def produce(
        self, req: m.ProduceRequest, *, checked: bool = False
    ) -> m.ProduceResponse: ...
    async def fetch(self, req: m.FetchRequest) -> m.FetchResponse: ...
    async def list_offsets(self, req: m.ListOffsetsRequest) -> m.ListOffsetsResponse: ...
    async def metadata(self, req: m.MetadataRequest) -> m.MetadataResponse: ...


class KafkaApis:
    def __init__(
        self,
        core: RequestCore,
        groups: GroupCoordinator,
        txns: TransactionCoordinator,
        view: ClusterView,
        admin: KafkaTopicAdmin,
        authorizer: Authorizer | None = None,
    ) -> None:
        self.core = core
        self.groups = groups
        self.txns = txns
        #: with ACLs on: a transactional produce needs Write on its transactional id too
        self.authorizer = authorizer
        self.view = view
        self.admin = admin
        self.handlers: dict[int, Handler] = {
            ApiKey.API_VERSIONS: self.api_versions,
            ApiKey.METADATA: self.metadata,
            ApiKey.PRODUCE: self.produce,
            ApiKey.FETCH: self.fetch,
            ApiKey.LIST_OFFSETS: self.list_offsets,
            ApiKey.FIND_COORDINATOR: self.find_coordinator,
            ApiKey.JOIN_GROUP: self.join_group,
            ApiKey.SYNC_GROUP: self.sync_group,
            ApiKey.HEARTBEAT: self.heartbeat,
            ApiKey.LEAVE_GROUP: self.leave_group,
            ApiKey.OFFSET_COMMIT: self.offset_commit,
            ApiKey.OFFSET_FETCH: self.offset_fetch,
            ApiKey.DESCRIBE_GROUPS: self.describe_groups,
            ApiKey.LIST_GROUPS: self.list_groups,
            ApiKey.INIT_PRODUCER_ID: self.init_producer_id,
            ApiKey.ADD_PARTITIONS_TO_TXN: self.add_partitions_to_txn,
            ApiKey.ADD_OFFSETS_TO_TXN: self.add_offsets_to_txn,
            ApiKey.END_TXN: self.end_txn,
            ApiKey.TXN_OFFSET_COMMIT: self.txn_offset_commit,
            ApiKey.CREATE_TOPICS: self.admin.create_topics,
            ApiKey.DELETE_TOPICS: self.admin.delete_topics,
            ApiKey.CREATE_PARTITIONS: self.admin.create_partitions,
            ApiKey.DESCRIBE_CONFIGS: self.admin.describe_configs,
        }

    def _address(self, agent_id: int) -> tuple[str, int] | None:
        reg = self.view.agents.get(agent_id)
        if reg is None or reg.kafka_port is None:
            return None
        return reg.kafka_host or reg.host, reg.kafka_port

    # ---- ApiVersions, Metadata ------------------------------------------------------------
    async def api_versions(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        return {"error_code": 0, "api_keys": served_versions()}

    async def metadata(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        topics = req["topics"]
        names = None if topics is None or (version == 0 and not topics) else [
            t["name"] for t in topics
        ]  # fmt: skip
        resp = await self.core.metadata(m.MetadataRequest(names))
        brokers = []
        for a in resp.agents:
            addr = self._address(a.agent_id)
            if addr is not None:
                brokers.append({"node_id": a.agent_id, "host": addr[0], "port": addr[1]})
        return {
            "brokers": brokers,
            "cluster_id": CLUSTER_ID,
            "controller_id": resp.controller_id,
            "topics": [
                {
                    "error_code": kafka_code(t.error_code),
                    "name": t.name,
                    "is_internal": t.name.startswith("__"),
                    "partitions": [
                        {
                            "error_code": kafka_code(p.error_code),
                            "partition_index": p.partition,
                            "leader_id": p.leader_id,
                            "leader_epoch": p.leader_epoch,
                            "replica_nodes": p.replicas,
                            "isr_nodes": p.isr,
                            "offline_replicas": [],
                        }
                        for p in t.partitions
                    ],
                }
                for t in resp.topics
            ],
        }

    # ---- Produce --------------------------------------------------------------------------
    async def produce(self, req: dict[str, Any], version: int) -> dict[str, Any] | None:
        acks = req["acks"]
        if acks not in (0, 1, -1):
            raise InvalidRequiredAcksError(f"acks must be 0, 1 or -1 (all), got {acks}")
        failed: dict[tuple[str, int], StrataError] = {}
        refused = self._transactional_refusal(req)
        topics = []
        for t in req["topic_data"] if refused is None else ():
            name = t["name"]
            spec = self.view.topics.get(name)
            limit = spec.config.max_message_bytes if spec is not None else None
            keep = spec is None or spec.config.kafka_batch_storage == "as-sent"
            parts = []
            for p in t["partition_data"]:
                records = p["records"]
                try:
                    if records is None or not len(records):
                        raise InvalidRequestError("a produce request without a record batch")
                    if limit is not None and len(records) > limit:
                        raise BatchTooLargeError(len(records), limit)
                    batch = kr.kafka_to_append(records, keep=keep)
                    parts.append(m.ProducePartition(p["index"], batch))
                except StrataError as exc:
                    failed[(name, p["index"])] = exc
            if parts:
                topics.append(m.ProduceTopic(name, parts))
        results: dict[tuple[str, int], m.ProducePartitionResult] = {}
        if topics:
            # every batch was built here from a Kafka batch checked record by record
            resp = await self.core.produce(
                m.ProduceRequest(acks, req["timeout_ms"], topics, req.get("transactional_id")),
                checked=True,
            )
            for tr in resp.topics:
                for pr in tr.partitions:
                    results[(tr.name, pr.partition)] = pr
        if acks == 0:
            return None
        responses = []
        for t in req["topic_data"]:
            out = []
            for p in t["partition_data"]:
                key = (t["name"], p["index"])
                err = refused or failed.get(key)
                if err is not None:
                    out.append(
                        {
                            "index": p["index"],
                            "error_code": code_of(err),
                            "base_offset": -1,
                            "error_message": str(err)[:500],
                        }
                    )
                    continue
                r = results.get(key)
                if r is None:
                    out.append({"index": p["index"], "error_code": UNKNOWN_SERVER_ERROR})
                    continue
                out.append(
                    {
                        "index": r.partition,
                        "error_code": txn_code(r.error_code),
                        "base_offset": r.base_offset,
                        "log_start_offset": r.log_start_offset,
                        "error_message": r.error_message,
                    }
                )
            responses.append({"name": t["name"], "partition_responses": out})
        return {"responses": responses}

    def _transactional_refusal(self, req: dict[str, Any]) -> StrataError | None:
        """With ACLs on, a produce carrying transactional batches needs a transactional id
        the principal may write (``guard.transactional_refusal``, the native listener's
        rule); refused here before any batch is converted."""
        if self.authorizer is None:
            return None
        return transactional_refusal(
            self.authorizer,
            req.get("transactional_id"),
            lambda: any(
                kr.is_transactional(p["records"])
                for t in req["topic_data"]
                for p in t["partition_data"]
                if p["records"] is not None
            ),
        )

    # ---- Fetch ----------------------------------------------------------------------------
    async def fetch(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        # no fetch sessions (KIP-227): session id 0 tells the client to send full requests
        core_req = m.FetchRequest(
            m.CONSUMER_REPLICA_ID,
            req["max_wait_ms"],
            req["min_bytes"],
            req["max_bytes"],
            req["isolation_level"],  # read_committed: up to the last stable offset
            [
                m.FetchTopic(
                    t["topic"],
                    [
                        m.FetchPartition(
                            p["partition"], p["fetch_offset"], p["partition_max_bytes"]
                        )
                        for p in t["partitions"]
                    ],
                )
                for t in req["topics"]
            ],
        )
        resp = await self.core.fetch(core_req)
        responses = []
        for t in resp.topics:
            parts = []
            for p in t.partitions:
                code = kafka_code(p.error_code)
                records: Any = b""  # librdkafka refuses a null record set
                if p.records is not None and len(p.records):
                    try:
                        records = kr.strata_batches_to_kafka(p.records)
                    except StrataError as exc:
                        log.error(
                            "%s-%d: stored batch does not convert: %s", t.name, p.partition, exc
                        )
                        code = code_of(exc)
                parts.append(
                    {
                        "partition_index": p.partition,
                        "error_code": code,
                        "high_watermark": p.high_watermark,
                        "last_stable_offset": (
                            p.last_stable_offset if p.last_stable_offset >= 0 else p.high_watermark
                        ),
                        "log_start_offset": p.log_start_offset,
                        # read_committed: the client drops these producers' transactional
                        # batches from first_offset on, up to their abort markers
                        "aborted_transactions": None
                        if p.aborted_transactions is None
                        else [
                            {"producer_id": a.producer_id, "first_offset": a.first_offset}
                            for a in p.aborted_transactions
                        ],
                        "records": records,
                    }
                )
            responses.append({"topic": t.name, "partitions": parts})
        return {"error_code": 0, "session_id": 0, "responses": responses}

    # ---- ListOffsets ----------------------------------------------------------------------
    async def list_offsets(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        core_req = m.ListOffsetsRequest(
            [
                m.ListOffsetsTopic(
                    t["name"],
                    [
                        m.ListOffsetsPartition(p["partition_index"], p["timestamp"])
                        for p in t["partitions"]
                    ],
                )
                for t in req["topics"]
            ],
            # (v2+) read_committed: "latest" is the last stable offset
            req.get("isolation_level", m.READ_UNCOMMITTED),
        )
        resp = await self.core.list_offsets(core_req)
        return {
            "topics": [
                {
                    "name": t.name,
                    "partitions": [
                        {
                            "partition_index": p.partition,
                            "error_code": kafka_code(p.error_code),
                            "timestamp": p.timestamp,
                            "offset": p.offset,
                            "leader_epoch": p.leader_epoch,
                        }
                        for p in t.partitions
                    ],
                }
                for t in resp.topics
            ]
        }

    # ---- groups ---------------------------------------------------------------------------
    async def find_coordinator(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        key_type = req["key_type"]
        if key_type == m.COORDINATOR_GROUP:
            found = await self.groups.find_coordinator(m.FindCoordinatorRequest(req["key"]))
        elif key_type == m.COORDINATOR_TRANSACTION:
            found = await self.txns.find_coordinator(
                m.FindCoordinatorRequest(req["key"], m.COORDINATOR_TRANSACTION)
            )
        else:
            return {
                "error_code": InvalidRequestError.code,
                "error_message": f"unknown coordinator key type {key_type}",
            }
        if found.error_code:
            return {"error_code": kafka_code(found.error_code)}
        addr = self._address(found.agent_id)
        if addr is None:
            return {
                "error_code": CoordinatorNotAvailableError.code,
                "error_message": f"agent {found.agent_id} has no Kafka listener",
            }
        return {"error_code": 0, "node_id": found.agent_id, "host": addr[0], "port": addr[1]}

    async def join_group(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        rebalance = req["rebalance_timeout_ms"]
        resp = await self.groups.join_group(
            m.JoinGroupRequest(
                req["group_id"],
                req["session_timeout_ms"],
                rebalance if rebalance >= 0 else req["session_timeout_ms"],
                req["member_id"],
                req["group_instance_id"],
                req["protocol_type"],
                [m.JoinGroupProtocol(p["name"], bytes(p["metadata"])) for p in req["protocols"]],
            )
        )
        return {
            "error_code": kafka_code(resp.error_code),
            "generation_id": resp.generation_id,
            "protocol_name": resp.protocol_name or "",
            "leader": resp.leader,
            "member_id": resp.member_id,
            "members": [
                {
                    "member_id": mb.member_id,
                    "group_instance_id": mb.group_instance_id,
                    "metadata": mb.metadata,
                }
                for mb in resp.members
            ],
        }

    async def sync_group(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        resp = await self.groups.sync_group(
            m.SyncGroupRequest(
                req["group_id"],
                req["generation_id"],
                req["member_id"],
                req["group_instance_id"],
                [
                    m.SyncGroupAssignment(a["member_id"], bytes(a["assignment"]))
                    for a in req["assignments"]
                ],
            )
        )
        return {"error_code": kafka_code(resp.error_code), "assignment": resp.assignment or b""}

    async def heartbeat(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        resp = await self.groups.heartbeat(
            m.HeartbeatRequest(
                req["group_id"], req["generation_id"], req["member_id"], req["group_instance_id"]
            )
        )
        return {"error_code": kafka_code(resp.error_code)}

    async def leave_group(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        if version < 3:
            resp = await self.groups.leave_group(
                m.LeaveGroupRequest(req["group_id"], req["member_id"], None)
            )
            return {"error_code": kafka_code(resp.error_code)}
        members = []
        for mb in req["members"]:
            resp = await self.groups.leave_group(
                m.LeaveGroupRequest(req["group_id"], mb["member_id"], mb["group_instance_id"])
            )
            members.append({**mb, "error_code": kafka_code(resp.error_code)})
        return {"error_code": 0, "members": members}

    async def offset_commit(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        resp = await self.groups.offset_commit(
            m.OffsetCommitRequest(
                req["group_id"],
                req["generation_id"],
                req["member_id"],
                req["group_instance_id"],
                _commit_topics(req["topics"]),
            )
        )
        return {"topics": _commit_results(resp.topics, kafka_code)}

    async def offset_fetch(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        topics = req["topics"]
        resp = await self.groups.offset_fetch(
            m.OffsetFetchRequest(
                req["group_id"],
                None
                if topics is None
                else [m.OffsetFetchTopic(t["name"], t["partition_indexes"]) for t in topics],
            )
        )
        code = kafka_code(resp.error_code)
        if code and version < 2:  # no top-level error field: every partition carries it
            return {
                "topics": [
                    {
                        "name": t["name"],
                        "partitions": [
                            {"partition_index": p, "committed_offset": -1, "error_code": code}
                            for p in t["partition_indexes"]
                        ],
                    }
                    for t in topics or []
                ]
            }
        return {
            "error_code": code,
            "topics": [
                {
                    "name": t.name,
                    "partitions": [
                        {
                            "partition_index": p.partition,
                            "committed_offset": p.offset,
                            "metadata": p.metadata if p.metadata is not None else "",
                            "error_code": kafka_code(p.error_code),
                        }
                        for p in t.partitions
                    ],
                }
                for t in resp.topics
            ],
        }

    async def describe_groups(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        groups = []
        for group_id in req["groups"]:
            try:
                g = await self.groups.describe_group(group_id)
            except StrataError as exc:
                groups.append({"error_code": code_of(exc), "group_id": group_id})
                continue
            groups.append(
                {
                    "error_code": 0,
                    "group_id": g.group_id,
                    "group_state": _KAFKA_STATE.get(g.phase.value, "Unknown"),
                    "protocol_type": g.protocol_type,
                    "protocol_data": g.protocol,
                    "members": [
                        {
                            "member_id": mb.member_id,
                            "group_instance_id": mb.group_instance_id,
                            "client_id": mb.client_id,
                            "client_host": "",
                            "member_metadata": mb.metadata,
                            "member_assignment": mb.assignment,
                        }
                        for mb in g.members
                    ],
                }
            )
        return {"groups": groups}

    async def list_groups(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        try:
            listed = await self.groups.list_groups()
        except StrataError as exc:
            return {"error_code": code_of(exc)}
        return {
            "error_code": 0,
            "groups": [{"group_id": g, "protocol_type": pt} for g, pt in listed],
        }

    # ---- InitProducerId -------------------------------------------------------------------
    async def init_producer_id(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        """An idempotent producer's id: random 63 bits with epoch 0, as the SDK draws its
        own (``sdk/idempotence.py``). Partition leaders keep per-id sequence state, so no
        agent needs to remember ids it handed out. With a ``transactional.id``: the
        transaction coordinator's (a new epoch, fencing the previous session)."""
        txn_id = req["transactional_id"]
        if txn_id is None:
            return {"error_code": 0, "producer_id": secrets.randbits(63), "producer_epoch": 0}
        resp = await self.txns.init_producer_id(
            m.InitProducerIdRequest(txn_id, req["transaction_timeout_ms"])
        )
        return {
            "error_code": txn_code(resp.error_code),
            "producer_id": resp.producer_id,
            "producer_epoch": resp.producer_epoch,
        }

    # ---- transactions ---------------------------------------------------------------------
    async def add_partitions_to_txn(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        topics = [m.TxnTopic(t["name"], list(t["partitions"])) for t in req["topics"]]
        try:
            resp = await self.txns.add_partitions_to_txn(
                m.AddPartitionsToTxnRequest(
                    req["transactional_id"], req["producer_id"], req["producer_epoch"], topics
                )
            )
            codes = {(t.name, p.partition): p.error_code for t in resp.topics for p in t.partitions}
        except StrataError as exc:
            codes = {(t.name, p): exc.code for t in topics for p in t.partitions}
        return {
            "results": [
                {
                    "name": t.name,
                    "results": [
                        {"partition_index": p, "error_code": txn_code(codes.get((t.name, p), 0))}
                        for p in t.partitions
                    ],
                }
                for t in topics
            ]
        }

    async def add_offsets_to_txn(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        resp = await self.txns.add_offsets_to_txn(
            m.AddOffsetsToTxnRequest(
                req["transactional_id"], req["producer_id"], req["producer_epoch"], req["group_id"]
            )
        )
        return {"error_code": txn_code(resp.error_code)}

    async def end_txn(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        resp = await self.txns.end_txn(
            m.EndTxnRequest(
                req["transactional_id"],
                req["producer_id"],
                req["producer_epoch"],
                1 if req["committed"] else 0,
            ),
            bump_on_abort=False,  # the answer has no epoch field before KIP-890
        )
        return {"error_code": txn_code(resp.error_code)}

    async def txn_offset_commit(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        topics = _commit_topics(req["topics"])
        core_req = m.TxnOffsetCommitRequest(
            req["transactional_id"],
            req["group_id"],
            req["producer_id"],
            req["producer_epoch"],
            req["generation_id"],
            req["member_id"],
            req["group_instance_id"],
            topics,
        )
        try:
            # v0-2 carry no group metadata: fenced by the producer epoch alone (pre KIP-447)
            resp = await self.groups.txn_offset_commit(core_req, without_member=version < 3)
            results = resp.topics
        except StrataError as exc:
            results = [
                m.OffsetCommitTopicResult(
                    t.name,
                    [m.OffsetCommitPartitionResult(p.partition, exc.code) for p in t.partitions],
                )
                for t in topics
            ]
        return {"topics": _commit_results(results, txn_code)}


def _commit_topics(topics: list[dict[str, Any]]) -> list[m.OffsetCommitTopic]:
    """An OffsetCommit's or TxnOffsetCommit's topics in the core's types."""
    return [
        m.OffsetCommitTopic(
            t["name"],
            [
                m.OffsetCommitPartition(
                    p["partition_index"], p["committed_offset"], p["committed_metadata"]
                )
                for p in t["partitions"]
            ],
        )
        for t in topics
    ]


def _commit_results(
    topics: list[m.OffsetCommitTopicResult], code: Callable[[int], int]
) -> list[dict[str, Any]]:
    """The core's per-partition commit results in Kafka's fields, each code through ``code``."""
    return [
        {
            "name": t.name,
            "partitions": [
                {"partition_index": p.partition, "error_code": code(p.error_code)}
                for p in t.partitions
            ],
        }
        for t in topics
    ]
