"""The Strata SDK: what applications import to produce and consume.

Async first (``Producer``, ``Consumer``; asyncio), with blocking wrappers (``SyncProducer``,
``SyncConsumer``) for code that is not async. Configuration takes Kafka's dotted names
(``ProducerConfig``, ``ConsumerConfig``); keyed records land on the partition Kafka's Java
client would choose. The SDK depends on ``storage`` (codec, wire protocol, errors) only.

How the producer batches and sends is explained in ``sdk.accumulator`` and ``sdk.producer``;
how the consumer fetches ahead in ``sdk.consumer``. Errors are ``storage.errors.StrataError``
subclasses (``retriable`` tells whether trying again can help); client-only ones are in
``sdk.errors``.
"""

from sdk.config import ClientConfig, ConsumerConfig, ProducerConfig
from sdk.consumer import Consumer
from sdk.errors import (
    BufferExhaustedError,
    DeliveryTimeoutError,
    IllegalStateError,
    NoOffsetForPartitionError,
    ProducerClosedError,
)
from sdk.producer import Producer
from sdk.records import (
    ConsumerRecord,
    OffsetAndTimestamp,
    RecordMetadata,
    RecordsMetadata,
    StoredRuns,
    TopicPartition,
)
from sdk.sync import SyncConsumer, SyncProducer

__all__ = [
    "BufferExhaustedError",
    "ClientConfig",
    "Consumer",
    "ConsumerConfig",
    "ConsumerRecord",
    "DeliveryTimeoutError",
    "IllegalStateError",
    "NoOffsetForPartitionError",
    "OffsetAndTimestamp",
    "Producer",
    "ProducerClosedError",
    "ProducerConfig",
    "RecordMetadata",
    "RecordsMetadata",
    "StoredRuns",
    "SyncConsumer",
    "SyncProducer",
    "TopicPartition",
]
