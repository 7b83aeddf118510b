"""Request and response bodies of every API, version 0.

Each API has a key (``ApiKey``), a request dataclass and a response dataclass; ``APIS`` maps
one to the other. Field order in a dataclass is its order on the wire. Partition-level errors
travel as ``error_code`` fields (0 = none) next to the data, so one bad partition never fails
a whole request; a response to a request that could not be handled at all carries a non-zero
code in the response header instead (see ``frames``).

Conventions (as in Kafka): ``acks`` 0 / 1 / -1 (all); ``leader_id`` -1 = unknown; ListOffsets
``timestamp`` -1 = latest, -2 = earliest; Fetch ``replica_id`` -1 = a consumer.

Topic ids (KIP-516): Metadata answers each topic's id; Produce, Fetch and OffsetCommit may
name the id the client holds (null: by name only). A request naming an id other than the
topic's current one gets ``INCONSISTENT_TOPIC_ID`` (103), or ``UNKNOWN_TOPIC_ID`` (100) when
no topic has it, for the partitions concerned, and never touches another incarnation's log.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from storage.protocol.schema import (
    BYTES,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    Array,
    Message,
    struct_of,
)


class ApiKey(enum.IntEnum):
    API_VERSIONS = 0
    METADATA = 1
    PRODUCE = 2
    FETCH = 3
    LIST_OFFSETS = 4
    # consumer groups: Kafka's key numbers (docs/groups.md)
    OFFSET_COMMIT = 8
    OFFSET_FETCH = 9
    FIND_COORDINATOR = 10
    JOIN_GROUP = 11
    HEARTBEAT = 12
    LEAVE_GROUP = 13
    SYNC_GROUP = 14
    # authentication: Kafka's key numbers (docs/security.md)
    SASL_HANDSHAKE = 17
    SASL_AUTHENTICATE = 36
    # transactions: Kafka's key numbers (docs/transactions.md)
    INIT_PRODUCER_ID = 22
    OFFSET_FOR_LEADER_EPOCH = 23
    ADD_PARTITIONS_TO_TXN = 24
    ADD_OFFSETS_TO_TXN = 25
    END_TXN = 26
    WRITE_TXN_MARKERS = 27
    TXN_OFFSET_COMMIT = 28
    # Strata's own, outside Kafka's numbers
    CONSUMER_PROGRESS = 1000  # what a group member is processing (docs/retries.md, crashes)


LATEST_TIMESTAMP = -1
EARLIEST_TIMESTAMP = -2
CONSUMER_REPLICA_ID = -1
#: Fetch / ListOffsets ``isolation_level``
READ_UNCOMMITTED = 0
READ_COMMITTED = 1


# ---- ApiVersions ------------------------------------------------------------------------------
@dataclass(slots=True)
class ApiVersionsRequest(Message):
    SCHEMA = ()


@dataclass(slots=True)
class ApiVersionRange(Message):
    api_key: int
    min_version: int
    max_version: int
    SCHEMA = (("api_key", INT16), ("min_version", INT16), ("max_version", INT16))


@dataclass(slots=True)
class ApiVersionsResponse(Message):
    error_code: int
    api_keys: list[ApiVersionRange]
    SCHEMA = (("error_code", INT16), ("api_keys", Array(struct_of(ApiVersionRange))))


# ---- Metadata ---------------------------------------------------------------------------------
@dataclass(slots=True)
class MetadataRequest(Message):
    topics: list[str] | None = None  # None = every topic
    SCHEMA = (("topics", Array(STRING)),)


@dataclass(slots=True)
class AgentInfo(Message):
    agent_id: int
    host: str
    port: int
    SCHEMA = (("agent_id", INT32), ("host", STRING), ("port", INT32))


@dataclass(slots=True)
class PartitionMetadata(Message):
    error_code: int
    partition: int
    leader_id: int
    leader_epoch: int
    replicas: list[int]
    isr: list[int]
    SCHEMA = (
        ("error_code", INT16),
        ("partition", INT32),
        ("leader_id", INT32),
        ("leader_epoch", INT32),
        ("replicas", Array(INT32)),
        ("isr", Array(INT32)),
    )


@dataclass(slots=True)
class TopicMetadata(Message):
    error_code: int
    name: str
    partitions: list[PartitionMetadata]
    delay_max_ms: int = -1  # the topic's delay.max.ms; -1 when unknown
    topic_id: str | None = None  # null: the topic is unknown
    SCHEMA = (
        ("error_code", INT16),
        ("name", STRING),
        ("partitions", Array(struct_of(PartitionMetadata))),
        ("delay_max_ms", INT64),
        ("topic_id", STRING),
    )


@dataclass(slots=True)
class MetadataResponse(Message):
    agents: list[AgentInfo]
    controller_id: int
    topics: list[TopicMetadata]
    SCHEMA = (
        ("agents", Array(struct_of(AgentInfo))),
        ("controller_id", INT32),
        ("topics", Array(struct_of(TopicMetadata))),
    )


# ---- Produce ----------------------------------------------------------------------------------
@dataclass(slots=True)
class ProducePartition(Message):
    partition: int
    records: Any  # one or more whole record batches (bytes-like)
    SCHEMA = (("partition", INT32), ("records", BYTES))


@dataclass(slots=True)
class ProduceTopic(Message):
    name: str
    partitions: list[ProducePartition]
    topic_id: str | None = None  # null: by name only
    SCHEMA = (
        ("name", STRING),
        ("partitions", Array(struct_of(ProducePartition))),
        ("topic_id", STRING),
    )


@dataclass(slots=True)
class ProduceRequest(Message):
    acks: int
    timeout_ms: int
    topics: list[ProduceTopic]
    #: a transactional producer's id: with ACLs on, transactional batches need Write on it
    transactional_id: str | None = None
    SCHEMA = (
        ("acks", INT16),
        ("timeout_ms", INT32),
        ("topics", Array(struct_of(ProduceTopic))),
        ("transactional_id", STRING),
    )


@dataclass(slots=True)
class ProducePartitionResult(Message):
    partition: int
    error_code: int
    error_message: str | None
    base_offset: int
    log_start_offset: int
    leader_id: int
    leader_epoch: int
    SCHEMA = (
        ("partition", INT32),
        ("error_code", INT16),
        ("error_message", STRING),
        ("base_offset", INT64),
        ("log_start_offset", INT64),
        ("leader_id", INT32),
        ("leader_epoch", INT32),
    )


@dataclass(slots=True)
class ProduceTopicResult(Message):
    name: str
    partitions: list[ProducePartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(ProducePartitionResult))))


@dataclass(slots=True)
class ProduceResponse(Message):
    topics: list[ProduceTopicResult]
    throttle_time_ms: int = 0  # how long the agent held this answer (a quota: security.md)
    SCHEMA = (("topics", Array(struct_of(ProduceTopicResult))), ("throttle_time_ms", INT32))


# ---- Fetch ------------------------------------------------------------------------------------
@dataclass(slots=True)
class FetchPartition(Message):
    partition: int
    fetch_offset: int
    partition_max_bytes: int
    current_leader_epoch: int = -1  # -1: do not check
    filter: str | None = None  # a storage.filters expression (consumers only); None: every record
    SCHEMA = (
        ("partition", INT32),
        ("fetch_offset", INT64),
        ("partition_max_bytes", INT32),
        ("current_leader_epoch", INT32),
        ("filter", STRING),
    )


@dataclass(slots=True)
class FetchTopic(Message):
    name: str
    partitions: list[FetchPartition]
    topic_id: str | None = None  # null: by name only
    SCHEMA = (
        ("name", STRING),
        ("partitions", Array(struct_of(FetchPartition))),
        ("topic_id", STRING),
    )


@dataclass(slots=True)
class FetchRequest(Message):
    replica_id: int
    max_wait_ms: int
    min_bytes: int
    max_bytes: int
    isolation_level: int
    topics: list[FetchTopic]
    SCHEMA = (
        ("replica_id", INT32),
        ("max_wait_ms", INT32),
        ("min_bytes", INT32),
        ("max_bytes", INT32),
        ("isolation_level", INT8),
        ("topics", Array(struct_of(FetchTopic))),
    )


@dataclass(slots=True)
class BatchSelection(Message):
    """The records of a sent batch that match a fetch's filter: bit i (LSB first) of
    ``bitmap`` is record ``base_offset + i`` (``storage.filters.scan``)."""

    base_offset: int
    bitmap: Any
    SCHEMA = (("base_offset", INT64), ("bitmap", BYTES))


@dataclass(slots=True)
class AbortedTransaction(Message):
    """An aborted transaction with batches in a read_committed fetch's range: the batches of
    ``producer_id`` with the transactional bit and a base offset in ``[first_offset,
    last_offset)`` are dropped by the consumer (``last_offset`` is the abort marker's)."""

    producer_id: int
    first_offset: int
    last_offset: int
    SCHEMA = (("producer_id", INT64), ("first_offset", INT64), ("last_offset", INT64))


@dataclass(slots=True)
class FetchPartitionResult(Message):
    partition: int
    error_code: int
    high_watermark: int
    log_start_offset: int
    leader_id: int
    leader_epoch: int
    records: Any  # whole batches exactly as stored (may start before fetch_offset)
    # filtered fetches: where the agent stopped looking (the next fetch starts there once the
    # records before it are consumed); -1 for an unfiltered fetch
    next_offset: int = -1
    selections: list[BatchSelection] | None = None  # the mixed batches' matching records
    # read_committed: records are below it (the first offset of the oldest open transaction)
    last_stable_offset: int = -1
    # read_committed: the aborted transactions with batches in ``records``
    aborted_transactions: list[AbortedTransaction] | None = None
    SCHEMA = (
        ("partition", INT32),
        ("error_code", INT16),
        ("high_watermark", INT64),
        ("log_start_offset", INT64),
        ("leader_id", INT32),
        ("leader_epoch", INT32),
        ("records", BYTES),
        ("next_offset", INT64),
        ("selections", Array(struct_of(BatchSelection))),
        ("last_stable_offset", INT64),
        ("aborted_transactions", Array(struct_of(AbortedTransaction))),
    )


@dataclass(slots=True)
class FetchTopicResult(Message):
    name: str
    partitions: list[FetchPartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(FetchPartitionResult))))


@dataclass(slots=True)
class FetchResponse(Message):
    topics: list[FetchTopicResult]
    throttle_time_ms: int = 0  # how long the agent held this answer (a quota: security.md)
    SCHEMA = (("topics", Array(struct_of(FetchTopicResult))), ("throttle_time_ms", INT32))


# ---- ListOffsets ------------------------------------------------------------------------------
@dataclass(slots=True)
class ListOffsetsPartition(Message):
    partition: int
    timestamp: int
    SCHEMA = (("partition", INT32), ("timestamp", INT64))


@dataclass(slots=True)
class ListOffsetsTopic(Message):
    name: str
    partitions: list[ListOffsetsPartition]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(ListOffsetsPartition))))


@dataclass(slots=True)
class ListOffsetsRequest(Message):
    topics: list[ListOffsetsTopic]
    isolation_level: int = READ_UNCOMMITTED  # READ_COMMITTED: "latest" is the LSO
    SCHEMA = (("topics", Array(struct_of(ListOffsetsTopic))), ("isolation_level", INT8))


@dataclass(slots=True)
class ListOffsetsPartitionResult(Message):
    partition: int
    error_code: int
    timestamp: int
    offset: int  # -1 when no record has a timestamp at or after the one asked for
    leader_id: int
    leader_epoch: int
    SCHEMA = (
        ("partition", INT32),
        ("error_code", INT16),
        ("timestamp", INT64),
        ("offset", INT64),
        ("leader_id", INT32),
        ("leader_epoch", INT32),
    )


@dataclass(slots=True)
class ListOffsetsTopicResult(Message):
    name: str
    partitions: list[ListOffsetsPartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(ListOffsetsPartitionResult))))


@dataclass(slots=True)
class ListOffsetsResponse(Message):
    topics: list[ListOffsetsTopicResult]
    SCHEMA = (("topics", Array(struct_of(ListOffsetsTopicResult))),)


# ---- OffsetForLeaderEpoch ---------------------------------------------------------------------
# A follower asks its leader where a leader epoch ended (KIP-101): the answer is the start
# offset of the first later epoch in the leader's log (its log end for the current epoch), with
# the largest epoch the leader knows that is <= the one asked about. The follower truncates its
# log to that offset before fetching, so a divergent tail is cut at a known point, never guessed.
@dataclass(slots=True)
class EpochQuery(Message):
    partition: int
    leader_epoch: int
    SCHEMA = (("partition", INT32), ("leader_epoch", INT32))


@dataclass(slots=True)
class EpochQueryTopic(Message):
    name: str
    partitions: list[EpochQuery]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(EpochQuery))))


@dataclass(slots=True)
class OffsetForLeaderEpochRequest(Message):
    replica_id: int
    topics: list[EpochQueryTopic]
    SCHEMA = (("replica_id", INT32), ("topics", Array(struct_of(EpochQueryTopic))))


@dataclass(slots=True)
class EpochEndOffset(Message):
    partition: int
    error_code: int
    leader_epoch: int
    end_offset: int
    SCHEMA = (
        ("partition", INT32),
        ("error_code", INT16),
        ("leader_epoch", INT32),
        ("end_offset", INT64),
    )


@dataclass(slots=True)
class EpochEndOffsetTopic(Message):
    name: str
    partitions: list[EpochEndOffset]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(EpochEndOffset))))


@dataclass(slots=True)
class OffsetForLeaderEpochResponse(Message):
    topics: list[EpochEndOffsetTopic]
    SCHEMA = (("topics", Array(struct_of(EpochEndOffsetTopic))),)


# ---- Consumer groups (docs/groups.md) ---------------------------------------------------------
# Generation -1 with member id "" marks a commit from outside the group protocol (a consumer
# that uses ``assign``); the coordinator accepts it only while the group has no members.
NO_GENERATION = -1
CONSUMER_PROTOCOL_TYPE = "consumer"


COORDINATOR_GROUP = 0
COORDINATOR_TRANSACTION = 1


@dataclass(slots=True)
class FindCoordinatorRequest(Message):
    key: str  # the group id, or the transactional.id
    key_type: int = COORDINATOR_GROUP  # COORDINATOR_GROUP / COORDINATOR_TRANSACTION
    SCHEMA = (("key", STRING), ("key_type", INT8))


@dataclass(slots=True)
class FindCoordinatorResponse(Message):
    error_code: int
    agent_id: int
    host: str
    port: int
    SCHEMA = (("error_code", INT16), ("agent_id", INT32), ("host", STRING), ("port", INT32))


@dataclass(slots=True)
class JoinGroupProtocol(Message):
    name: str  # an assignor: "range", "roundrobin", "cooperative-sticky"
    metadata: Any  # a ConsumerSubscription, encoded
    SCHEMA = (("name", STRING), ("metadata", BYTES))


@dataclass(slots=True)
class JoinGroupRequest(Message):
    group_id: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    member_id: str  # "" on the first join: the coordinator gives one
    group_instance_id: str | None  # static membership
    protocol_type: str
    protocols: list[JoinGroupProtocol]
    # the subscription's filter, canonical text (storage.filters); every member of a group
    # has the same one (INCONSISTENT_FILTER otherwise); None: every record
    filter: str | None = None
    SCHEMA = (
        ("group_id", STRING),
        ("session_timeout_ms", INT32),
        ("rebalance_timeout_ms", INT32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
        ("protocol_type", STRING),
        ("protocols", Array(struct_of(JoinGroupProtocol))),
        ("filter", STRING),
    )


@dataclass(slots=True)
class JoinGroupMember(Message):
    member_id: str
    group_instance_id: str | None
    metadata: Any
    SCHEMA = (("member_id", STRING), ("group_instance_id", STRING), ("metadata", BYTES))


@dataclass(slots=True)
class JoinGroupResponse(Message):
    error_code: int
    generation_id: int
    protocol_name: str | None
    leader: str
    member_id: str
    members: list[JoinGroupMember]  # the leader gets every member; the others an empty list
    SCHEMA = (
        ("error_code", INT16),
        ("generation_id", INT32),
        ("protocol_name", STRING),
        ("leader", STRING),
        ("member_id", STRING),
        ("members", Array(struct_of(JoinGroupMember))),
    )


@dataclass(slots=True)
class SyncGroupAssignment(Message):
    member_id: str
    assignment: Any  # a ConsumerAssignment, encoded
    SCHEMA = (("member_id", STRING), ("assignment", BYTES))


@dataclass(slots=True)
class SyncGroupRequest(Message):
    group_id: str
    generation_id: int
    member_id: str
    group_instance_id: str | None
    assignments: list[SyncGroupAssignment]  # from the leader only
    SCHEMA = (
        ("group_id", STRING),
        ("generation_id", INT32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
        ("assignments", Array(struct_of(SyncGroupAssignment))),
    )


@dataclass(slots=True)
class SyncGroupResponse(Message):
    error_code: int
    assignment: Any
    SCHEMA = (("error_code", INT16), ("assignment", BYTES))


@dataclass(slots=True)
class HeartbeatRequest(Message):
    group_id: str
    generation_id: int
    member_id: str
    group_instance_id: str | None
    SCHEMA = (
        ("group_id", STRING),
        ("generation_id", INT32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
    )


@dataclass(slots=True)
class HeartbeatResponse(Message):
    error_code: int
    SCHEMA = (("error_code", INT16),)


@dataclass(slots=True)
class LeaveGroupRequest(Message):
    group_id: str
    member_id: str
    group_instance_id: str | None
    SCHEMA = (("group_id", STRING), ("member_id", STRING), ("group_instance_id", STRING))


@dataclass(slots=True)
class LeaveGroupResponse(Message):
    error_code: int
    SCHEMA = (("error_code", INT16),)


@dataclass(slots=True)
class OffsetCommitPartition(Message):
    partition: int
    offset: int  # the next offset to read (Kafka's rule)
    metadata: str | None
    SCHEMA = (("partition", INT32), ("offset", INT64), ("metadata", STRING))


@dataclass(slots=True)
class OffsetCommitTopic(Message):
    name: str
    partitions: list[OffsetCommitPartition]
    topic_id: str | None = None  # null: by name only (the offsets go to the current incarnation)
    SCHEMA = (
        ("name", STRING),
        ("partitions", Array(struct_of(OffsetCommitPartition))),
        ("topic_id", STRING),
    )


@dataclass(slots=True)
class OffsetCommitRequest(Message):
    group_id: str
    generation_id: int  # NO_GENERATION (-1) with member_id "": a commit from outside the group
    member_id: str
    group_instance_id: str | None
    topics: list[OffsetCommitTopic]
    SCHEMA = (
        ("group_id", STRING),
        ("generation_id", INT32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
        ("topics", Array(struct_of(OffsetCommitTopic))),
    )


@dataclass(slots=True)
class OffsetCommitPartitionResult(Message):
    partition: int
    error_code: int
    SCHEMA = (("partition", INT32), ("error_code", INT16))


@dataclass(slots=True)
class OffsetCommitTopicResult(Message):
    name: str
    partitions: list[OffsetCommitPartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(OffsetCommitPartitionResult))))


@dataclass(slots=True)
class OffsetCommitResponse(Message):
    topics: list[OffsetCommitTopicResult]
    SCHEMA = (("topics", Array(struct_of(OffsetCommitTopicResult))),)


@dataclass(slots=True)
class OffsetFetchTopic(Message):
    name: str
    partitions: list[int]
    SCHEMA = (("name", STRING), ("partitions", Array(INT32)))


@dataclass(slots=True)
class OffsetFetchRequest(Message):
    group_id: str
    topics: list[OffsetFetchTopic] | None  # None = every committed partition
    # 1: a partition with a transaction's offsets not yet settled answers
    # UNSTABLE_OFFSET_COMMIT (retriable) instead of the last committed offset (KIP-447)
    require_stable: int = 0
    SCHEMA = (
        ("group_id", STRING),
        ("topics", Array(struct_of(OffsetFetchTopic))),
        ("require_stable", INT8),
    )


@dataclass(slots=True)
class OffsetFetchPartitionResult(Message):
    partition: int
    offset: int  # -1: nothing committed
    metadata: str | None
    error_code: int
    SCHEMA = (
        ("partition", INT32),
        ("offset", INT64),
        ("metadata", STRING),
        ("error_code", INT16),
    )


@dataclass(slots=True)
class OffsetFetchTopicResult(Message):
    name: str
    partitions: list[OffsetFetchPartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(OffsetFetchPartitionResult))))


@dataclass(slots=True)
class OffsetFetchResponse(Message):
    error_code: int
    topics: list[OffsetFetchTopicResult]
    SCHEMA = (("error_code", INT16), ("topics", Array(struct_of(OffsetFetchTopicResult))))


# ---- ConsumerProgress (docs/retries.md, "Poison messages and crashes") ---------------------------
# A member with retries says, before handing records out, which offsets of which partitions
# it is about to process; the coordinator keeps that in memory and, if the member's session
# expires (a crash, not a leave), counts one crash against those ranges ("suspects", kept
# with the group). The answer lists the group's suspects, so a new owner learns them.
@dataclass(slots=True)
class ProgressPartition(Message):
    partition: int
    first_offset: int
    end_offset: int  # exclusive
    SCHEMA = (("partition", INT32), ("first_offset", INT64), ("end_offset", INT64))


@dataclass(slots=True)
class ProgressTopic(Message):
    name: str
    partitions: list[ProgressPartition]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(ProgressPartition))))


@dataclass(slots=True)
class AskedTopic(Message):
    name: str
    partitions: list[int]
    SCHEMA = (("name", STRING), ("partitions", Array(INT32)))


@dataclass(slots=True)
class ConsumerProgressRequest(Message):
    group_id: str
    generation_id: int
    member_id: str
    topics: list[ProgressTopic]  # in flight now: every range of an earlier note is done
    # the partitions whose suspects the member wants back (its assignment, when it learns them)
    asked: list[AskedTopic] = field(default_factory=list)
    SCHEMA = (
        ("group_id", STRING),
        ("generation_id", INT32),
        ("member_id", STRING),
        ("topics", Array(struct_of(ProgressTopic))),
        ("asked", Array(struct_of(AskedTopic))),
    )


@dataclass(slots=True)
class Suspect(Message):
    topic: str
    partition: int
    first_offset: int
    end_offset: int
    crashes: int  # sessions that expired while these offsets were in flight
    pinned: int  # 1: the last crash had this one record in flight and nothing else
    SCHEMA = (
        ("topic", STRING),
        ("partition", INT32),
        ("first_offset", INT64),
        ("end_offset", INT64),
        ("crashes", INT32),
        ("pinned", INT8),
    )


@dataclass(slots=True)
class ConsumerProgressResponse(Message):
    error_code: int
    suspects: list[Suspect]
    SCHEMA = (("error_code", INT16), ("suspects", Array(struct_of(Suspect))))


# ---- Transactions (docs/transactions.md) -------------------------------------------------------
# Producer side: InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn and EndTxn go to the
# transaction coordinator (FindCoordinator with key_type 1), TxnOffsetCommit to the group's
# coordinator. WriteTxnMarkers is sent by a transaction coordinator to partition leaders and
# group coordinators.
NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1


@dataclass(slots=True)
class InitProducerIdRequest(Message):
    transactional_id: str | None
    transaction_timeout_ms: int
    # the producer's current id and epoch after an abortable error (-1: a new session)
    producer_id: int = NO_PRODUCER_ID
    producer_epoch: int = NO_PRODUCER_EPOCH
    SCHEMA = (
        ("transactional_id", STRING),
        ("transaction_timeout_ms", INT32),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
    )


@dataclass(slots=True)
class InitProducerIdResponse(Message):
    error_code: int
    producer_id: int
    producer_epoch: int
    error_message: str | None = None
    SCHEMA = (
        ("error_code", INT16),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("error_message", STRING),
    )


@dataclass(slots=True)
class TxnTopic(Message):
    name: str
    partitions: list[int]
    SCHEMA = (("name", STRING), ("partitions", Array(INT32)))


@dataclass(slots=True)
class AddPartitionsToTxnRequest(Message):
    transactional_id: str
    producer_id: int
    producer_epoch: int
    topics: list[TxnTopic]
    SCHEMA = (
        ("transactional_id", STRING),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("topics", Array(struct_of(TxnTopic))),
    )


@dataclass(slots=True)
class TxnPartitionResult(Message):
    partition: int
    error_code: int
    SCHEMA = (("partition", INT32), ("error_code", INT16))


@dataclass(slots=True)
class TxnTopicResult(Message):
    name: str
    partitions: list[TxnPartitionResult]
    SCHEMA = (("name", STRING), ("partitions", Array(struct_of(TxnPartitionResult))))


@dataclass(slots=True)
class AddPartitionsToTxnResponse(Message):
    error_code: int  # for the whole request; the partitions' codes say the same
    topics: list[TxnTopicResult]
    error_message: str | None = None
    SCHEMA = (
        ("error_code", INT16),
        ("topics", Array(struct_of(TxnTopicResult))),
        ("error_message", STRING),
    )


@dataclass(slots=True)
class AddOffsetsToTxnRequest(Message):
    transactional_id: str
    producer_id: int
    producer_epoch: int
    group_id: str
    SCHEMA = (
        ("transactional_id", STRING),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("group_id", STRING),
    )


@dataclass(slots=True)
class AddOffsetsToTxnResponse(Message):
    error_code: int
    error_message: str | None = None
    SCHEMA = (("error_code", INT16), ("error_message", STRING))


@dataclass(slots=True)
class EndTxnRequest(Message):
    transactional_id: str
    producer_id: int
    producer_epoch: int
    committed: int  # 1 commit, 0 abort
    SCHEMA = (
        ("transactional_id", STRING),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("committed", INT8),
    )


@dataclass(slots=True)
class EndTxnResponse(Message):
    error_code: int
    # the producer's id and epoch for its next transaction (an abort bumps the epoch)
    producer_id: int
    producer_epoch: int
    error_message: str | None = None
    SCHEMA = (
        ("error_code", INT16),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("error_message", STRING),
    )


@dataclass(slots=True)
class TxnMarker(Message):
    producer_id: int
    producer_epoch: int
    committed: int  # 1 commit, 0 abort
    coordinator_epoch: int  # the decision's token (docs/transactions.md)
    topics: list[TxnTopic]
    groups: list[str]  # groups whose transactional offsets the transaction commits or drops
    SCHEMA = (
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("committed", INT8),
        ("coordinator_epoch", INT32),
        ("topics", Array(struct_of(TxnTopic))),
        ("groups", Array(STRING)),
    )


@dataclass(slots=True)
class WriteTxnMarkersRequest(Message):
    markers: list[TxnMarker]
    SCHEMA = (("markers", Array(struct_of(TxnMarker))),)


@dataclass(slots=True)
class TxnGroupResult(Message):
    group_id: str
    error_code: int
    SCHEMA = (("group_id", STRING), ("error_code", INT16))


@dataclass(slots=True)
class TxnMarkerResult(Message):
    producer_id: int
    topics: list[TxnTopicResult]
    groups: list[TxnGroupResult]
    SCHEMA = (
        ("producer_id", INT64),
        ("topics", Array(struct_of(TxnTopicResult))),
        ("groups", Array(struct_of(TxnGroupResult))),
    )


@dataclass(slots=True)
class WriteTxnMarkersResponse(Message):
    markers: list[TxnMarkerResult]
    SCHEMA = (("markers", Array(struct_of(TxnMarkerResult))),)


@dataclass(slots=True)
class TxnOffsetCommitRequest(Message):
    transactional_id: str
    group_id: str
    producer_id: int
    producer_epoch: int
    generation_id: int  # the consumer's group metadata (NO_GENERATION: outside the group)
    member_id: str
    group_instance_id: str | None
    topics: list[OffsetCommitTopic]
    SCHEMA = (
        ("transactional_id", STRING),
        ("group_id", STRING),
        ("producer_id", INT64),
        ("producer_epoch", INT16),
        ("generation_id", INT32),
        ("member_id", STRING),
        ("group_instance_id", STRING),
        ("topics", Array(struct_of(OffsetCommitTopic))),
    )


@dataclass(slots=True)
class TxnOffsetCommitResponse(Message):
    topics: list[OffsetCommitTopicResult]
    SCHEMA = (("topics", Array(struct_of(OffsetCommitTopicResult))),)


# ---- SaslHandshake / SaslAuthenticate (docs/security.md) --------------------------------------
# Kafka's v1 exchange: the handshake names the mechanism, then each SASL token travels in a
# SaslAuthenticate request and its answer. Until it succeeds a SASL listener serves nothing
# but ApiVersions and these two.
@dataclass(slots=True)
class SaslHandshakeRequest(Message):
    mechanism: str
    SCHEMA = (("mechanism", STRING),)


@dataclass(slots=True)
class SaslHandshakeResponse(Message):
    error_code: int
    mechanisms: list[str]
    SCHEMA = (("error_code", INT16), ("mechanisms", Array(STRING)))


@dataclass(slots=True)
class SaslAuthenticateRequest(Message):
    auth_bytes: bytes
    SCHEMA = (("auth_bytes", BYTES),)


@dataclass(slots=True)
class SaslAuthenticateResponse(Message):
    error_code: int
    error_message: str | None
    auth_bytes: bytes
    session_lifetime_ms: int
    SCHEMA = (
        ("error_code", INT16),
        ("error_message", STRING),
        ("auth_bytes", BYTES),
        ("session_lifetime_ms", INT64),
    )


@dataclass(frozen=True, slots=True)
class Api:
    key: ApiKey
    request: type[Message]
    response: type[Message]
    min_version: int = 0
    max_version: int = 0


APIS: dict[int, Api] = {
    a.key: a
    for a in (
        Api(ApiKey.API_VERSIONS, ApiVersionsRequest, ApiVersionsResponse),
        Api(ApiKey.METADATA, MetadataRequest, MetadataResponse),
        Api(ApiKey.PRODUCE, ProduceRequest, ProduceResponse),
        Api(ApiKey.FETCH, FetchRequest, FetchResponse),
        Api(ApiKey.LIST_OFFSETS, ListOffsetsRequest, ListOffsetsResponse),
        Api(ApiKey.OFFSET_COMMIT, OffsetCommitRequest, OffsetCommitResponse),
        Api(ApiKey.OFFSET_FETCH, OffsetFetchRequest, OffsetFetchResponse),
        Api(ApiKey.FIND_COORDINATOR, FindCoordinatorRequest, FindCoordinatorResponse),
        Api(ApiKey.JOIN_GROUP, JoinGroupRequest, JoinGroupResponse),
        Api(ApiKey.HEARTBEAT, HeartbeatRequest, HeartbeatResponse),
        Api(ApiKey.LEAVE_GROUP, LeaveGroupRequest, LeaveGroupResponse),
        Api(ApiKey.SYNC_GROUP, SyncGroupRequest, SyncGroupResponse),
        Api(ApiKey.SASL_HANDSHAKE, SaslHandshakeRequest, SaslHandshakeResponse),
        Api(ApiKey.SASL_AUTHENTICATE, SaslAuthenticateRequest, SaslAuthenticateResponse),
        Api(
            ApiKey.OFFSET_FOR_LEADER_EPOCH,
            OffsetForLeaderEpochRequest,
            OffsetForLeaderEpochResponse,
        ),
        Api(ApiKey.INIT_PRODUCER_ID, InitProducerIdRequest, InitProducerIdResponse),
        Api(ApiKey.ADD_PARTITIONS_TO_TXN, AddPartitionsToTxnRequest, AddPartitionsToTxnResponse),
        Api(ApiKey.ADD_OFFSETS_TO_TXN, AddOffsetsToTxnRequest, AddOffsetsToTxnResponse),
        Api(ApiKey.END_TXN, EndTxnRequest, EndTxnResponse),
        Api(ApiKey.WRITE_TXN_MARKERS, WriteTxnMarkersRequest, WriteTxnMarkersResponse),
        Api(ApiKey.TXN_OFFSET_COMMIT, TxnOffsetCommitRequest, TxnOffsetCommitResponse),
        Api(ApiKey.CONSUMER_PROGRESS, ConsumerProgressRequest, ConsumerProgressResponse),
    )
}
