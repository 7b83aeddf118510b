"""Cluster metadata and state in ZooKeeper: the asyncio adapter, the models, the layout."""

from storage.metadata.models import (
    AgentRegistration,
    ControllerInfo,
    PartitionState,
    TopicConfig,
    TopicSpec,
    validate_topic_name,
)
from storage.metadata.store import MetadataStore
from storage.metadata.zk import AsyncZooKeeper, SessionState

__all__ = [
    "AgentRegistration",
    "AsyncZooKeeper",
    "ControllerInfo",
    "MetadataStore",
    "PartitionState",
    "SessionState",
    "TopicConfig",
    "TopicSpec",
    "validate_topic_name",
]
