"""Access control lists: who may do what to which resource (Kafka's model), kept in ZooKeeper.

Layout (under the cluster's chroot; ``docs/security.md``)::

    /config/acls   [{"principal": "User:alice", "resource_type": "topic",
                     "pattern_type": "prefixed", "name": "orders-", "operation": "write",
                     "permission": "allow"}, ...]

One znode for the whole list (rewritten by compare-and-set): ACLs are few and change rarely,
and every agent watches the one znode.

Decision (``authorize``), for a principal, an operation and a resource:

* a binding applies when its resource type matches, its principal is the principal or
  ``User:*``, its name matches (``literal``: equal, or ``*`` for every name; ``prefixed``:
  the resource name starts with it) and its operation is the operation or ``all``;
* **deny wins**: any applying deny refuses;
* otherwise any applying allow allows, where ``describe`` is also allowed by an allow of
  ``read``, ``write``, ``delete`` or ``alter`` (as in Kafka: who may read a topic may see it);
* otherwise refused (no ACL, no access). Super users (``super.users``) skip all of this.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from storage.errors import (
    InvalidRequestError,
    NodeNotFoundError,
)
from storage.metadata.zk import AsyncZooKeeper

ACLS = "/config/acls"


class ResourceType(enum.StrEnum):
    TOPIC = "topic"
    GROUP = "group"
    CLUSTER = "cluster"
    TRANSACTIONAL_ID = "transactional_id"


class PatternType(enum.StrEnum):
    LITERAL = "literal"
    PREFIXED = "prefixed"


class Operation(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    CREATE = "create"
    DELETE = "delete"
    ALTER = "alter"
    DESCRIBE = "describe"
    ALL = "all"


class Permission(enum.StrEnum):
    ALLOW = "allow"
    DENY = "deny"


#: the name of the one cluster resource
CLUSTER_NAME = "strata-cluster"
_IMPLIES_DESCRIBE = frozenset(
    {Operation.READ, Operation.WRITE, Operation.DELETE, Operation.ALTER, Operation.DESCRIBE}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class AclBinding:
    principal: str
    resource_type: ResourceType
    name: str
    operation: Operation
    permission: Permission = Permission.ALLOW
    pattern_type: PatternType = PatternType.LITERAL

    @classmethod
    def parse(cls, d: dict[str, Any]) -> AclBinding:
        """From JSON (case-insensitive enum values); bad input raises InvalidRequestError."""
        try:
            b = cls(
                principal=str(d["principal"]),
                resource_type=ResourceType(str(d["resource_type"]).lower()),
                name=str(d["name"]),
                operation=Operation(str(d["operation"]).lower()),
                permission=Permission(str(d.get("permission", "allow")).lower()),
                pattern_type=PatternType(str(d.get("pattern_type", "literal")).lower()),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"not an ACL binding: {d!r} ({exc})") from None
        if not b.principal.startswith("User:") or len(b.principal) <= 5:
            raise InvalidRequestError(
                f"principal must be 'User:<name>' or 'User:*', not {b.principal!r}"
            )
        if not b.name:
            raise InvalidRequestError("an ACL needs a resource name ('*' for every one)")
        return b

    def to_json(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    def matches(self, principal: str, resource_type: ResourceType, name: str) -> bool:
        if self.resource_type is not resource_type:
            return False
        if self.principal not in (principal, "User:*"):
            return False
        if self.pattern_type is PatternType.PREFIXED:
            return name.startswith(self.name)
        return self.name in (name, "*")


def authorize(
    bindings: Iterable[AclBinding],
    principal: str,
    operation: Operation,
    resource_type: ResourceType,
    name: str,
) -> bool:
    """Whether ``bindings`` let ``principal`` do ``operation`` on the resource (deny wins)."""
    allowed = False
    for b in bindings:
        if not b.matches(principal, resource_type, name):
            continue
        if b.permission is Permission.DENY:
            if b.operation in (operation, Operation.ALL):
                return False
            continue
        if b.operation in (operation, Operation.ALL) or (
            operation is Operation.DESCRIBE and b.operation in _IMPLIES_DESCRIBE
        ):
            allowed = True
    return allowed


def decode_acls(data: bytes | None) -> list[AclBinding]:
    if not data:
        return []
    return [AclBinding.parse(d) for d in json.loads(data)]


def encode_acls(bindings: Iterable[AclBinding]) -> bytes:
    unique = sorted({b: None for b in bindings}, key=lambda b: tuple(b.to_json().values()))
    return json.dumps([b.to_json() for b in unique]).encode()


class AclStore:
    """Reads and changes ``/config/acls`` (compare-and-set, retried on a race)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def list(self) -> list[AclBinding]:
        try:
            data, _ = await self.zk.get(ACLS)
        except NodeNotFoundError:
            return []
        return decode_acls(data)

    async def add(self, bindings: Iterable[AclBinding]) -> None:
        new = list(bindings)
        await self._change(lambda old: old + new)

    async def remove(self, bindings: Iterable[AclBinding]) -> int:
        gone = set(bindings)
        removed = 0

        def change(old: list[AclBinding]) -> list[AclBinding]:
            nonlocal removed
            kept = [b for b in old if b not in gone]
            removed = len(old) - len(kept)
            return kept

        await self._change(change)
        return removed

    async def _change(self, change: Any) -> None:
        await self.zk.update(ACLS, lambda data: encode_acls(change(decode_acls(data))))
