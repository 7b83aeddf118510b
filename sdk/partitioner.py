"""Which partition a record goes to — the same choice Kafka's Java client makes.

A record with a key goes to ``toPositive(murmur2(key)) % num_partitions`` where ``murmur2`` is
Kafka's ``Utils.murmur2`` (MurmurHash2, 32-bit, seed ``0x9747b28c``, little-endian 4-byte
blocks, Java ``int`` overflow) and ``toPositive(h) = h & 0x7fffffff``, so keyed data written by
Strata and by any Kafka client lands on the same partitions.

A record without a key uses sticky partitioning: every keyless record of a topic goes to the
same partition until that partition's batch is closed (full) or sent, then the topic sticks to
another partition, picked at random among those with a known leader. Batches fill up instead
of being spread one record per partition, which is what makes keyless produce cheap.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF
_BLOCK = struct.Struct("<I")


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2``: a signed 32-bit hash, equal to what Java returns."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    n4 = length & ~3
    for (k,) in _BLOCK.iter_unpack(memoryview(data)[:n4]):
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = length & 3
    if rest:
        if rest == 3:
            h ^= data[n4 + 2] << 16
        if rest >= 2:
            h ^= data[n4 + 1] << 8
        h ^= data[n4]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def to_positive(h: int) -> int:
    return h & 0x7FFFFFFF


def partition_for_key(key: bytes, num_partitions: int) -> int:
    """Kafka's ``BuiltInPartitioner.partitionForKey``."""
    return to_positive(murmur2(key)) % num_partitions


class DefaultPartitioner:
    """Keyed records by murmur2; keyless records sticky per topic (see the module docstring)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._sticky: dict[str, int] = {}

    def partition(
        self,
        topic: str,
        key: bytes | None,
        num_partitions: int,
        available: Sequence[int] = (),
    ) -> int:
        if key is not None:
            return partition_for_key(key, num_partitions)
        p = self._sticky.get(topic)
        if p is None or p >= num_partitions:
            p = self._choose(topic, num_partitions, available, previous=None)
        return p

    def sticky(self, topic: str) -> int | None:
        """The topic's current sticky partition for keyless records (None: not chosen yet)."""
        return self._sticky.get(topic)

    def batch_closed(
        self, topic: str, partition: int, num_partitions: int, available: Sequence[int] = ()
    ) -> None:
        """A batch of ``topic``/``partition`` filled up or left: move the topic's sticky choice."""
        if self._sticky.get(topic) == partition:
            self._choose(topic, num_partitions, available, previous=partition)

    def _choose(
        self, topic: str, num_partitions: int, available: Sequence[int], previous: int | None
    ) -> int:
        choices: Sequence[int] = available if available else range(num_partitions)
        if len(choices) > 1 and previous is not None:
            choices = [p for p in choices if p != previous]
        p = choices[self._rng.randrange(len(choices))]
        self._sticky[topic] = p
        return p
