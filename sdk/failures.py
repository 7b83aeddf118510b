"""The failure record: what a failed attempt of a record carries to the retry router.

Its topic (``FAILURES_TOPIC``), its headers (``strata.retry.*``: the original topic, partition
and offset, the attempt that failed, when the first and this one failed, the error) and how it
is built (:func:`build_failure`) and read back (:func:`retry_info`). ``docs/retries.md`` and
``sdk.retry`` (which re-exports these names) tell the rest. Kept apart from ``sdk.retry`` so
that the producer (``Producer.retry_later``, a failure inside a transaction) can build one
without importing the retry machinery, which imports the producer.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sdk.records import ConsumerRecord, TopicPartition

FAILURES_TOPIC = "__strata_retry_failures"
"""Where consumers write failure records; the retry router reads it."""
FAILURES_PARTITIONS = 8
RETRY_PREFIX = "__strata_retry."
ROUTER_GROUP = "__strata_retry_router"
HEADER_PREFIX = "strata.retry."
H_GROUP = "strata.retry.group"
H_TOPIC = "strata.retry.topic"
H_PARTITION = "strata.retry.partition"
H_OFFSET = "strata.retry.offset"
H_ATTEMPT = "strata.retry.attempt"
H_FIRST_MS = "strata.retry.first_failure_ms"
H_FAILED_MS = "strata.retry.failed_ms"
H_ERROR = "strata.retry.error"
H_PARKED = "strata.retry.parked"
H_DUE_MS = "strata.retry.due_ms"
H_PARK = "strata.retry.park"
"""Only on a failure record of a parked record: not a failed attempt."""
MAX_ERROR_BYTES = 1000
H_ORDERING = "strata.retry.ordering"


def retry_topic(group: str) -> str:
    """The group's retry topic: redelivered records, read by that group only."""
    return f"{RETRY_PREFIX}{group}"


def is_retry_topic(topic: str) -> bool:
    return topic.startswith(RETRY_PREFIX)


def header(headers: Sequence[tuple[str, bytes]], name: str) -> bytes | None:
    for k, v in headers:
        if k == name:
            return bytes(v)
    return None


class RetryInfo(NamedTuple):
    """Where a record comes from and how often it failed (:func:`retry_info`)."""

    topic: str
    partition: int
    offset: int
    attempt: int
    """The attempt this delivery is (1: the first)."""
    first_failure_ms: int | None
    last_error: str | None
    parked: int


def retry_info(record: ConsumerRecord) -> RetryInfo:
    """The original topic, partition and offset of ``record`` and its attempt number (for a
    record from a source topic: itself, attempt 1)."""
    h = record.headers
    topic = header(h, H_TOPIC)
    if topic is None or not (is_retry_topic(record.topic) or record.topic == FAILURES_TOPIC):
        return RetryInfo(record.topic, record.partition, record.offset, 1, None, None, 0)
    first = header(h, H_FIRST_MS)
    error = header(h, H_ERROR)
    return RetryInfo(
        topic.decode(),
        int(header(h, H_PARTITION) or b"0"),
        int(header(h, H_OFFSET) or b"0"),
        int(header(h, H_ATTEMPT) or b"0") + 1,
        None if first is None else int(first),
        None if error is None else error.decode(errors="replace"),
        int(header(h, H_PARKED) or b"0"),
    )


def identity_seed(group: str, topic: str, partition: int, offset: int) -> str:
    """The string a record's producer ids and jitter are derived from."""
    return f"{group}/{topic}/{partition}/{offset}"


def derived_producer_id(*parts: object) -> int:
    """A producer id (63 bits, never negative) for one exactly-once output batch."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def failures_partition(group: str, topic: str, partition: int, n: int) -> int:
    """All failures of one source partition share a failures partition (so the router sees
    them in order, which key order needs)."""
    return zlib.crc32(f"{group}/{topic}/{partition}".encode()) % n


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure record, ready to send."""

    tp: TopicPartition
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    tags: list[str] | None
    timestamp: int


def build_failure(
    group: str,
    record: ConsumerRecord,
    reason: str,
    now_ms: int,
    failures_partitions: int,
    *,
    parked: bool = False,
    ordered: bool = False,
    crashes: int = 0,
) -> Failure:
    """The failure record for ``record`` (from a source topic or the group's retry topic);
    ``crashes``: consumers died processing this delivery that many times, each a failed
    attempt (``sdk.crashes``)."""
    info = retry_info(record)
    attempt = info.attempt - 1 if parked else info.attempt + max(crashes - 1, 0)
    parks = info.parked + 1 if parked else info.parked
    user = [(k, bytes(v)) for k, v in record.headers if not k.startswith(("strata.",))]
    error = reason.encode(errors="replace")[:MAX_ERROR_BYTES]
    if parked and info.last_error is not None:
        error = info.last_error.encode()[:MAX_ERROR_BYTES]
    first = info.first_failure_ms if info.first_failure_ms is not None else now_ms
    headers = [
        *user,
        (H_GROUP, group.encode()),
        (H_TOPIC, info.topic.encode()),
        (H_PARTITION, str(info.partition).encode()),
        (H_OFFSET, str(info.offset).encode()),
        (H_ATTEMPT, str(attempt).encode()),
        (H_FIRST_MS, str(first).encode()),
        (H_FAILED_MS, str(now_ms).encode()),
        (H_ERROR, error),
        (H_PARKED, str(parks).encode()),
    ]
    if ordered:
        headers.append((H_ORDERING, b"key"))
    if parked:
        headers.append((H_PARK, b"1"))
    tp = TopicPartition(
        FAILURES_TOPIC, failures_partition(group, info.topic, info.partition, failures_partitions)
    )
    return Failure(tp, record.key, record.value, headers, list(record.tags) or None, now_ms)
