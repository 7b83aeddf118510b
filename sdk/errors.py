"""Errors raised only by the client side; all are :class:`storage.errors.StrataError`.

They have no wire code (nothing sends them over the network), so they live here rather than in
``storage.errors``; every error an agent sends arrives as the class ``storage.errors.for_code``
names. ::

    StrataError
    ├── BufferExhaustedError     retriable: buffer.memory stayed full for max.block.ms
    ├── DeliveryTimeoutError     retriable: a batch was not acknowledged within delivery.timeout.ms
    ├── ProducerClosedError      send after close(), or records left when the producer stopped
    ├── NoOffsetForPartitionError  no position and auto.offset.reset=none
    └── IllegalStateError        an operation on a partition that is not assigned, a client not
                                 started, and other misuse
"""

from __future__ import annotations

from storage.errors import StrataError


class BufferExhaustedError(StrataError):
    """The producer's buffer (``buffer.memory``) stayed full for ``max.block.ms``."""

    retriable = True


class DeliveryTimeoutError(StrataError):
    """A batch was not acknowledged within ``delivery.timeout.ms`` (``__cause__``: last error)."""

    retriable = True


class ProducerClosedError(StrataError):
    """The producer is closed (or stopped before the record could be sent)."""


class NoOffsetForPartitionError(StrataError):
    """A partition has no position and ``auto.offset.reset`` is ``none``."""

    def __init__(self, topic: str, partition: int) -> None:
        super().__init__(
            f"{topic}[{partition}] has no position and auto.offset.reset is 'none': seek first"
        )
        self.topic = topic
        self.partition = partition


class IllegalStateError(StrataError):
    """The client was used in a way its current state does not allow."""
