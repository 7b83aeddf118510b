"""The Kafka APIs and versions the agents serve: request and response schemas.

Field names, order, version ranges and nullability follow Apache Kafka's message definitions
(``clients/src/main/resources/common/message/*.json``), restricted to the versions in
``SERVED``. Those are the versions today's clients negotiate (librdkafka 2.x, kafka-python,
aiokafka, kcat): each API's highest version before its first *flexible* one, plus
ApiVersions v3 (flexible; librdkafka's first request) and TxnOffsetCommit v3 (flexible: the
first that carries the consumer's group metadata, KIP-447).

``docs/kafka.md`` lists the same table for people.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from storage.kafka.wire import (
    BOOL,
    BYTES,
    INT8,
    INT16,
    INT32,
    INT64,
    RECORDS,
    STRING,
    Array,
    F,
    Schema,
)


class ApiKey(enum.IntEnum):
    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    OFFSET_COMMIT = 8
    OFFSET_FETCH = 9
    FIND_COORDINATOR = 10
    JOIN_GROUP = 11
    HEARTBEAT = 12
    LEAVE_GROUP = 13
    SYNC_GROUP = 14
    DESCRIBE_GROUPS = 15
    LIST_GROUPS = 16
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    DELETE_TOPICS = 20
    INIT_PRODUCER_ID = 22
    ADD_PARTITIONS_TO_TXN = 24
    ADD_OFFSETS_TO_TXN = 25
    END_TXN = 26
    TXN_OFFSET_COMMIT = 28
    DESCRIBE_CONFIGS = 32
    SASL_AUTHENTICATE = 36
    CREATE_PARTITIONS = 37


def S(name: str, *fields: object, flexible: int | None = None) -> Schema:
    return Schema(name, fields, flexible)  # type: ignore[arg-type]


# ---- ApiVersions (18) ------------------------------------------------------------------------
API_VERSIONS_REQUEST = S(
    "ApiVersionsRequest",
    F("client_software_name", STRING, "3+"),
    F("client_software_version", STRING, "3+"),
    flexible=3,
)
API_VERSIONS_RESPONSE = S(
    "ApiVersionsResponse",
    F("error_code", INT16),
    F(
        "api_keys",
        Array(
            S(
                "ApiVersion",
                F("api_key", INT16),
                F("min_version", INT16),
                F("max_version", INT16),
            )
        ),
    ),
    F("throttle_time_ms", INT32, "1+"),
    flexible=3,
)

# ---- Metadata (3) ----------------------------------------------------------------------------
METADATA_REQUEST = S(
    "MetadataRequest",
    F("topics", Array(S("MetadataRequestTopic", F("name", STRING))), nullable="1+"),
    F("allow_auto_topic_creation", BOOL, "4+", default=True),
    F("include_cluster_authorized_operations", BOOL, "8+"),
    F("include_topic_authorized_operations", BOOL, "8+"),
)
METADATA_RESPONSE = S(
    "MetadataResponse",
    F("throttle_time_ms", INT32, "3+"),
    F(
        "brokers",
        Array(
            S(
                "MetadataResponseBroker",
                F("node_id", INT32),
                F("host", STRING),
                F("port", INT32),
                F("rack", STRING, "1+", nullable="1+"),
            )
        ),
    ),
    F("cluster_id", STRING, "2+", nullable="2+", default=None),
    F("controller_id", INT32, "1+", default=-1),
    F(
        "topics",
        Array(
            S(
                "MetadataResponseTopic",
                F("error_code", INT16),
                F("name", STRING),
                F("is_internal", BOOL, "1+"),
                F(
                    "partitions",
                    Array(
                        S(
                            "MetadataResponsePartition",
                            F("error_code", INT16),
                            F("partition_index", INT32),
                            F("leader_id", INT32),
                            F("leader_epoch", INT32, "7+", default=-1),
                            F("replica_nodes", Array(INT32)),
                            F("isr_nodes", Array(INT32)),
                            F("offline_replicas", Array(INT32), "5+"),
                        )
                    ),
                ),
                F("topic_authorized_operations", INT32, "8+", default=-(1 << 31)),
            )
        ),
    ),
    F("cluster_authorized_operations", INT32, "8+", default=-(1 << 31)),
)

# ---- Produce (0) -----------------------------------------------------------------------------
PRODUCE_REQUEST = S(
    "ProduceRequest",
    F("transactional_id", STRING, "3+", nullable="3+", default=None),
    F("acks", INT16),
    F("timeout_ms", INT32),
    F(
        "topic_data",
        Array(
            S(
                "TopicProduceData",
                F("name", STRING),
                F(
                    "partition_data",
                    Array(
                        S(
                            "PartitionProduceData",
                            F("index", INT32),
                            F("records", RECORDS, nullable="0+"),
                        )
                    ),
                ),
            )
        ),
    ),
)
PRODUCE_RESPONSE = S(
    "ProduceResponse",
    F(
        "responses",
        Array(
            S(
                "TopicProduceResponse",
                F("name", STRING),
                F(
                    "partition_responses",
                    Array(
                        S(
                            "PartitionProduceResponse",
                            F("index", INT32),
                            F("error_code", INT16),
                            F("base_offset", INT64),
                            F("log_append_time_ms", INT64, "2+", default=-1),
                            F("log_start_offset", INT64, "5+", default=-1),
                            F(
                                "record_errors",
                                Array(
                                    S(
                                        "BatchIndexAndErrorMessage",
                                        F("batch_index", INT32),
                                        F("batch_index_error_message", STRING, nullable="8+"),
                                    )
                                ),
                                "8+",
                            ),
                            F("error_message", STRING, "8+", nullable="8+", default=None),
                        )
                    ),
                ),
            )
        ),
    ),
    F("throttle_time_ms", INT32, "1+"),
)

# ---- Fetch (1) -------------------------------------------------------------------------------
FETCH_REQUEST = S(
    "FetchRequest",
    F("replica_id", INT32, default=-1),
    F("max_wait_ms", INT32),
    F("min_bytes", INT32),
    F("max_bytes", INT32, "3+", default=0x7FFFFFFF),
    F("isolation_level", INT8, "4+"),
    F("session_id", INT32, "7+"),
    F("session_epoch", INT32, "7+", default=-1),
    F(
        "topics",
        Array(
            S(
                "FetchTopic",
                F("topic", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "FetchPartition",
                            F("partition", INT32),
                            F("current_leader_epoch", INT32, "9+", default=-1),
                            F("fetch_offset", INT64),
                            F("log_start_offset", INT64, "5+", default=-1),
                            F("partition_max_bytes", INT32),
                        )
                    ),
                ),
            )
        ),
    ),
    F(
        "forgotten_topics_data",
        Array(S("ForgottenTopic", F("topic", STRING), F("partitions", Array(INT32)))),
        "7+",
    ),
    F("rack_id", STRING, "11+"),
)
FETCH_RESPONSE = S(
    "FetchResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16, "7+"),
    F("session_id", INT32, "7+"),
    F(
        "responses",
        Array(
            S(
                "FetchableTopicResponse",
                F("topic", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "PartitionData",
                            F("partition_index", INT32),
                            F("error_code", INT16),
                            F("high_watermark", INT64),
                            F("last_stable_offset", INT64, "4+", default=-1),
                            F("log_start_offset", INT64, "5+", default=-1),
                            F(
                                "aborted_transactions",
                                Array(
                                    S(
                                        "AbortedTransaction",
                                        F("producer_id", INT64),
                                        F("first_offset", INT64),
                                    )
                                ),
                                "4+",
                                nullable="4+",
                                default=None,
                            ),
                            F("preferred_read_replica", INT32, "11+", default=-1),
                            F("records", RECORDS, nullable="0+", default=None),
                        )
                    ),
                ),
            )
        ),
    ),
)

# ---- ListOffsets (2) -------------------------------------------------------------------------
LIST_OFFSETS_REQUEST = S(
    "ListOffsetsRequest",
    F("replica_id", INT32),
    F("isolation_level", INT8, "2+"),
    F(
        "topics",
        Array(
            S(
                "ListOffsetsTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "ListOffsetsPartition",
                            F("partition_index", INT32),
                            F("current_leader_epoch", INT32, "4+", default=-1),
                            F("timestamp", INT64),
                        )
                    ),
                ),
            )
        ),
    ),
)
LIST_OFFSETS_RESPONSE = S(
    "ListOffsetsResponse",
    F("throttle_time_ms", INT32, "2+"),
    F(
        "topics",
        Array(
            S(
                "ListOffsetsTopicResponse",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "ListOffsetsPartitionResponse",
                            F("partition_index", INT32),
                            F("error_code", INT16),
                            F("timestamp", INT64, "1+", default=-1),
                            F("offset", INT64, "1+", default=-1),
                            F("leader_epoch", INT32, "4+", default=-1),
                        )
                    ),
                ),
            )
        ),
    ),
)

# ---- FindCoordinator (10) --------------------------------------------------------------------
FIND_COORDINATOR_REQUEST = S(
    "FindCoordinatorRequest",
    F("key", STRING),
    F("key_type", INT8, "1+"),
)
FIND_COORDINATOR_RESPONSE = S(
    "FindCoordinatorResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16),
    F("error_message", STRING, "1+", nullable="1+", default=None),
    F("node_id", INT32, default=-1),
    F("host", STRING),
    F("port", INT32, default=-1),
)

# ---- JoinGroup (11) / SyncGroup (14) / Heartbeat (12) / LeaveGroup (13) ----------------------
JOIN_GROUP_REQUEST = S(
    "JoinGroupRequest",
    F("group_id", STRING),
    F("session_timeout_ms", INT32),
    F("rebalance_timeout_ms", INT32, "1+", default=-1),
    F("member_id", STRING),
    F("group_instance_id", STRING, "5+", nullable="5+", default=None),
    F("protocol_type", STRING),
    F("protocols", Array(S("JoinGroupRequestProtocol", F("name", STRING), F("metadata", BYTES)))),
)
JOIN_GROUP_RESPONSE = S(
    "JoinGroupResponse",
    F("throttle_time_ms", INT32, "2+"),
    F("error_code", INT16),
    F("generation_id", INT32, default=-1),
    F("protocol_name", STRING),
    F("leader", STRING),
    F("member_id", STRING),
    F(
        "members",
        Array(
            S(
                "JoinGroupResponseMember",
                F("member_id", STRING),
                F("group_instance_id", STRING, "5+", nullable="5+", default=None),
                F("metadata", BYTES),
            )
        ),
    ),
)
SYNC_GROUP_REQUEST = S(
    "SyncGroupRequest",
    F("group_id", STRING),
    F("generation_id", INT32),
    F("member_id", STRING),
    F("group_instance_id", STRING, "3+", nullable="3+", default=None),
    F(
        "assignments",
        Array(S("SyncGroupRequestAssignment", F("member_id", STRING), F("assignment", BYTES))),
    ),
)
SYNC_GROUP_RESPONSE = S(
    "SyncGroupResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16),
    F("assignment", BYTES),
)
HEARTBEAT_REQUEST = S(
    "HeartbeatRequest",
    F("group_id", STRING),
    F("generation_id", INT32),
    F("member_id", STRING),
    F("group_instance_id", STRING, "3+", nullable="3+", default=None),
)
HEARTBEAT_RESPONSE = S(
    "HeartbeatResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16),
)
LEAVE_GROUP_REQUEST = S(
    "LeaveGroupRequest",
    F("group_id", STRING),
    F("member_id", STRING, "0-2"),
    F(
        "members",
        Array(
            S(
                "MemberIdentity",
                F("member_id", STRING),
                F("group_instance_id", STRING, nullable="3+", default=None),
            )
        ),
        "3+",
    ),
)
LEAVE_GROUP_RESPONSE = S(
    "LeaveGroupResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16),
    F(
        "members",
        Array(
            S(
                "MemberResponse",
                F("member_id", STRING),
                F("group_instance_id", STRING, nullable="3+", default=None),
                F("error_code", INT16),
            )
        ),
        "3+",
    ),
)

# ---- OffsetCommit (8) / OffsetFetch (9) ------------------------------------------------------
OFFSET_COMMIT_REQUEST = S(
    "OffsetCommitRequest",
    F("group_id", STRING),
    F("generation_id", INT32, "1+", default=-1),
    F("member_id", STRING, "1+"),
    F("group_instance_id", STRING, "7+", nullable="7+", default=None),
    F("retention_time_ms", INT64, "2-4", default=-1),
    F(
        "topics",
        Array(
            S(
                "OffsetCommitRequestTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "OffsetCommitRequestPartition",
                            F("partition_index", INT32),
                            F("committed_offset", INT64),
                            F("committed_leader_epoch", INT32, "6+", default=-1),
                            F("committed_metadata", STRING, nullable="0+"),
                        )
                    ),
                ),
            )
        ),
    ),
)
OFFSET_COMMIT_RESPONSE = S(
    "OffsetCommitResponse",
    F("throttle_time_ms", INT32, "3+"),
    F(
        "topics",
        Array(
            S(
                "OffsetCommitResponseTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "OffsetCommitResponsePartition",
                            F("partition_index", INT32),
                            F("error_code", INT16),
                        )
                    ),
                ),
            )
        ),
    ),
)
OFFSET_FETCH_REQUEST = S(
    "OffsetFetchRequest",
    F("group_id", STRING),
    F(
        "topics",
        Array(
            S("OffsetFetchRequestTopic", F("name", STRING), F("partition_indexes", Array(INT32)))
        ),
        nullable="2+",
    ),
)
OFFSET_FETCH_RESPONSE = S(
    "OffsetFetchResponse",
    F("throttle_time_ms", INT32, "3+"),
    F(
        "topics",
        Array(
            S(
                "OffsetFetchResponseTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "OffsetFetchResponsePartition",
                            F("partition_index", INT32),
                            F("committed_offset", INT64),
                            F("committed_leader_epoch", INT32, "5+", default=-1),
                            F("metadata", STRING, nullable="0+"),
                            F("error_code", INT16),
                        )
                    ),
                ),
            )
        ),
    ),
    F("error_code", INT16, "2+"),
)

# ---- DescribeGroups (15) / ListGroups (16) ---------------------------------------------------
DESCRIBE_GROUPS_REQUEST = S(
    "DescribeGroupsRequest",
    F("groups", Array(STRING)),
    F("include_authorized_operations", BOOL, "3+"),
)
DESCRIBE_GROUPS_RESPONSE = S(
    "DescribeGroupsResponse",
    F("throttle_time_ms", INT32, "1+"),
    F(
        "groups",
        Array(
            S(
                "DescribedGroup",
                F("error_code", INT16),
                F("group_id", STRING),
                F("group_state", STRING),
                F("protocol_type", STRING),
                F("protocol_data", STRING),
                F(
                    "members",
                    Array(
                        S(
                            "DescribedGroupMember",
                            F("member_id", STRING),
                            F("group_instance_id", STRING, "4+", nullable="4+", default=None),
                            F("client_id", STRING),
                            F("client_host", STRING),
                            F("member_metadata", BYTES),
                            F("member_assignment", BYTES),
                        )
                    ),
                ),
                F("authorized_operations", INT32, "3+", default=-(1 << 31)),
            )
        ),
    ),
)
LIST_GROUPS_REQUEST = S("ListGroupsRequest")
LIST_GROUPS_RESPONSE = S(
    "ListGroupsResponse",
    F("throttle_time_ms", INT32, "1+"),
    F("error_code", INT16),
    F("groups", Array(S("ListedGroup", F("group_id", STRING), F("protocol_type", STRING)))),
)

# ---- InitProducerId (22) ---------------------------------------------------------------------
INIT_PRODUCER_ID_REQUEST = S(
    "InitProducerIdRequest",
    F("transactional_id", STRING, nullable="0+", default=None),
    F("transaction_timeout_ms", INT32),
)
INIT_PRODUCER_ID_RESPONSE = S(
    "InitProducerIdResponse",
    F("throttle_time_ms", INT32),
    F("error_code", INT16),
    F("producer_id", INT64, default=-1),
    F("producer_epoch", INT16, default=-1),
)

# ---- AddPartitionsToTxn (24) / AddOffsetsToTxn (25) / EndTxn (26) / TxnOffsetCommit (28) ----
ADD_PARTITIONS_TO_TXN_REQUEST = S(
    "AddPartitionsToTxnRequest",
    F("transactional_id", STRING),
    F("producer_id", INT64),
    F("producer_epoch", INT16),
    F(
        "topics",
        Array(S("AddPartitionsToTxnTopic", F("name", STRING), F("partitions", Array(INT32)))),
    ),
)
ADD_PARTITIONS_TO_TXN_RESPONSE = S(
    "AddPartitionsToTxnResponse",
    F("throttle_time_ms", INT32),
    F(
        "results",
        Array(
            S(
                "AddPartitionsToTxnTopicResult",
                F("name", STRING),
                F(
                    "results",
                    Array(
                        S(
                            "AddPartitionsToTxnPartitionResult",
                            F("partition_index", INT32),
                            F("error_code", INT16),
                        )
                    ),
                ),
            )
        ),
    ),
)
ADD_OFFSETS_TO_TXN_REQUEST = S(
    "AddOffsetsToTxnRequest",
    F("transactional_id", STRING),
    F("producer_id", INT64),
    F("producer_epoch", INT16),
    F("group_id", STRING),
)
ADD_OFFSETS_TO_TXN_RESPONSE = S(
    "AddOffsetsToTxnResponse", F("throttle_time_ms", INT32), F("error_code", INT16)
)
END_TXN_REQUEST = S(
    "EndTxnRequest",
    F("transactional_id", STRING),
    F("producer_id", INT64),
    F("producer_epoch", INT16),
    F("committed", BOOL),
)
END_TXN_RESPONSE = S("EndTxnResponse", F("throttle_time_ms", INT32), F("error_code", INT16))
TXN_OFFSET_COMMIT_REQUEST = S(
    "TxnOffsetCommitRequest",
    F("transactional_id", STRING),
    F("group_id", STRING),
    F("producer_id", INT64),
    F("producer_epoch", INT16),
    F("generation_id", INT32, "3+", default=-1),
    F("member_id", STRING, "3+", default=""),
    F("group_instance_id", STRING, "3+", nullable="3+", default=None),
    F(
        "topics",
        Array(
            S(
                "TxnOffsetCommitRequestTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "TxnOffsetCommitRequestPartition",
                            F("partition_index", INT32),
                            F("committed_offset", INT64),
                            F("committed_leader_epoch", INT32, "2+", default=-1),
                            F("committed_metadata", STRING, nullable="0+"),
                        )
                    ),
                ),
            )
        ),
    ),
    flexible=3,
)
TXN_OFFSET_COMMIT_RESPONSE = S(
    "TxnOffsetCommitResponse",
    F("throttle_time_ms", INT32),
    F(
        "topics",
        Array(
            S(
                "TxnOffsetCommitResponseTopic",
                F("name", STRING),
                F(
                    "partitions",
                    Array(
                        S(
                            "TxnOffsetCommitResponsePartition",
                            F("partition_index", INT32),
                            F("error_code", INT16),
                        )
                    ),
                ),
            )
        ),
    ),
    flexible=3,
)

# ---- CreateTopics (19) / DeleteTopics (20) / CreatePartitions (37) ---------------------------
CREATE_TOPICS_REQUEST = S(
    "CreateTopicsRequest",
    F(
        "topics",
        Array(
            S(
                "CreatableTopic",
                F("name", STRING),
                F("num_partitions", INT32),
                F("replication_factor", INT16),
                F(
                    "assignments",
                    Array(
                        S(
                            "CreatableReplicaAssignment",
                            F("partition_index", INT32),
                            F("broker_ids", Array(INT32)),
                        )
                    ),
                ),
                F(
                    "configs",
                    Array(
                        S(
                            "CreatableTopicConfig",
                            F("name", STRING),
                            F("value", STRING, nullable="0+"),
                        )
                    ),
                ),
            )
        ),
    ),
    F("timeout_ms", INT32, default=60000),
    F("validate_only", BOOL, "1+"),
)
CREATE_TOPICS_RESPONSE = S(
    "CreateTopicsResponse",
    F("throttle_time_ms", INT32, "2+"),
    F(
        "topics",
        Array(
            S(
                "CreatableTopicResult",
                F("name", STRING),
                F("error_code", INT16),
                F("error_message", STRING, "1+", nullable="0+", default=None),
            )
        ),
    ),
)
DELETE_TOPICS_REQUEST = S(
    "DeleteTopicsRequest",
    F("topic_names", Array(STRING)),
    F("timeout_ms", INT32),
)
DELETE_TOPICS_RESPONSE = S(
    "DeleteTopicsResponse",
    F("throttle_time_ms", INT32, "1+"),
    F(
        "responses",
        Array(S("DeletableTopicResult", F("name", STRING), F("error_code", INT16))),
    ),
)
CREATE_PARTITIONS_REQUEST = S(
    "CreatePartitionsRequest",
    F(
        "topics",
        Array(
            S(
                "CreatePartitionsTopic",
                F("name", STRING),
                F("count", INT32),
                F(
                    "assignments",
                    Array(S("CreatePartitionsAssignment", F("broker_ids", Array(INT32)))),
                    nullable="0+",
                    default=None,
                ),
            )
        ),
    ),
    F("timeout_ms", INT32),
    F("validate_only", BOOL),
)
CREATE_PARTITIONS_RESPONSE = S(
    "CreatePartitionsResponse",
    F("throttle_time_ms", INT32),
    F(
        "results",
        Array(
            S(
                "CreatePartitionsTopicResult",
                F("name", STRING),
                F("error_code", INT16),
                F("error_message", STRING, nullable="0+", default=None),
            )
        ),
    ),
)

# ---- DescribeConfigs (32) --------------------------------------------------------------------
DESCRIBE_CONFIGS_REQUEST = S(
    "DescribeConfigsRequest",
    F(
        "resources",
        Array(
            S(
                "DescribeConfigsResource",
                F("resource_type", INT8),
                F("resource_name", STRING),
                F("configuration_keys", Array(STRING), nullable="0+", default=None),
            )
        ),
    ),
    F("include_synonyms", BOOL, "1+"),
    F("include_documentation", BOOL, "3+"),
)
DESCRIBE_CONFIGS_RESPONSE = S(
    "DescribeConfigsResponse",
    F("throttle_time_ms", INT32),
    F(
        "results",
        Array(
            S(
                "DescribeConfigsResult",
                F("error_code", INT16),
                F("error_message", STRING, nullable="0+", default=None),
                F("resource_type", INT8),
                F("resource_name", STRING),
                F(
                    "configs",
                    Array(
                        S(
                            "DescribeConfigsResourceResult",
                            F("name", STRING),
                            F("value", STRING, nullable="0+", default=None),
                            F("read_only", BOOL),
                            F("config_source", INT8, "1+", default=-1),
                            F("is_default", BOOL, "0"),
                            F("is_sensitive", BOOL),
                            F(
                                "synonyms",
                                Array(
                                    S(
                                        "DescribeConfigsSynonym",
                                        F("name", STRING),
                                        F("value", STRING, nullable="0+", default=None),
                                        F("source", INT8),
                                    )
                                ),
                                "1+",
                            ),
                            F("config_type", INT8, "3+"),
                            F("documentation", STRING, "3+", nullable="0+", default=None),
                        )
                    ),
                ),
            )
        ),
    ),
)


# ---- SaslHandshake (17) / SaslAuthenticate (36) ---------------------------------------------
# v1 only for the handshake: v0 sends the SASL tokens unframed after it, which is not served.
SASL_HANDSHAKE_REQUEST = S("SaslHandshakeRequest", F("mechanism", STRING))
SASL_HANDSHAKE_RESPONSE = S(
    "SaslHandshakeResponse", F("error_code", INT16), F("mechanisms", Array(STRING))
)
SASL_AUTHENTICATE_REQUEST = S("SaslAuthenticateRequest", F("auth_bytes", BYTES))
SASL_AUTHENTICATE_RESPONSE = S(
    "SaslAuthenticateResponse",
    F("error_code", INT16),
    F("error_message", STRING, nullable="0+", default=None),
    F("auth_bytes", BYTES, default=b""),
    F("session_lifetime_ms", INT64, "1+"),
)


@dataclass(frozen=True, slots=True)
class Api:
    key: ApiKey
    min_version: int
    max_version: int
    request: Schema
    response: Schema

    def request_header_version(self, version: int) -> int:
        """2 (with tagged fields) for flexible requests, else 1."""
        return 2 if self.request.is_flexible(version) else 1

    def response_header_version(self, version: int) -> int:
        """1 for flexible responses, except ApiVersions' (always 0: a client that sent an
        unsupported version must still be able to read the answer)."""
        if self.key == ApiKey.API_VERSIONS:
            return 0
        return 1 if self.response.is_flexible(version) else 0


SERVED: dict[int, Api] = {
    a.key: a
    for a in (
        Api(ApiKey.PRODUCE, 3, 8, PRODUCE_REQUEST, PRODUCE_RESPONSE),
        Api(ApiKey.FETCH, 4, 11, FETCH_REQUEST, FETCH_RESPONSE),
        Api(ApiKey.LIST_OFFSETS, 1, 5, LIST_OFFSETS_REQUEST, LIST_OFFSETS_RESPONSE),
        Api(ApiKey.METADATA, 0, 8, METADATA_REQUEST, METADATA_RESPONSE),
        Api(ApiKey.OFFSET_COMMIT, 2, 7, OFFSET_COMMIT_REQUEST, OFFSET_COMMIT_RESPONSE),
        Api(ApiKey.OFFSET_FETCH, 1, 5, OFFSET_FETCH_REQUEST, OFFSET_FETCH_RESPONSE),
        Api(ApiKey.FIND_COORDINATOR, 0, 2, FIND_COORDINATOR_REQUEST, FIND_COORDINATOR_RESPONSE),
        Api(ApiKey.JOIN_GROUP, 0, 5, JOIN_GROUP_REQUEST, JOIN_GROUP_RESPONSE),
        Api(ApiKey.HEARTBEAT, 0, 3, HEARTBEAT_REQUEST, HEARTBEAT_RESPONSE),
        Api(ApiKey.LEAVE_GROUP, 0, 3, LEAVE_GROUP_REQUEST, LEAVE_GROUP_RESPONSE),
        Api(ApiKey.SYNC_GROUP, 0, 3, SYNC_GROUP_REQUEST, SYNC_GROUP_RESPONSE),
        Api(ApiKey.DESCRIBE_GROUPS, 0, 4, DESCRIBE_GROUPS_REQUEST, DESCRIBE_GROUPS_RESPONSE),
        Api(ApiKey.LIST_GROUPS, 0, 2, LIST_GROUPS_REQUEST, LIST_GROUPS_RESPONSE),
        Api(ApiKey.API_VERSIONS, 0, 3, API_VERSIONS_REQUEST, API_VERSIONS_RESPONSE),
        Api(ApiKey.SASL_HANDSHAKE, 1, 1, SASL_HANDSHAKE_REQUEST, SASL_HANDSHAKE_RESPONSE),
        Api(
            ApiKey.SASL_AUTHENTICATE,
            0,
            1,
            SASL_AUTHENTICATE_REQUEST,
            SASL_AUTHENTICATE_RESPONSE,
        ),
        Api(ApiKey.CREATE_TOPICS, 2, 4, CREATE_TOPICS_REQUEST, CREATE_TOPICS_RESPONSE),
        Api(ApiKey.DELETE_TOPICS, 1, 3, DELETE_TOPICS_REQUEST, DELETE_TOPICS_RESPONSE),
        Api(ApiKey.INIT_PRODUCER_ID, 0, 1, INIT_PRODUCER_ID_REQUEST, INIT_PRODUCER_ID_RESPONSE),
        Api(
            ApiKey.ADD_PARTITIONS_TO_TXN,
            0,
            2,
            ADD_PARTITIONS_TO_TXN_REQUEST,
            ADD_PARTITIONS_TO_TXN_RESPONSE,
        ),
        Api(
            ApiKey.ADD_OFFSETS_TO_TXN,
            0,
            2,
            ADD_OFFSETS_TO_TXN_REQUEST,
            ADD_OFFSETS_TO_TXN_RESPONSE,
        ),
        Api(ApiKey.END_TXN, 0, 2, END_TXN_REQUEST, END_TXN_RESPONSE),
        Api(
            ApiKey.TXN_OFFSET_COMMIT,
            0,
            3,
            TXN_OFFSET_COMMIT_REQUEST,
            TXN_OFFSET_COMMIT_RESPONSE,
        ),
        Api(ApiKey.DESCRIBE_CONFIGS, 1, 3, DESCRIBE_CONFIGS_REQUEST, DESCRIBE_CONFIGS_RESPONSE),
        Api(
            ApiKey.CREATE_PARTITIONS,
            0,
            1,
            CREATE_PARTITIONS_REQUEST,
            CREATE_PARTITIONS_RESPONSE,
        ),
    )
}
