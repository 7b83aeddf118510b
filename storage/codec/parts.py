"""A whole batch held as pieces laid side by side, appended without joining them.

The Kafka listener keeps a client's batch as the body of a Strata batch
(``storage.codec.kafka_body``): a 72-byte header built here, the Kafka batch as it arrived
in the request, a few bytes of padding and summary. Joining the three would copy the
batch into a fresh buffer of its size for every produce, only for the log to copy it
again into the page cache; as :class:`BatchParts` the log writes the pieces with one
gathered write (``os.pwritev``) straight from the request's buffer.

Only the producer of the parts may build one: it stands for a batch already checked (its
``header`` is what the pieces hold, the CRC included), and the log takes it only with that
header as ``checked``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage.codec.header import HEADER_SIZE, BatchHeader


@dataclass(frozen=True, slots=True)
class BatchParts:
    """One whole, checked batch as ``parts`` (the first holds the whole 72-byte header)."""

    header: BatchHeader
    parts: tuple[Any, ...]

    def __post_init__(self) -> None:
        sizes = [memoryview(p).nbytes for p in self.parts]
        if not sizes or sizes[0] < HEADER_SIZE or sum(sizes) != self.header.size:
            raise ValueError(f"parts of {sizes} bytes do not hold a {self.header.size}-byte batch")

    def __len__(self) -> int:
        return self.header.size

    def tobytes(self) -> bytes:
        return b"".join(self.parts)
