"""Client configuration: Kafka's dotted names, defaults, and typed validation errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sdk import Consumer, ConsumerConfig, Producer, ProducerConfig
from sdk.config import split_host_port
from storage.codec import Compression
from storage.errors import InvalidConfigError, StrataError

BOOT = {"bootstrap.servers": "localhost:9092"}


def test_producer_defaults() -> None:
    c = ProducerConfig.parse(BOOT)
    assert c.bootstrap_servers == ("localhost:9092",)
    assert c.acks == 1
    assert c.linger_ms == 5
    assert c.batch_size == 1 << 20
    assert c.buffer_memory == 64 << 20
    assert c.max_block_ms == 60_000
    assert c.request_timeout_ms == 30_000
    assert c.retries == 2_147_483_647
    assert c.delivery_timeout_ms == 120_000
    assert (c.retry_backoff_ms, c.retry_backoff_max_ms) == (100, 1000)
    assert c.max_in_flight_requests_per_connection == 5
    assert c.compression is Compression.NONE


def test_dotted_and_python_names_are_the_same_setting() -> None:
    dotted = ProducerConfig.parse(
        {
            "bootstrap.servers": "a:1,b:2",
            "client.id": "me",
            "linger.ms": 20,
            "batch.size": 4096,
            "buffer.memory": 1 << 20,
            "max.block.ms": 10,
            "retry.backoff.ms": 5,
            "retry.backoff.max.ms": 50,
            "max.in.flight.requests.per.connection": 1,
            "compression.type": "zstd",
        }
    )
    python = ProducerConfig(
        bootstrap_servers=["a:1", "b:2"],
        client_id="me",
        linger_ms=20,
        batch_size=4096,
        buffer_memory=1 << 20,
        max_block_ms=10,
        retry_backoff_ms=5,
        retry_backoff_max_ms=50,
        max_in_flight_requests_per_connection=1,
        compression_type="zstd",
    )
    assert dotted == python
    assert dotted.addresses == [("a", 1), ("b", 2)]
    assert dotted.compression is Compression.ZSTD


@pytest.mark.parametrize(
    ("given", "expected"),
    [("all", -1), ("ALL", -1), (-1, -1), ("-1", -1), (0, 0), ("0", 0), (1, 1), ("1", 1)],
)
def test_acks(given: object, expected: int) -> None:
    assert ProducerConfig.parse({**BOOT, "acks": given}).acks == expected


@pytest.mark.parametrize("bad", [2, "2", "some", None, 1.5])
def test_bad_acks(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="acks"):
        ProducerConfig.parse({**BOOT, "acks": bad})


def test_bootstrap_servers_forms() -> None:
    assert ProducerConfig.parse({"bootstrap.servers": " a:1 , b:2 ,"}).bootstrap_servers == (
        "a:1",
        "b:2",
    )
    assert ProducerConfig.parse({"bootstrap.servers": ["[::1]:9092"]}).addresses == [("::1", 9092)]
    assert split_host_port("host.example:65535") == ("host.example", 65535)


@pytest.mark.parametrize("bad", ["", "nohost", "a:0", "a:70000", "a:b", ["a:1", 5], [], ":9092"])
def test_bad_bootstrap_servers(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match=r"bootstrap\.servers"):
        ProducerConfig.parse({"bootstrap.servers": bad})


def test_missing_bootstrap_servers() -> None:
    with pytest.raises(InvalidConfigError, match=r"bootstrap\.servers: Field required"):
        ProducerConfig.parse({})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("linger.ms", -1),
        ("batch.size", -5),
        ("buffer.memory", 0),
        ("max.block.ms", -1),
        ("request.timeout.ms", 0),
        ("retries", -1),
        ("max.in.flight.requests.per.connection", 0),
        ("max.request.size", 0),
        ("linger.ms", "soon"),
    ],
)
def test_out_of_range_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        ProducerConfig.parse({**BOOT, key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value)


def test_errors_are_typed_strata_errors_from_every_entry_point() -> None:
    with pytest.raises(InvalidConfigError) as info:
        ProducerConfig(bootstrap_servers=["a:1"], linger_ms=-1)
    assert isinstance(info.value, StrataError)
    assert not info.value.retriable
    assert info.value.code == 40
    with pytest.raises(InvalidConfigError):
        ProducerConfig.model_validate({**BOOT, "linger.ms": -1})
    with pytest.raises(InvalidConfigError):
        Producer({**BOOT, "acks": 3})
    with pytest.raises(InvalidConfigError):
        Consumer({**BOOT, "auto.offset.reset": "middle"})


def test_unknown_key_is_rejected_by_name() -> None:
    with pytest.raises(InvalidConfigError, match=r"linger\.msec: Extra inputs"):
        ProducerConfig.parse({**BOOT, "linger.msec": 5})


def test_unsupported_compression_says_what_is_supported() -> None:
    with pytest.raises(InvalidConfigError, match=r"gzip.*not supported.*zstd"):
        ProducerConfig.parse({**BOOT, "compression.type": "gzip"})
    assert ProducerConfig.parse({**BOOT, "compression.type": "LZ4"}).compression is Compression.LZ4


def test_delivery_timeout_must_cover_linger_and_request_timeout() -> None:
    with pytest.raises(
        InvalidConfigError, match=r"delivery\.timeout\.ms \(1000\) must be at least"
    ):
        ProducerConfig.parse({**BOOT, "delivery.timeout.ms": 1000})
    ok = ProducerConfig.parse(
        {**BOOT, "delivery.timeout.ms": 1000, "request.timeout.ms": 900, "linger.ms": 100}
    )
    assert ok.delivery_timeout_ms == 1000


def test_idempotence_is_on_unless_acks_0_and_needs_acks_and_retries() -> None:
    assert ProducerConfig.parse(BOOT).idempotent
    assert ProducerConfig.parse(BOOT, acks="all").idempotent
    assert not ProducerConfig.parse(BOOT, acks=0).idempotent
    assert not ProducerConfig.parse(BOOT, **{"enable.idempotence": False}).idempotent
    for bad in ({"acks": 0}, {"retries": 0}):
        with pytest.raises(InvalidConfigError, match=r"enable\.idempotence"):
            ProducerConfig.parse(BOOT, **{"enable.idempotence": True, **bad})


def test_backoff_max_below_backoff_means_constant_backoff() -> None:
    c = ProducerConfig.parse({**BOOT, "retry.backoff.ms": 500, "retry.backoff.max.ms": 100})
    assert c.effective_backoff_max_ms == 500


def test_configs_are_frozen_and_copyable() -> None:
    c = ProducerConfig.parse(BOOT)
    with pytest.raises(ValidationError):
        c.linger_ms = 7  # type: ignore[misc]
    assert c.model_copy(update={"linger_ms": 7}).linger_ms == 7
    assert ProducerConfig.parse(c) is c
    assert ProducerConfig.parse(c, linger_ms=9).linger_ms == 9


def test_consumer_defaults_and_names() -> None:
    c = ConsumerConfig.parse(BOOT)
    assert c.fetch_max_wait_ms == 500
    assert c.fetch_min_bytes == 1
    assert c.fetch_max_bytes == 50 << 20
    assert c.max_partition_fetch_bytes == 1 << 20
    assert c.auto_offset_reset == "latest"
    assert c.isolation_level == "read_uncommitted"
    assert c.group_id is None
    d = ConsumerConfig.parse(
        {
            **BOOT,
            "group.id": "g",
            "fetch.max.wait.ms": 10,
            "fetch.min.bytes": 100,
            "fetch.max.bytes": 1 << 20,
            "max.partition.fetch.bytes": 1 << 10,
            "auto.offset.reset": "earliest",
            "max.poll.records": 7,
            "isolation.level": "read_uncommitted",
        }
    )
    assert (d.group_id, d.fetch_max_wait_ms, d.max_poll_records) == ("g", 10, 7)
    assert ConsumerConfig.parse({**BOOT, "auto.offset.reset": "smallest"}).auto_offset_reset == (
        "earliest"
    )
    assert ConsumerConfig.parse({**BOOT, "auto.offset.reset": "none"}).auto_offset_reset == "none"


def test_consumer_isolation_levels() -> None:
    assert ConsumerConfig.parse({**BOOT, "isolation.level": "read_committed"}).read_committed
    assert not ConsumerConfig.parse(BOOT).read_committed
    with pytest.raises(InvalidConfigError, match=r"isolation\.level"):
        ConsumerConfig.parse({**BOOT, "isolation.level": "serializable"})


def test_transactional_producer_config() -> None:
    c = ProducerConfig.parse({**BOOT, "transactional.id": "tx-1"})
    assert (c.transactional_id, c.acks, c.idempotent, c.transaction_timeout_ms) == (
        "tx-1",
        -1,
        True,
        60_000,
    )
    assert ProducerConfig.parse({**BOOT, "transactional.id": "t", "acks": "all"}).acks == -1
    for bad in ({"acks": 1}, {"enable.idempotence": False}):
        with pytest.raises(InvalidConfigError, match=r"transactional\.id needs acks=all"):
            ProducerConfig.parse({**BOOT, "transactional.id": "t", **bad})
    with pytest.raises(InvalidConfigError, match=r"transaction\.timeout\.ms"):
        ProducerConfig.parse({**BOOT, "transactional.id": "t", "transaction.timeout.ms": 0})


def test_consumer_rejects_bad_values() -> None:
    with pytest.raises(InvalidConfigError, match=r"auto\.offset\.reset"):
        ConsumerConfig.parse({**BOOT, "auto.offset.reset": "middle"})
    with pytest.raises(InvalidConfigError, match=r"linger\.ms: Extra inputs"):
        ConsumerConfig.parse({**BOOT, "linger.ms": 5})  # a producer setting


def test_subscribe_needs_a_group_id_and_excludes_assign() -> None:
    from sdk.errors import IllegalStateError

    with pytest.raises(IllegalStateError, match=r"group\.id"):
        Consumer(BOOT).subscribe(["t"])
    consumer = Consumer({**BOOT, "group.id": "g"})
    consumer.subscribe(["t"])
    with pytest.raises(IllegalStateError, match="subscribed"):
        consumer.assign([("t", 0)])
    c = ConsumerConfig.parse({**BOOT, "partition.assignment.strategy": "cooperative-sticky,range"})
    assert c.partition_assignment_strategy == ("cooperative-sticky", "range")
    with pytest.raises(InvalidConfigError, match=r"partition\.assignment\.strategy"):
        ConsumerConfig.parse({**BOOT, "partition.assignment.strategy": "sticky"})
