"""Consumer groups in ZooKeeper: membership, generation and committed offsets.

Layout (under the cluster's chroot; see ``docs/groups.md``)::

    /groups/<group>/state             GroupRecord (JSON): generation, phase, protocol, leader,
                                      members with their subscription and assignment
    /groups/<group>/offsets/<topic>   {"id": "<topic id>", "p": {"<partition>": [offset,
                                      metadata, commit_ms], ...}}
    /groups/<group>/txn               transactional offsets not yet settled, and the last
                                      marker token applied per producer (GroupTxnState)

Only the group's coordinator writes ``state`` (compare-and-set on the znode version, so a
coordinator that lost the group to another agent cannot overwrite it) and ``offsets``: one
``multi`` transaction per flush that checks the ``state`` version and rewrites every topic
znode that has new commits. Coalescing many commits into one transaction is what keeps the
write rate ZooKeeper sees far below the commit rate (``docs/benchmarks.md``). The admin API
writes here only for groups without members (reset offsets, delete).

Transactional offsets (``TxnOffsetCommit``, ``docs/transactions.md``) are parked in ``txn``
until the transaction's marker arrives: a commit marker moves them into ``offsets`` and
clears them in one ``multi``; an abort marker clears them.

Offsets are plain JSON arrays rather than pydantic models: a 1,000-partition topic is one
~40 KB znode, rewritten on every flush that touches it.

Committed offsets belong to one incarnation of a topic (``TopicSpec.topic_id``, KIP-516):
``id`` names it. Offsets of another incarnation than the topic's current one are never
handed out (a deleted and re-created topic starts without committed offsets), and a commit
for the current incarnation replaces them. ``id`` is "" in znodes written before ids were
kept here (the old format, a bare ``{"<partition>": [...]}``, still reads): such offsets
count as the current incarnation's. A delete removes a topic's offsets from every group
(step 6, ``broker_agents.deletion``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from storage.errors import (
    GroupIdNotFoundError,
    InvalidRequestError,
    NodeNotFoundError,
    VersionConflictError,
)
from storage.metadata.models import TopicSpec, dump, load
from storage.metadata.store import topic_path
from storage.metadata.zk import AsyncZooKeeper

GROUPS = "/groups"
MAX_GROUP_ID = 249


def validate_group_id(group_id: Any) -> str:
    """A group id is 1-249 characters with no ``/`` (it is a znode name)."""
    if (
        not isinstance(group_id, str)
        or not 0 < len(group_id) <= MAX_GROUP_ID
        or "/" in group_id
        or group_id in {".", ".."}
        or not group_id.isprintable()
    ):
        raise InvalidRequestError(
            f"invalid group id {group_id!r}: 1-{MAX_GROUP_ID} printable characters, no '/'"
        )
    return group_id


def group_path(group_id: str) -> str:
    return f"{GROUPS}/{group_id}"


def state_path(group_id: str) -> str:
    return f"{GROUPS}/{group_id}/state"


def offsets_root(group_id: str) -> str:
    return f"{GROUPS}/{group_id}/offsets"


def offsets_path(group_id: str, topic: str) -> str:
    return f"{GROUPS}/{group_id}/offsets/{topic}"


def txn_path(group_id: str) -> str:
    return f"{GROUPS}/{group_id}/txn"


class MemberRecord(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    member_id: str
    group_instance_id: str | None = None
    client_id: str = ""
    session_timeout_ms: int = Field(ge=1)
    rebalance_timeout_ms: int = Field(ge=1)
    protocols: list[tuple[str, str]] = Field(default_factory=list)
    """(assignor name, base64 subscription) in the member's order of preference."""
    assignment: str = ""
    """Base64 of the ConsumerAssignment the leader gave it ("" before the sync)."""
    filter: str | None = None
    """The subscription's filter (canonical text, ``storage.filters``); None: every record."""


class SuspectRecord(BaseModel):
    """Offsets of a partition that were being processed when a member's session expired
    (``docs/retries.md``, "Poison messages and crashes"), and how many such crashes."""

    model_config = ConfigDict(frozen=True, extra="allow")

    topic: str
    partition: int = Field(ge=0)
    first_offset: int = Field(ge=0)
    end_offset: int = Field(ge=0)
    crashes: int = Field(ge=1)
    pinned: bool = False
    """The last crash had this one record in flight, and nothing else."""


class GroupRecord(BaseModel):
    """``/groups/<group>/state``: what a new coordinator needs to take the group over."""

    model_config = ConfigDict(
        frozen=True, extra="allow"
    )  # fields of newer versions kept: see models.py

    group_id: str
    generation: int = 0
    phase: str = "empty"
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: list[MemberRecord] = Field(default_factory=list)
    updated_ms: int = 0
    suspects: list[SuspectRecord] = Field(default_factory=list)


def b64(data: bytes | memoryview | None) -> str:
    return "" if data is None else base64.b64encode(bytes(data)).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


@dataclass(frozen=True, slots=True)
class CommittedOffset:
    offset: int
    metadata: str | None
    commit_ms: int


TopicOffsets = dict[int, CommittedOffset]


@dataclass(frozen=True, slots=True)
class TopicCommits:
    """One topic's committed offsets in a group, and the incarnation they belong to."""

    topic_id: str  # "": written before topic ids were kept (counts as the current one)
    offsets: TopicOffsets

    def belongs_to(self, topic_id: str) -> bool:
        return self.topic_id in ("", topic_id)

    def visible(self, spec: TopicSpec | None) -> TopicOffsets:
        """What may be handed out for a topic whose spec is ``spec`` (None: no such topic):
        nothing for a topic being deleted, nothing of another incarnation, and for a topic
        that does not exist only offsets never tied to an incarnation (committed by name for
        a topic not created yet)."""
        if spec is None:
            return self.offsets if not self.topic_id else {}
        if spec.deletion is not None or not self.belongs_to(spec.topic_id):
            return {}
        return self.offsets


NO_COMMITS = TopicCommits("", {})


def encode_offsets(commits: TopicCommits) -> bytes:
    return json.dumps(
        {
            "id": commits.topic_id,
            "p": {
                str(p): [c.offset, c.metadata, c.commit_ms]
                for p, c in sorted(commits.offsets.items())
            },
        },
        separators=(",", ":"),
    ).encode()


def decode_offsets(data: bytes) -> TopicCommits:
    try:
        raw = json.loads(data) if data else {}
        topic_id, parts = (str(raw["id"]), raw["p"]) if "p" in raw else ("", raw)
        return TopicCommits(
            topic_id,
            {int(p): CommittedOffset(int(v[0]), v[1], int(v[2])) for p, v in parts.items()},
        )
    except (ValueError, TypeError, IndexError, AttributeError, KeyError) as exc:
        raise InvalidRequestError(f"stored offsets do not parse: {exc}") from None


@dataclass(frozen=True, slots=True)
class PendingTxnOffsets:
    """A producer's transactional offsets in a group, waiting for its transaction's marker,
    and the incarnation (topic id; "" by name) each topic's offsets were sent for."""

    producer_epoch: int
    offsets: dict[tuple[str, int], CommittedOffset]
    topic_ids: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class GroupTxnState:
    """``/groups/<group>/txn``: pending transactional offsets per producer id, and per
    producer id the last marker token applied (with when, to forget old ones)."""

    pending: dict[int, PendingTxnOffsets]
    tokens: dict[int, tuple[int, int]]  # producer id -> (token, ms)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "pending": {
                    str(pid): [
                        p.producer_epoch,
                        [
                            [t, part, c.offset, c.metadata, c.commit_ms]
                            for (t, part), c in p.offsets.items()
                        ],
                        p.topic_ids,
                    ]
                    for pid, p in self.pending.items()
                },
                "tokens": {str(pid): list(v) for pid, v in self.tokens.items()},
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> GroupTxnState:
        try:
            raw = json.loads(data) if data else {}
            pending = {
                int(pid): PendingTxnOffsets(
                    int(v[0]),
                    {
                        (str(t), int(p)): CommittedOffset(int(o), md, int(ms))
                        for t, p, o, md, ms in v[1]
                    },
                    {str(t): str(i) for t, i in (v[2] if len(v) > 2 else {}).items()},
                )
                for pid, v in raw.get("pending", {}).items()
            }
            tokens = {int(pid): (int(v[0]), int(v[1])) for pid, v in raw.get("tokens", {}).items()}
        except (ValueError, TypeError, IndexError, AttributeError) as exc:
            raise InvalidRequestError(f"stored transactional offsets do not parse: {exc}") from None
        return cls(pending, tokens)


class GroupStore:
    """Typed reads and writes of ``/groups`` (used by coordinators and by the admin API)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def list_groups(self) -> list[str]:
        try:
            return sorted(await self.zk.get_children(GROUPS))
        except NodeNotFoundError:
            return []

    async def exists(self, group_id: str) -> bool:
        return await self.zk.exists(group_path(group_id)) is not None

    async def get_state(self, group_id: str) -> tuple[GroupRecord | None, int]:
        """The state and its znode version (``None, -1`` when never written)."""
        try:
            data, stat = await self.zk.get(state_path(group_id))
        except NodeNotFoundError:
            return None, -1
        record: GroupRecord = load(GroupRecord, data)
        return record, int(stat.version)

    async def write_state(self, record: GroupRecord, version: int) -> int:
        """Compare-and-set (``version`` -1: create the group); returns the new version."""
        if version < 0:
            gid = record.group_id

            def build(tx: Any) -> None:
                tx.create(group_path(gid), b"")
                tx.create(state_path(gid), dump(record))
                tx.create(offsets_root(gid), b"")

            try:
                await self.zk.transaction(build)
            except Exception:
                # the group node may exist without a state (offsets committed from outside)
                await self.zk.ensure_path(offsets_root(gid))
                await self.zk.create(state_path(gid), dump(record))
            return 0
        stat = await self.zk.set(state_path(record.group_id), dump(record), version)
        return int(stat.version)

    async def get_offsets(self, group_id: str, topic: str) -> tuple[TopicCommits, int]:
        try:
            data, stat = await self.zk.get(offsets_path(group_id, topic))
        except NodeNotFoundError:
            return NO_COMMITS, -1
        return decode_offsets(data), int(stat.version)

    async def topics(self, group_id: str) -> list[str]:
        try:
            return sorted(await self.zk.get_children(offsets_root(group_id)))
        except NodeNotFoundError:
            return []

    async def all_offsets(self, group_id: str) -> dict[str, TopicCommits]:
        out = {}
        for topic in await self.topics(group_id):
            commits, _ = await self.get_offsets(group_id, topic)
            out[topic] = commits
        return out

    async def live_offsets(self, group_id: str) -> dict[str, TopicOffsets]:
        """The group's committed offsets of topics that exist now, are not being deleted, and
        whose offsets belong to the topic's current incarnation: what a describe shows."""
        out = {}
        for topic, commits in (await self.all_offsets(group_id)).items():
            spec = await self.current_topic(topic)
            if spec is not None and commits.belongs_to(spec.topic_id):
                out[topic] = commits.offsets
        return out

    async def visible_offsets(self, group_id: str, topic: str) -> TopicOffsets:
        """The group's committed offsets of ``topic`` that may be handed out now
        (``TopicCommits.visible``): none of another incarnation or of a topic being deleted."""
        commits, _ = await self.get_offsets(group_id, topic)
        return commits.visible(await self.topic_spec(topic))

    async def topic_spec(self, topic: str) -> TopicSpec | None:
        """The topic's spec (None: no such topic), read from ZooKeeper."""
        try:
            data, _ = await self.zk.get(topic_path(topic))
        except NodeNotFoundError:
            return None
        spec: TopicSpec = load(TopicSpec, data)
        return spec

    async def current_topic(self, topic: str) -> TopicSpec | None:
        """The topic's spec, or None when it does not exist or is being deleted."""
        spec = await self.topic_spec(topic)
        return None if spec is None or spec.deletion is not None else spec

    async def remove_offsets(self, topic: str, topic_id: str) -> int:
        """Delete ``topic``'s committed offsets of incarnation ``topic_id`` (or of no recorded
        incarnation) from every group; returns how many groups had some. Each delete is
        compare-and-set on the version read, so a commit that lands meanwhile is re-read."""
        removed = 0
        for group_id in await self.list_groups():
            path = offsets_path(group_id, topic)
            for _ in range(5):
                try:
                    data, stat = await self.zk.get(path)
                except NodeNotFoundError:
                    break
                if not decode_offsets(data).belongs_to(topic_id):
                    break  # a newer incarnation's (cannot happen while the name is deleting)
                try:
                    await self.zk.delete(path, int(stat.version))
                    removed += 1
                    break
                except NodeNotFoundError:
                    break
                except VersionConflictError:
                    continue
            else:
                raise VersionConflictError(
                    f"offsets of {topic!r} in group {group_id!r} kept changing"
                )
        return removed

    async def write_offsets(
        self,
        group_id: str,
        writes: dict[str, tuple[TopicCommits, int]],
        *,
        state_version: int | None = None,
        txn: tuple[GroupTxnState, int] | None = None,
    ) -> dict[str, int]:
        """One transaction: check the state version (unless None), then create or
        compare-and-set every topic's offsets znode (and with ``txn``, the transactional
        offsets znode at its version; -1: create). Returns the new versions (the txn
        znode's under the key ``""``)."""
        if state_version is not None and state_version < 0:
            state_version = None
        # the parents of a new node (a topic's, once per group and topic, or the group's
        # transactional offsets): a write to nodes that exist is the transaction alone (one
        # round trip per commit flush, not two)
        creates = any(version < 0 for _, version in writes.values()) or (
            txn is not None and txn[1] < 0
        )
        if creates and await self.zk.exists(offsets_root(group_id)) is None:
            await self.zk.ensure_path(offsets_root(group_id))

        def build(tx: Any) -> None:
            if state_version is not None:
                tx.check(state_path(group_id), state_version)
            for topic, (commits, version) in writes.items():
                data = encode_offsets(commits)
                if version < 0:
                    tx.create(offsets_path(group_id, topic), data)
                else:
                    tx.set_data(offsets_path(group_id, topic), data, version)
            if txn is not None:
                if txn[1] < 0:
                    tx.create(txn_path(group_id), txn[0].encode())
                else:
                    tx.set_data(txn_path(group_id), txn[0].encode(), txn[1])

        await self.zk.transaction(build)
        out = {topic: version + 1 for topic, (_, version) in writes.items()}
        if txn is not None:
            out[""] = txn[1] + 1
        return out

    async def get_txn(self, group_id: str) -> tuple[GroupTxnState, int]:
        """The group's transactional offsets state and its version (empty, -1: none)."""
        try:
            data, stat = await self.zk.get(txn_path(group_id))
        except NodeNotFoundError:
            return GroupTxnState({}, {}), -1
        return GroupTxnState.decode(data), int(stat.version)

    async def delete_group(self, group_id: str) -> None:
        if not await self.exists(group_id):
            raise GroupIdNotFoundError(f"no group {group_id!r}")
        await self.zk.delete(group_path(group_id), recursive=True)
