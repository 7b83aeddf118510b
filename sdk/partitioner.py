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

import numpy as np

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


_M32 = np.uint32(_M)
_SEED32 = np.uint32(_SEED)
#: keys longer than this are hashed one by one (``murmur2``): the grid ``murmur2_many`` lays
#: the keys out in is as wide as the longest key, so one huge key must not widen it for all
WIDE_KEY = 256


def murmur2_many(keys: Sequence[bytes]) -> np.ndarray:
    """``murmur2`` of every key at once (as unsigned 32-bit values), without a Python loop
    per key: the keys are laid out as rows of little-endian 4-byte blocks (zero past each
    key's end) and each block column is mixed into every row that has that block. Keys over
    ``WIDE_KEY`` bytes (rare) are hashed one at a time, so the grid stays at most
    ``len(keys) * WIDE_KEY`` bytes."""
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.uint32)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    if lengths.max() > WIDE_KEY:
        wide = np.flatnonzero(lengths > WIDE_KEY).tolist()
        narrow = np.flatnonzero(lengths <= WIDE_KEY)
        out = np.empty(n, dtype=np.uint32)
        out[narrow] = murmur2_many([keys[i] for i in narrow.tolist()])
        out[wide] = [murmur2(keys[i]) & _MASK for i in wide]
        return out
    width = (int(lengths.max()) + 3) & ~3 or 4
    flat = np.frombuffer(b"".join(keys) + bytes(width), dtype=np.uint8)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    cols = np.arange(width)
    grid = flat[starts[:, None] + cols]  # each key's bytes, then whatever follows it
    grid[cols >= lengths[:, None]] = 0
    words = grid.view("<u4")
    blocks = lengths >> 2
    h = _SEED32 ^ lengths.astype(np.uint32)
    with np.errstate(over="ignore"):  # Java int arithmetic: wrap modulo 2**32
        for j in range(words.shape[1]):
            k = words[:, j] * _M32
            k ^= k >> np.uint32(24)
            k *= _M32
            h = np.where(blocks > j, (h * _M32) ^ k, h)
        rest = lengths & 3
        # the 1-3 tail bytes, little-endian and zero-padded, are the next block's word
        tail = words[np.arange(n), np.minimum(blocks, words.shape[1] - 1)]
        h = np.where(rest > 0, (h ^ tail) * _M32, h)
        h ^= h >> np.uint32(13)
        h *= _M32
        h ^= h >> np.uint32(15)
    result: np.ndarray = h
    return result


def partitions_for_keys(keys: Sequence[bytes], num_partitions: int) -> np.ndarray:
    """``partition_for_key`` of every key at once (int64 array)."""
    return (murmur2_many(keys) & np.uint32(0x7FFFFFFF)).astype(np.int64) % num_partitions


def group_by_partition(parts: np.ndarray) -> tuple[np.ndarray, list[int], list[int]]:
    """Records grouped by partition without a Python loop per record: ``order`` (a stable
    argsort of ``parts``: input order kept within a partition), the partition of each run of
    ``parts[order]``, and the runs' bounds (run ``r`` is ``order[bounds[r]:bounds[r + 1]]``)."""
    order = np.argsort(parts, kind="stable")
    ordered = parts[order]
    starts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    heads = np.concatenate(([0], starts)) if len(parts) else starts
    return order, ordered[heads].tolist(), [*heads.tolist(), len(parts)]


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
        p = choices[self._rng.randrange(len(choices))]
        if previous is not None and len(choices) > 1:
            # uniform among the others without building a list of them (O(1) expected:
            # at most half the draws hit ``previous``, which appears in ``choices`` once)
            while p == previous:
                p = choices[self._rng.randrange(len(choices))]
        self._sticky[topic] = p
        return p
