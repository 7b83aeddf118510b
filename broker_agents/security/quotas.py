"""Client quotas on the agent: a principal over its rate finds its connections paused.

The limits come from ZooKeeper (``/config/quotas``, watched; ``storage.metadata.quotas``):
per principal, or the ``User:*`` default for each principal without its own, a
``producer_byte_rate``, a ``consumer_byte_rate`` and a ``request_rate``. They hold per agent,
as in Kafka.

What is counted (Kafka's choices): a Produce request's size against the producer rate; a
Fetch answer's size against the consumer rate; every request against the request rate.
Replica fetches, OffsetForLeaderEpoch and transaction markers (the agents' own traffic) and
super users are never counted.

How it throttles: each (principal, rate) is a virtual clock, the *theoretical arrival time*
of the generic cell rate algorithm. A request costing ``c`` (bytes, or 1) moves it to
``max(tat, now) + c / rate``; the principal must wait until ``tat - burst``
(``quota.burst.ms``: how far ahead of its rate it may run). As in Kafka since KIP-219, the
request is served and answered at once, with ``throttle_time_ms`` set where the answer has
that field (native Produce and Fetch; Kafka's answers from their v1), and then the
connection is *muted*: its reader takes no further request off the socket for that long (a
client that does not wait by itself is held by TCP backpressure). Nothing is kept meanwhile:
no request bytes charged to the agent's budget, no answer held in memory; other principals'
connections are not held up.

State is one float per (principal, rate) in use, dropped once it is in the past (bounded by
the number of principals that were throttled within the last ``burst``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from broker_agents.security.guard import current_principal
from storage.errors import InvalidRequestError
from storage.metadata.quotas import DEFAULT_PRINCIPAL, QuotaConfig, decode_quotas
from storage.protocol.messages import ApiKey

log = logging.getLogger(__name__)

#: the agents' own traffic: never counted
_EXEMPT_APIS = frozenset({ApiKey.OFFSET_FOR_LEADER_EPOCH, ApiKey.WRITE_TXN_MARKERS})
#: the longest throttle (well inside a client's request.timeout.ms; Kafka caps its throttle
#: at the quota window), and the most a principal's clock runs ahead of now
MAX_THROTTLE_S = 10.0
_SWEEP_EVERY = 1024


class Quotas:
    """The limits in force and the virtual clocks of the principals using them."""

    def __init__(
        self,
        super_users: frozenset[str] = frozenset(),
        *,
        burst_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.super_users = super_users
        self.burst_s = burst_s
        self.clock = clock
        self.limits: dict[str, QuotaConfig] = {}
        self._tat: dict[tuple[str, str], float] = {}
        self._charges = 0
        #: throttled answers, and the time they muted their connections (the agent's metrics)
        self.throttled = 0
        self.throttled_s = 0.0

    def update(self, data: bytes | None) -> None:
        """The quota znode changed (a watch); quotas that do not parse keep the old ones."""
        try:
            self.limits = decode_quotas(data)
        except (ValueError, TypeError, InvalidRequestError) as exc:
            log.error("the quotas in ZooKeeper do not parse; keeping the previous ones: %s", exc)

    @property
    def active(self) -> bool:
        return bool(self.limits)

    def limit(self, principal: str) -> QuotaConfig | None:
        if principal in self.super_users:
            return None
        return self.limits.get(principal) or self.limits.get(DEFAULT_PRINCIPAL)

    def charge(self, principal: str, api_key: int, request_bytes: int, answer_bytes: int) -> float:
        """Count one request; the seconds its answer must wait (0: none)."""
        quota = self.limit(principal)
        if quota is None:
            return 0.0
        now = self.clock()
        wait = 0.0
        if quota.request_rate is not None:
            wait = self._take(principal, "requests", 1, quota.request_rate, now)
        if api_key == ApiKey.PRODUCE and quota.producer_byte_rate is not None:
            wait = max(
                wait, self._take(principal, "produce", request_bytes, quota.producer_byte_rate, now)
            )
        elif api_key == ApiKey.FETCH and quota.consumer_byte_rate is not None:
            wait = max(
                wait, self._take(principal, "fetch", answer_bytes, quota.consumer_byte_rate, now)
            )
        if wait > 0:
            self.throttled += 1
            self.throttled_s += wait
        return min(wait, MAX_THROTTLE_S)

    def _take(self, principal: str, kind: str, cost: int, rate: int, now: float) -> float:
        key = (principal, kind)
        tat = max(self._tat.get(key, now), now) + cost / rate
        tat = min(tat, now + self.burst_s + MAX_THROTTLE_S)
        self._tat[key] = tat
        self._charges += 1
        if self._charges % _SWEEP_EVERY == 0:
            self._tat = {k: t for k, t in self._tat.items() if t > now}
        return max(0.0, tat - now - self.burst_s)


def exempt(api_key: int, body: Any) -> bool:
    """The agents' own requests: replica fetches, leader-epoch queries, markers."""
    if api_key in _EXEMPT_APIS:
        return True
    return api_key == ApiKey.FETCH and getattr(body, "replica_id", -1) >= 0


def size_of(parts: Any) -> int:
    return sum(memoryview(p).nbytes for p in parts)


class Throttled:
    """An answer (``parts``; None: acks=0, none) after which the connection reads nothing
    for ``wait`` seconds."""

    __slots__ = ("parts", "wait")

    def __init__(self, parts: list[Any] | None, wait: float) -> None:
        self.parts = parts
        self.wait = wait


def throttle(
    quotas: Quotas,
    api_key: int,
    body: Any,
    request_bytes: int,
    response: Any,
    encode: Callable[[Any], list[Any]],
    set_throttle: Callable[[Any, int], bool],
) -> list[Any] | Throttled | None:
    """Encode ``response`` (None: no answer); if the principal is over its quota, the answer
    (with its throttle time set when ``set_throttle`` can) as a ``Throttled``."""
    parts = None if response is None else encode(response)
    if exempt(api_key, body):
        return parts
    size = 0 if parts is None else size_of(parts)
    wait = quotas.charge(current_principal.get(), api_key, request_bytes, size)
    if wait <= 0:
        return parts
    if response is not None and set_throttle(response, int(wait * 1000)):
        parts = encode(response)
    return Throttled(parts, wait)
