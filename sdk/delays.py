"""Delayed records: the delay levels, the schedule id and the headers (pure: no I/O).

Theory of operation (the whole story, with the reasons, is in ``docs/delays.md``)
---------------------------------------------------------------------------------
A delayed record waits in *delay levels*: internal topics ``__strata_delay_07`` ..
``__strata_delay_35``, level ``k`` holding records for ``2**k`` ms (256 ms up to about 397
days). A record enters level ``k`` with a timestamp ``t`` (the time it was written there) and
leaves it at ``t + 2**k``; since records are appended in time order, every partition of a level
is FIFO by leaving time, and whoever reads it only ever looks at its head. A record with ``r``
ms left goes to level ``floor(log2 r)``, so it never leaves a level after its due time; when it
leaves, what is left is less than the level's delay, so it goes down to a lower level. Under
:data:`LAST_MILE_MS` left it goes to level 7, the *last mile*, whose records leave when they
are due (their due times lie within 256 ms of their entry, so its head holds up the records
behind it by less than that), and from there to its target. A remaining delay ``r`` takes at
most ``popcount(r >> 8) + 1`` hops (about 20 for a year).

Each level has partitions (*lanes*); a record uses lane ``h % lanes`` in every level, ``h``
being a hash of its target partition and key (its own nonce when it has no key): the records
of one key stay in one lane, so those due at the same time are delivered in the order they
were sent, and the scheduler's work spreads over all lanes whatever the number of targets.

A delayed record carries up to three headers besides the user's: :data:`HEADER_ID`, its
*schedule id* ``"<due ms>~<target partition>~<lane hash>~<nonce>~<target topic>"`` (stable
across hops, it tells the scheduler where and when to deliver and lets
``Admin.cancel_scheduled`` find it); :data:`HEADER_TOPIC_ID`, the id of the target topic's
incarnation when it was sent (KIP-516: the scheduler delivers into that incarnation only, so
a record sent before the topic was deleted and created again is dropped, not delivered into
the new topic; a record without it is delivered by name); and :data:`HEADER_TIMESTAMP`, the
record's original timestamp (decimal ms). The producer writes the last only when the
record's timestamp is not the time of the send (the timestamp of the record in its first
level says it otherwise); the scheduler adds it on the first move. All are on the delivered
record. Key, value, the user's headers and tags travel unchanged.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

from storage.errors import InvalidDelayError

MIN_LEVEL = 7
"""The shortest level: 2**7 = 128 ms."""
MAX_LEVEL = 35
"""The longest level: 2**35 ms, about 397 days (delay.max.ms is at most 2**36 - 1 ms)."""
LEVELS = range(MIN_LEVEL, MAX_LEVEL + 1)
LAST_MILE_MS = 2 << MIN_LEVEL
"""A record with less than this left goes to the shortest level, the *last mile*, whose
records leave when due (not after the level's delay): 256 ms."""
LEVEL_PREFIX = "__strata_delay_"
HEADER_ID = "strata.delay.id"
HEADER_TIMESTAMP = "strata.delay.timestamp"
HEADER_TOPIC_ID = "strata.delay.topic-id"
DELAY_HEADERS = frozenset({HEADER_ID, HEADER_TIMESTAMP, HEADER_TOPIC_ID})
DEFAULT_DELAY_MAX_MS = 365 * 24 * 3600 * 1000
"""``delay.max.ms``'s default, one year (the topic config's default in storage.metadata)."""

ROCKETMQ_LEVELS_MS = (
    1_000,
    5_000,
    10_000,
    30_000,
    60_000,
    120_000,
    180_000,
    240_000,
    300_000,
    360_000,
    420_000,
    480_000,
    540_000,
    600_000,
    1_200_000,
    1_800_000,
    3_600_000,
    7_200_000,
)
"""RocketMQ's default ``messageDelayLevel`` "1s 5s 10s 30s 1m 2m ... 1h 2h": level 1 is 1 s."""


def level_topic(level: int) -> str:
    return f"{LEVEL_PREFIX}{level:02d}"


def level_topics() -> list[str]:
    return [level_topic(k) for k in LEVELS]


def level_of(topic: str) -> int | None:
    """The level of a level topic's name, None for any other topic."""
    if not topic.startswith(LEVEL_PREFIX):
        return None
    try:
        level = int(topic[len(LEVEL_PREFIX) :])
    except ValueError:
        return None
    return level if level in LEVELS else None


def level_delay_ms(level: int) -> int:
    return 1 << level


def level_for(remaining_ms: int) -> int:
    """The level a record with ``remaining_ms`` left goes to: the longest not longer than what
    is left (the shortest level for anything under 256 ms)."""
    return min(max(remaining_ms.bit_length() - 1, MIN_LEVEL), MAX_LEVEL)


def lane_hash(topic: str, partition: int, key: bytes | None, nonce: str) -> int:
    """A record's lane hash (32 bits, kept in its schedule id): of its target and key, so the
    records of one key share a lane in every level and keep their order among equal due
    times; a keyless record's own nonce spreads those over all lanes."""
    return zlib.crc32(
        key if key is not None else nonce.encode(), zlib.crc32(f"{topic}/{partition}".encode())
    )


def due_ms(
    now_ms: int,
    *,
    delay_ms: int | None = None,
    deliver_at_ms: int | None = None,
    delay_level: int | None = None,
    max_delay_ms: int,
) -> int:
    """The due time of a record sent at ``now_ms`` (``InvalidDelayError`` for bad input).

    Exactly one of ``delay_ms`` (>= 0), ``deliver_at_ms`` (a time in the past means now) and
    ``delay_level`` (RocketMQ's levels, 1..18) is given; the delay may not pass
    ``max_delay_ms`` (the topic's ``delay.max.ms``)."""
    given = [
        name
        for name, v in (
            ("delay_ms", delay_ms),
            ("deliver_at_ms", deliver_at_ms),
            ("delay_level", delay_level),
        )
        if v is not None
    ]
    if len(given) != 1:
        raise InvalidDelayError(
            f"give one of delay_ms, deliver_at_ms and delay_level, not {' and '.join(given)}"
            if given
            else "no delay given"
        )
    if delay_level is not None:
        if type(delay_level) is not int or not 1 <= delay_level <= len(ROCKETMQ_LEVELS_MS):
            raise InvalidDelayError(
                f"delay_level must be 1..{len(ROCKETMQ_LEVELS_MS)} (RocketMQ's levels), "
                f"got {delay_level!r}"
            )
        delay_ms = ROCKETMQ_LEVELS_MS[delay_level - 1]
    if delay_ms is not None:
        if type(delay_ms) is not int:
            raise InvalidDelayError(f"delay_ms must be an int, got {type(delay_ms).__name__}")
        if delay_ms < 0:
            raise InvalidDelayError(f"delay_ms must not be negative, got {delay_ms}")
        due = now_ms + delay_ms
    else:
        if type(deliver_at_ms) is not int:
            raise InvalidDelayError(
                f"deliver_at_ms must be an int (ms since the epoch), got {deliver_at_ms!r}"
            )
        due = max(deliver_at_ms, now_ms)
    if due - now_ms > max_delay_ms:
        raise InvalidDelayError(
            f"a delay of {due - now_ms} ms is over the topic's delay.max.ms ({max_delay_ms} ms)"
        )
    return due


class ScheduleId(NamedTuple):
    """What a schedule id says: when and where the record is delivered."""

    due_ms: int
    partition: int
    lane: int
    """The lane hash: the record's lane in a level of ``n`` lanes is ``lane % n``."""
    nonce: str
    topic: str

    def encode(self) -> str:
        return f"{self.due_ms}~{self.partition}~{self.lane:08x}~{self.nonce}~{self.topic}"

    @classmethod
    def new(
        cls, due_ms: int, topic: str, partition: int, key: bytes | None, nonce: str
    ) -> ScheduleId:
        return cls(due_ms, partition, lane_hash(topic, partition, key, nonce), nonce, topic)

    def lane_in(self, lanes: int) -> int:
        return self.lane % lanes

    @classmethod
    def parse(cls, text: str) -> ScheduleId:
        parts = text.split("~", 4) if isinstance(text, str) else []
        try:
            due, partition, lane, nonce, topic = parts
            if len(lane) != 8:
                raise ValueError(lane)
            parsed = cls(int(due), int(partition), int(lane, 16), nonce, topic)
        except ValueError:
            raise InvalidDelayError(f"not a schedule id: {text!r}") from None
        if parsed.due_ms < 0 or parsed.partition < 0 or not nonce.isalnum() or not topic:
            raise InvalidDelayError(f"not a schedule id: {text!r}")
        return parsed
