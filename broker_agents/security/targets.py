"""What a produce to an internal topic writes elsewhere, for the ACL check of its producer.

Two internal topics carry records that a handler, logged in as a user of its own (often a
super user), later writes somewhere else:

* a **delay level** (``__strata_delay_NN``): each record names its target topic in its
  schedule id (header ``strata.delay.id``, ``due~partition~lane~nonce~topic``), and the
  delay scheduler delivers it there when due;
* the **failures topic** (``__strata_retry_failures``): each record names its consumer group
  (header ``strata.retry.group``), and the retry router sends it to that group's retry topic.

Write on the internal topic alone would let a producer reach any topic through the scheduler,
or any group's consumers through the router. So ``Guard`` also asks, for a producer that is
not a super user, Write on every target topic of a delay level's batches and Read on every
group of a failures batch (what a member of that group has): :func:`indirect_targets` reads
them from the batches' headers with Arrow (no Python per record), once per batch.
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from sdk.delays import HEADER_ID, LEVEL_PREFIX, ScheduleId
from sdk.failures import FAILURES_TOPIC, H_GROUP
from storage.codec import decode_batch, iter_batches
from storage.codec.parts import BatchParts
from storage.errors import CorruptBatchError
from storage.metadata.acls import Operation, ResourceType


def indirect_targets(topic: str, records: Any) -> tuple[Operation, ResourceType, set[str]] | None:
    """For a produce of ``records`` to ``topic``: (operation, resource type, names) its
    producer also needs, or None when ``topic`` writes nowhere else.

    Raises ``CorruptBatchError`` (or another typed error) for batches that do not decode,
    ``InvalidDelayError`` for a schedule id that does not parse."""
    if topic.startswith(LEVEL_PREFIX):
        ids = _header_values(records, HEADER_ID)
        return Operation.WRITE, ResourceType.TOPIC, {_target_topic(v) for v in ids}
    if topic == FAILURES_TOPIC:
        groups = _header_values(records, H_GROUP)
        return Operation.READ, ResourceType.GROUP, {_text(v) for v in groups}
    return None


def _header_values(records: Any, name: str) -> set[bytes]:
    """The distinct values of header ``name`` over every batch in ``records``."""
    if records is None:
        return set()
    if isinstance(records, BatchParts):
        records = records.tobytes()
    out: set[bytes] = set()
    for _, pos in iter_batches(records):
        headers = decode_batch(records, pos).column("headers")
        pairs = pc.list_flatten(headers)
        if not len(pairs):
            continue
        chosen = pc.filter(
            pc.struct_field(pairs, "value"), pc.equal(pc.struct_field(pairs, "key"), name)
        )
        out.update(pc.unique(chosen).to_pylist())
    return out


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise CorruptBatchError("an internal header that is not UTF-8") from None


def _target_topic(schedule_id: bytes) -> str:
    """The topic a schedule id delivers to (``InvalidDelayError`` if it is not one)."""
    return ScheduleId.parse(_text(schedule_id)).topic
