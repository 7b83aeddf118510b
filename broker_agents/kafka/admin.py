"""Kafka's topic admin APIs (CreateTopics, DeleteTopics, CreatePartitions, DescribeConfigs)
over the same ZooKeeper records as the admin API (``handlers/admin.py``).

Like the admin API, these write topic specs only (``/topics/<name>``); the controller
creates the partition states. They apply the same rules (``storage.metadata.topic_rules``:
the replication factor's default of min(3, live agents), min.insync.replicas against it) and
Kafka's dotted config names, which are Strata's. DeleteTopics marks the topic as the admin
API does (``MetadataStore.mark_deleted``, step 1 of ``docs/operations.md``'s delete) and the
controller deletes it; from then on the topic is unknown to Kafka clients
(``UNKNOWN_TOPIC_OR_PARTITION``, as in KRaft Kafka), and creating the name again is refused
with ``TOPIC_ALREADY_EXISTS`` until the delete completes (as Kafka refuses a name marked for
deletion). With ``authorizer.enable`` each topic is checked as Kafka checks it: Create on the
topic (or on the cluster) to create it, Delete to delete it, Alter to add partitions,
Describe to read its configs; a refusal is that topic's TOPIC_AUTHORIZATION_FAILED (the
others in the request go on). Not supported: explicit replica assignments
(``INVALID_REQUEST``; the controller places replicas), broker configs (DescribeConfigs of a
broker answers an empty list).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from storage.errors import (
    InvalidPartitionsError,
    InvalidRequestError,
    StrataError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
    VersionConflictError,
)
from storage.kafka.errors import code_of
from storage.metadata import MetadataStore, TopicConfig, TopicSpec
from storage.metadata.acls import CLUSTER_NAME, Operation, ResourceType
from storage.metadata.models import validate_topic_name
from storage.metadata.topic_rules import check_min_insync, replication_factor_for

if TYPE_CHECKING:
    from broker_agents.security.guard import Authorizer

TOPIC_RESOURCE = 2
BROKER_RESOURCE = 4
CONFIG_SOURCE_TOPIC = 1
CONFIG_SOURCE_DEFAULT = 5
CAS_ATTEMPTS = 5
_DEFAULTS = TopicConfig().to_wire()


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class KafkaTopicAdmin:
    def __init__(self, store: MetadataStore, authorizer: Authorizer | None = None) -> None:
        self.store = store
        self.authorizer = authorizer

    def _require(self, op: Operation, topic: str) -> None:
        az = self.authorizer
        if az is None or az.allows(op, ResourceType.TOPIC, topic):
            return
        if op is Operation.CREATE and az.allows_quietly(op, ResourceType.CLUSTER, CLUSTER_NAME):
            return  # Kafka: Create on the cluster covers every topic
        raise TopicAuthorizationFailedError(f"not authorized to {op} topic {topic!r}")

    async def create_topics(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        results = []
        for t in req["topics"]:
            name = t["name"]
            try:
                self._require(Operation.CREATE, name)
                await self._create(t, req["validate_only"])
                results.append({"name": name, "error_code": 0})
            except StrataError as exc:
                results.append(
                    {"name": name, "error_code": code_of(exc), "error_message": str(exc)[:500]}
                )
        return {"topics": results}

    async def _create(self, t: dict[str, Any], validate_only: bool) -> None:
        name = validate_topic_name(t["name"])
        if t["assignments"]:
            raise InvalidRequestError("replica assignments are chosen by the controller")
        partitions = t["num_partitions"] if t["num_partitions"] != -1 else 1
        if partitions < 1:
            raise InvalidPartitionsError(f"a topic needs at least one partition, not {partitions}")
        config = TopicConfig.parse({c["name"]: c["value"] for c in t["configs"]})
        live = len(await self.store.list_agents())
        rf_asked = t["replication_factor"]
        rf = replication_factor_for(None if rf_asked == -1 else rf_asked, live)
        check_min_insync(config, rf)
        spec = TopicSpec.build(
            name=name,
            partitions=partitions,
            replication_factor=rf,
            config=config,
            topic_id=uuid.uuid4().hex,
            created_ms=int(time.time() * 1000),
        )
        if not validate_only:
            await self.store.create_topic(spec)

    async def delete_topics(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        results = []
        for name in req["topic_names"]:
            try:
                self._require(Operation.DELETE, name)
                await self.store.mark_deleted(validate_topic_name(name))  # unknown: an error
                results.append({"name": name, "error_code": 0})
            except StrataError as exc:
                results.append({"name": name, "error_code": code_of(exc)})
        return {"responses": results}

    async def create_partitions(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        results = []
        for t in req["topics"]:
            try:
                self._require(Operation.ALTER, t["name"])
                if t["assignments"]:
                    raise InvalidRequestError("replica assignments are chosen by the controller")
                await self._grow(validate_topic_name(t["name"]), t["count"], req["validate_only"])
                results.append({"name": t["name"], "error_code": 0})
            except StrataError as exc:
                results.append(
                    {"name": t["name"], "error_code": code_of(exc), "error_message": str(exc)[:500]}
                )
        return {"results": results}

    async def _grow(self, name: str, count: int, validate_only: bool) -> None:
        for _ in range(CAS_ATTEMPTS):
            spec, stat = await self.store.get_topic(name)
            if spec.deletion is not None:
                raise UnknownTopicOrPartitionError(f"topic {name!r} is being deleted")
            if count <= spec.partitions:
                raise InvalidPartitionsError(
                    f"topic {name!r} has {spec.partitions} partitions; the new count must be"
                    f" greater, got {count}"
                )
            new = TopicSpec.build(**{**dict(spec), "partitions": count})
            if validate_only:
                return
            try:
                await self.store.update_topic(new, stat.version)
                return
            except VersionConflictError:
                continue
        raise VersionConflictError(f"topic {name!r} changed under {CAS_ATTEMPTS} attempts")

    async def describe_configs(self, req: dict[str, Any], version: int) -> dict[str, Any]:
        results = []
        for r in req["resources"]:
            base = {"resource_type": r["resource_type"], "resource_name": r["resource_name"]}
            if r["resource_type"] == BROKER_RESOURCE:
                results.append({**base, "error_code": 0, "configs": []})
                continue
            try:
                if r["resource_type"] != TOPIC_RESOURCE:
                    raise InvalidRequestError(f"config resource type {r['resource_type']}")
                self._require(Operation.DESCRIBE, r["resource_name"])
                spec, _ = await self.store.get_topic(validate_topic_name(r["resource_name"]))
                if spec.deletion is not None:
                    raise UnknownTopicOrPartitionError(f"topic {spec.name!r} is being deleted")
            except StrataError as exc:
                code = code_of(exc)
                if isinstance(exc, UnknownTopicOrPartitionError):
                    code = UnknownTopicOrPartitionError.code
                results.append({**base, "error_code": code, "error_message": str(exc)[:500]})
                continue
            wanted = r["configuration_keys"]
            configs = []
            for key, value in sorted(spec.config.to_wire().items()):
                if wanted is not None and key not in wanted:
                    continue
                default = _DEFAULTS.get(key) == value
                configs.append(
                    {
                        "name": key,
                        "value": _text(value),
                        "read_only": False,
                        "config_source": CONFIG_SOURCE_DEFAULT if default else CONFIG_SOURCE_TOPIC,
                        "is_sensitive": False,
                        "synonyms": [],
                    }
                )
            results.append({**base, "error_code": 0, "configs": configs})
        return {"results": results}
