"""What Strata keeps in ZooKeeper, as validated pydantic models (stored as JSON).

Topic configs accept Kafka's dotted names (``retention.ms``, ``min.insync.replicas``); a bad
name or value raises ``InvalidConfigError`` / ``InvalidTopicError`` with the reason.

**Mixed versions.** During a rolling upgrade, agents of two versions read and rewrite the same
znodes. The stored models (agent registrations, the controller, topic specs, partition states,
group and transaction records) therefore keep fields they do not know (``extra="allow"``):
an older agent reads a newer agent's registration or state, and a compare-and-set rewrite by
an older controller carries the newer fields along instead of dropping them. What a request
sends is checked strictly elsewhere (the admin API's bodies, ``TopicConfig``'s keys).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from storage.config import LogConfig
from storage.errors import InvalidConfigError, InvalidPartitionsError
from storage.names import validate_topic_name as validate_topic_name

MAX_PARTITIONS = 10_000
DAY_MS = 24 * 3600 * 1000
YEAR_MS = 365 * DAY_MS
MAX_DELAY_MS = 2**36 - 1
"""The longest delay the delay levels can hold (about 795 days): see docs/delays.md."""


class TopicConfig(LogConfig):
    """Per-topic settings: the local log's (``LogConfig``) plus retention and replication."""

    retention_ms: int = Field(14 * DAY_MS, alias="retention.ms", ge=-1)
    retention_bytes: int = Field(-1, alias="retention.bytes", ge=-1)
    local_retention_ms: int = Field(-2, alias="local.retention.ms", ge=-2)
    local_retention_bytes: int = Field(-2, alias="local.retention.bytes", ge=-2)
    min_insync_replicas: int = Field(1, alias="min.insync.replicas", ge=1)
    unclean_leader_election_enable: bool = Field(False, alias="unclean.leader.election.enable")
    delay_max_ms: int = Field(YEAR_MS, alias="delay.max.ms", ge=0, le=MAX_DELAY_MS)
    """The longest delay a producer may ask for on this topic (docs/delays.md)."""
    kafka_batch_storage: Literal["as-sent", "columnar"] = Field(
        "as-sent", alias="kafka.batch.storage"
    )
    """How a Kafka client's uncompressed batch without record headers is stored: as it came
    (fastest for Kafka producers and consumers) or converted to the columnar body (fastest
    for Arrow readers: SDK ``getmany_arrow``, replay, Spark); docs/kafka.md."""

    def __eq__(self, other: object) -> bool:
        # the same settings are equal whether read back from a znode (``StoredTopicConfig``)
        # or parsed from a request: a spec written and read again compares equal
        if not isinstance(other, TopicConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__ and (self.model_extra or {}) == (
            other.model_extra or {}
        )

    def __hash__(self) -> int:
        return hash(tuple(self.__dict__.items()))

    def log_config(self) -> LogConfig:
        return LogConfig.model_validate({k: getattr(self, k) for k in LogConfig.model_fields})

    def to_wire(self) -> dict[str, Any]:
        """The config with Kafka's dotted names (what the admin API shows)."""
        return self.model_dump(by_alias=True, mode="json")

    def updated(self, changes: dict[str, Any]) -> TopicConfig:
        """These settings with ``changes`` (checked strictly); settings of a newer version
        that a stored config carries (``StoredTopicConfig``) are kept."""
        newer = {k: v for k, v in (self.model_extra or {}).items() if k not in changes}
        known = {k: v for k, v in self.to_wire().items() if k not in newer}
        result: TopicConfig = TopicConfig.parse({**known, **changes})
        if newer:
            result = StoredTopicConfig.model_validate({**result.to_wire(), **newer})
        return result


class StoredTopicConfig(TopicConfig):
    """A topic's settings as read back from its znode: settings of a newer version are kept
    (``extra="allow"``: an older agent reads the spec, and its compare-and-set rewrites carry
    them along), while what a request sends is still checked strictly as ``TopicConfig``."""

    model_config = ConfigDict(extra="allow")


class DeletionStep(enum.StrEnum):
    """Where a topic's delete is: the step the controller does next (``docs/operations.md``).

    Step 1, *mark the topic deleting*, is the admin's: it writes ``TopicSpec.deletion`` with
    ``STOP_SERVING``. The transitions are ``broker_agents.deletion.state``'s table.
    """

    STOP_SERVING = "stop_serving"
    REMOVE_LOCAL_LOGS = "remove_local_logs"
    REMOVE_SNAPSHOTS = "remove_snapshots"
    DELETE_OBJECTS = "delete_objects"
    REMOVE_OFFSETS = "remove_offsets"
    REMOVE_METADATA = "remove_metadata"
    DONE = "done"

    @property
    def number(self) -> int:
        """The step's number in the issue's and the docs' list (2-7; 8 for done)."""
        return list(DeletionStep).index(self) + 2


class TopicDeletion(BaseModel):
    """``TopicSpec.deletion``: a delete in progress, and how far it has got.

    Written by the admin (step 1) and then by the controller, compare-and-set on the topic
    znode's version, so a deposed controller's late write fails instead of moving it back.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: DeletionStep = DeletionStep.STOP_SERVING
    requested_ms: int
    updated_ms: int
    #: the agents that held a replica when serving stopped (step 2): those step 3 waits for
    replicas: list[int] = []
    #: live replicas that have not yet confirmed their local logs are gone (step 3)
    waiting_for: list[int] = []
    #: segment objects of the topic id when step 5 first listed them (-1: not counted yet)
    objects_total: int = -1
    objects_deleted: int = 0
    #: the last failure of a step (retried with a backoff); "" when the last attempt worked
    last_error: str = ""

    @property
    def objects_left(self) -> int:
        """Segment objects still to delete (-1 while unknown; 0 once step 5 is past)."""
        if self.step in (DeletionStep.REMOVE_OFFSETS, DeletionStep.REMOVE_METADATA):
            return 0
        if self.step == DeletionStep.DONE:
            return 0
        if self.objects_total < 0:
            return -1
        return max(0, self.objects_total - self.objects_deleted)


class TopicSpec(BaseModel):
    """``/topics/<name>``: what the admin asked for; the controller makes it so.

    ``topic_id`` names this incarnation of the name (KIP-516): a topic deleted and created
    again gets a new one, and everything that outlives a request carries it (partition
    states, manifest snapshots, segment keys, committed offsets, local partition
    directories), so two incarnations are never mixed. ``deletion`` is set from the moment a
    delete is asked for until the topic node goes (``docs/operations.md``).
    """

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    name: str
    partitions: int = Field(ge=1, le=MAX_PARTITIONS)
    replication_factor: int = Field(ge=1, le=16)
    #: (written as what it is: a stored config's newer settings go back into the znode)
    config: SerializeAsAny[TopicConfig] = Field(default_factory=TopicConfig)
    topic_id: str
    created_ms: int
    deletion: TopicDeletion | None = None

    @field_validator("config", mode="before")
    @classmethod
    def _stored_config(cls, value: Any) -> Any:
        """Settings given as a mapping come from a znode (a request's are a ``TopicConfig``
        already, checked strictly): unknown ones are a newer version's, kept."""
        if isinstance(value, Mapping):
            return StoredTopicConfig.model_validate(value)
        return value

    @classmethod
    def build(cls, **values: Any) -> TopicSpec:
        validate_topic_name(values.get("name"))
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors()}
            if "partitions" in bad:
                raise InvalidPartitionsError(str(exc)) from None
            raise InvalidConfigError(str(exc)) from None


class PartitionState(BaseModel):
    """``/topics/<name>/partitions/<p>/state``: leader, leader epoch, replicas and ISR.

    Written by the controller with compare-and-set on the znode version; every change of
    leader bumps ``leader_epoch``, the fencing token agents check before acting as leader.
    """

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    leader: int  # -1: offline
    leader_epoch: int
    replicas: list[int]
    isr: list[int]
    controller_epoch: int
    #: a reassignment in progress: replicas being added (catching up) and to be removed once
    #: every added one is in the ISR (``replicas`` holds both meanwhile)
    adding: list[int] = []
    removing: list[int] = []
    #: the incarnation (``AgentRegistration.incarnation``) each ISR member had when it was
    #: admitted to the ISR or elected. A member whose agent has restarted since (another
    #: incarnation registered) may have lost writes it had not fsynced, so it is no longer
    #: in sync: the controller takes it out of the ISR (and leadership) until it catches up
    #: again. A member without an entry (a state written before this field) is trusted.
    incarnations: dict[int, str] = {}

    def in_sync_as(self, agent_id: int, incarnation: str) -> bool:
        """Whether ``agent_id``'s membership of the ISR was granted to ``incarnation``."""
        stamp = self.incarnations.get(agent_id)
        return stamp is None or stamp == incarnation

    def stamped(self, isr: list[int], incarnation_of: Mapping[int, str]) -> dict[int, str]:
        """Stamps for ``isr``: members keep theirs, a new member gets its current one."""
        out = {}
        for r in isr:
            stamp = self.incarnations.get(r) if r in self.isr else None
            current = incarnation_of.get(r)
            if stamp is None and current:
                stamp = current
            if stamp:
                out[r] = stamp
        return out

    #: the incarnation of the topic this partition belongs to ("" in states written before
    #: topic ids were carried here: the topic spec's id applies)
    topic_id: str = ""
    #: the topic is being deleted: nobody leads or hosts it any more (step 2 of a delete)
    deleting: bool = False


class AgentRegistration(BaseModel):
    """``/agents/<id>`` (ephemeral): where an agent listens."""

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    agent_id: int = Field(ge=0)
    host: str
    port: int = Field(ge=1, le=65535)
    started_ms: int
    #: new for every start of the agent's process (not for a new ZooKeeper session of the
    #: same process): a restarted agent may have lost what it had not fsynced
    incarnation: str = ""
    #: set by an agent stopping gracefully (SIGTERM): the controller moves its leadership and
    #: ISR memberships to other replicas, and groups to other coordinators, before it stops
    shutting_down: bool = False
    #: (topic, partition) whose local log this agent cannot open (a quarantined segment, a
    #: disk error): for those the controller counts the agent as dead — Kafka's offline replica
    offline: tuple[tuple[str, int], ...] = ()
    #: the Kafka listener's address (``kafka.listener``), None when the agent has none
    kafka_host: str | None = None
    kafka_port: int | None = Field(None, ge=1, le=65535)


class ControllerInfo(BaseModel):
    """``/controller`` (ephemeral): who is the controller, and its epoch."""

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    agent_id: int
    epoch: int


def dump(model: BaseModel) -> bytes:
    return model.model_dump_json(by_alias=True).encode()


def load(cls: type[Any], data: bytes) -> Any:
    try:
        return cls.model_validate_json(data)  # a third of json.loads + model_validate's time
    except (ValueError, ValidationError) as exc:
        raise InvalidConfigError(f"stored {cls.__name__} does not parse: {exc}") from None
