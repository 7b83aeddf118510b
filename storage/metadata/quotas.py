"""Client quotas: how many bytes and requests per second a principal may use on each agent.

Layout (under the cluster's chroot; ``docs/security.md``)::

    /config/quotas   {"User:alice": {"producer_byte_rate": 1048576},
                      "User:*": {"consumer_byte_rate": 10485760, "request_rate": 1000}}

One znode for every quota (rewritten by compare-and-set), watched by every agent, like the
ACLs. ``User:*`` is the default: it applies to each principal that has no entry of its own,
to each one separately (not shared). A rate left out is unlimited. As in Kafka, a quota holds
per agent: a client spread over three agents may use up to three times its rate in all.

* ``producer_byte_rate``: record bytes produced per second;
* ``consumer_byte_rate``: record bytes fetched per second (consumers; replicas never count);
* ``request_rate``: requests per second, of any kind.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from storage.errors import (
    InvalidRequestError,
    NodeNotFoundError,
)
from storage.metadata.zk import AsyncZooKeeper

QUOTAS = "/config/quotas"
DEFAULT_PRINCIPAL = "User:*"
MAX_RATE = 1 << 40


class QuotaConfig(BaseModel):
    """One principal's limits; ``None``: unlimited. Whole numbers only (not ``"100"`` nor
    ``true``: JSON says what it means)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    producer_byte_rate: StrictInt | None = Field(None, ge=1, le=MAX_RATE)
    consumer_byte_rate: StrictInt | None = Field(None, ge=1, le=MAX_RATE)
    request_rate: StrictInt | None = Field(None, ge=1, le=MAX_RATE)

    def is_empty(self) -> bool:
        return (
            self.producer_byte_rate is None
            and self.consumer_byte_rate is None
            and (self.request_rate is None)
        )

    def to_json(self) -> dict[str, int]:
        return self.model_dump(exclude_none=True)


def validate_principal(principal: str) -> str:
    """``User:<name>`` or the default ``User:*``."""
    if (
        not isinstance(principal, str)
        or not principal.startswith("User:")
        or not 5 < len(principal) <= 260
        or any(c.isspace() or not c.isprintable() for c in principal)
    ):
        raise InvalidRequestError(
            "a quota's principal is User:<name> (or User:* for the default), without spaces"
        )
    return principal


def parse_quota(principal: str, data: object) -> QuotaConfig:
    """A quota from JSON, with a typed error naming what is wrong."""
    validate_principal(principal)
    if not isinstance(data, dict):
        raise InvalidRequestError(f"quota of {principal}: a JSON object is required")
    try:
        return QuotaConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'quota'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidRequestError(f"quota of {principal}: {problems}") from None


def decode_quotas(data: bytes | None) -> dict[str, QuotaConfig]:
    if not data:
        return {}
    raw = json.loads(data)
    return {p: parse_quota(p, q) for p, q in raw.items()}


def encode_quotas(quotas: dict[str, QuotaConfig]) -> bytes:
    return json.dumps({p: q.to_json() for p, q in sorted(quotas.items())}).encode()


class QuotaStore:
    """Reads and changes ``/config/quotas`` (compare-and-set, retried on a race)."""

    def __init__(self, zk: AsyncZooKeeper) -> None:
        self.zk = zk

    async def list(self) -> dict[str, QuotaConfig]:
        try:
            data, _ = await self.zk.get(QUOTAS)
        except NodeNotFoundError:
            return {}
        return decode_quotas(data)

    async def set(self, principal: str, quota: QuotaConfig) -> None:
        """Replace ``principal``'s quota (an empty one removes it)."""
        validate_principal(principal)

        def change(old: dict[str, QuotaConfig]) -> dict[str, QuotaConfig]:
            new = {p: q for p, q in old.items() if p != principal}
            if not quota.is_empty():
                new[principal] = quota
            return new

        await self._change(change)

    async def delete(self, principal: str) -> bool:
        validate_principal(principal)
        found = False

        def change(old: dict[str, QuotaConfig]) -> dict[str, QuotaConfig]:
            nonlocal found
            found = principal in old
            return {p: q for p, q in old.items() if p != principal}

        await self._change(change)
        return found

    async def _change(
        self, change: Callable[[dict[str, QuotaConfig]], dict[str, QuotaConfig]]
    ) -> None:
        await self.zk.update(QUOTAS, lambda data: encode_quotas(change(decode_quotas(data))))
