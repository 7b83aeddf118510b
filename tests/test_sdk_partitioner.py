"""The partitioner must choose exactly the partition Kafka's Java client chooses."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdk import Producer
from sdk.partitioner import (
    WIDE_KEY,
    DefaultPartitioner,
    group_by_partition,
    murmur2,
    murmur2_many,
    partition_for_key,
    partitions_for_keys,
    to_positive,
)

# Kafka's clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java, testMurmur2
KAFKA_UTILS_TEST = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}

# librdkafka src/rdmurmur2.c, unittest_murmur2 (java_murmur2_results, as unsigned 32-bit);
# adds the tails Kafka's own vectors miss (length % 4 == 1) and the empty key
LIBRDKAFKA_JAVA_RESULTS = {
    b"kafka": 0xD067CF64,
    b"giberish123456789": 0x8F552B0C,
    b"1234": 0x9FC97B14,
    b"234": 0xE7C009CA,
    b"34": 0x873930DA,
    b"4": 0x5A4B5CA1,
    b"PreAmbleWillBeRemoved,ThePrePartThatIs": 0x78424F1C,
    b"reAmbleWillBeRemoved,ThePrePartThatIs": 0x4A62B377,
    b"eAmbleWillBeRemoved,ThePrePartThatIs": 0xE0E4E09E,
    b"AmbleWillBeRemoved,ThePrePartThatIs": 0x62B8B43F,
    b"": 0x106E08D9,
}


@pytest.mark.parametrize(("key", "expected"), KAFKA_UTILS_TEST.items())
def test_murmur2_matches_kafka_utils_test(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


@pytest.mark.parametrize(("key", "expected"), LIBRDKAFKA_JAVA_RESULTS.items())
def test_murmur2_matches_librdkafka_java_vectors(key: bytes, expected: int) -> None:
    assert murmur2(key) & 0xFFFFFFFF == expected


def test_vectors_cover_every_tail_length() -> None:
    tails = {len(k) % 4 for k in [*KAFKA_UTILS_TEST, *LIBRDKAFKA_JAVA_RESULTS]}
    assert tails == {0, 1, 2, 3}


def test_partition_is_to_positive_hash_modulo_count() -> None:
    # toPositive(-790332482) = -790332482 & 0x7fffffff = 1357151166; 1357151166 % 50 = 16
    assert to_positive(murmur2(b"foobar")) == 1357151166
    assert partition_for_key(b"foobar", 50) == 16
    assert partition_for_key(b"abc", 7) == 479470107 % 7  # positive hash unchanged
    for key in KAFKA_UTILS_TEST:
        for n in (1, 3, 12, 1000):
            assert 0 <= partition_for_key(key, n) < n


def test_hash_is_signed_32_bit_and_accepts_any_bytes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        key = rng.randbytes(rng.randrange(0, 40))
        h = murmur2(key)
        assert -(1 << 31) <= h < (1 << 31)
        assert murmur2(bytearray(key)) == h


def test_keys_spread_evenly_over_partitions() -> None:
    n, count = 12, 24_000
    hits = Counter(partition_for_key(f"user-{i}".encode(), n) for i in range(count))
    expected = count / n
    assert set(hits) == set(range(n))
    assert max(abs(v - expected) for v in hits.values()) < 0.06 * expected
    # chi-square with 11 degrees of freedom: 99.9th percentile is 31.3
    assert sum((v - expected) ** 2 / expected for v in hits.values()) < 31.3


def test_same_key_same_partition_whatever_the_partitioner_state() -> None:
    p = DefaultPartitioner(random.Random(1))
    first = p.partition("t", b"k", 10)
    p.batch_closed("t", first, 10)
    assert p.partition("t", b"k", 10) == first == partition_for_key(b"k", 10)


def test_keyless_records_stick_until_the_batch_closes() -> None:
    p = DefaultPartitioner(random.Random(3))
    first = p.partition("t", None, 8)
    assert all(p.partition("t", None, 8) == first for _ in range(100))
    p.batch_closed("t", (first + 1) % 8, 8)  # another partition's batch: no move
    assert p.partition("t", None, 8) == first
    p.batch_closed("t", first, 8)
    second = p.partition("t", None, 8)
    assert second != first
    assert all(p.partition("t", None, 8) == second for _ in range(100))


def test_sticky_choice_is_per_topic_and_prefers_partitions_with_a_leader() -> None:
    p = DefaultPartitioner(random.Random(5))
    seen = set()
    for _ in range(50):
        chosen = p.partition("a", None, 10, available=[2, 7])
        assert chosen in (2, 7)
        seen.add(chosen)
        p.batch_closed("a", chosen, 10, available=[2, 7])
    assert seen == {2, 7}  # it moves between the available ones
    b = p.partition("b", None, 10)
    p.batch_closed("b", b, 10)
    assert p.partition("a", None, 10, available=[2, 7]) in (2, 7)


def test_single_partition_topic_stays_put() -> None:
    p = DefaultPartitioner(random.Random(0))
    assert p.partition("t", None, 1) == 0
    p.batch_closed("t", 0, 1)
    assert p.partition("t", None, 1) == 0


def test_sticky_partitions_spread_over_time() -> None:
    p = DefaultPartitioner(random.Random(11))
    used = Counter()
    for _ in range(3000):
        chosen = p.partition("t", None, 6)
        used[chosen] += 1
        p.batch_closed("t", chosen, 6)
    assert set(used) == set(range(6))
    assert min(used.values()) > 350


def test_murmur2_many_matches_the_golden_vectors_and_the_scalar_hash() -> None:
    golden = {**{k: v & 0xFFFFFFFF for k, v in KAFKA_UTILS_TEST.items()}, **LIBRDKAFKA_JAVA_RESULTS}
    assert murmur2_many(list(golden)).tolist() == list(golden.values())
    assert murmur2_many([]).tolist() == []


@given(st.lists(st.binary(max_size=64), max_size=50), st.integers(1, 4096))
def test_partitions_for_keys_equals_partition_for_key_on_each(
    keys: list[bytes], partitions: int
) -> None:
    assert partitions_for_keys(keys, partitions).tolist() == [
        partition_for_key(k, partitions) for k in keys
    ]


@given(st.lists(st.one_of(st.none(), st.binary(max_size=12)), min_size=1, max_size=60))
def test_send_batch_groups_keyed_records_by_murmur2_and_keyless_ones_sticky(
    keys: list[bytes | None],
) -> None:
    producer = Producer({"bootstrap.servers": "127.0.0.1:1"})
    order, parts, bounds = producer._runs_by_key("t", keys, 7)
    sticky = producer._partitioner.sticky("t")
    seen = []
    for partition, a, b in zip(parts, bounds, bounds[1:], strict=False):
        idx = order[a:b].tolist()
        assert idx and idx == sorted(idx)  # input order kept within a partition
        for i in idx:
            key = keys[i]
            assert partition == (sticky if key is None else partition_for_key(key, 7))
        seen += idx
    assert len(bounds) == len(parts) + 1 and bounds[-1] == len(keys)
    assert sorted(seen) == list(range(len(keys)))  # every record once
    assert len(set(parts)) == len(parts)  # one run per partition


def test_murmur2_many_equals_the_scalar_hash_on_many_random_keys() -> None:
    rng = random.Random(30)
    # every length up to past WIDE_KEY (hashed one by one), many keys of each
    keys = [rng.randbytes(rng.randrange(0, WIDE_KEY + 40)) for _ in range(20_000)]
    keys += [rng.randbytes(n) for n in range(0, 40) for _ in range(50)]
    rng.shuffle(keys)
    expected = [murmur2(k) & 0xFFFFFFFF for k in keys]
    assert murmur2_many(keys).tolist() == expected
    for n in (1, 16, 1024, 4096, 10_000):
        assert partitions_for_keys(keys, n).tolist() == [partition_for_key(k, n) for k in keys]


@given(st.lists(st.integers(0, 20), max_size=200))
def test_group_by_partition_runs_cover_each_record_once_in_input_order(parts: list[int]) -> None:
    order, heads, bounds = group_by_partition(np.array(parts, dtype=np.int64))
    assert bounds[0] == 0 and bounds[-1] == len(parts) and len(bounds) == len(heads) + 1
    assert heads == sorted(set(parts))
    for p, a, b in zip(heads, bounds, bounds[1:], strict=False):
        idx = order[a:b].tolist()
        assert idx == sorted(idx) and idx
        assert all(parts[i] == p for i in idx)
    assert sorted(order.tolist()) == list(range(len(parts)))


def test_moving_the_sticky_partition_does_not_list_the_others() -> None:
    class Available(list[int]):
        """A list that refuses to be iterated (as building the list of the others would)."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("iterated every partition")

    available = Available(range(4096))
    p = DefaultPartitioner(random.Random(9))
    first = p.partition("t", None, 4096, available)
    for _ in range(200):
        p.batch_closed("t", first, 4096, available)
        second = p.partition("t", None, 4096, available)
        assert second != first
        first = second
