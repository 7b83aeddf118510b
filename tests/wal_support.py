"""Helpers for the write-ahead-log tests: configs, deterministic batches, whole-log reads."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage.codec import decode_batches, encode_batch
from storage.config import LogConfig
from storage.wal import PartitionLog

#: a timestamp base far from "now", so no test depends on the wall clock
T0 = 1_700_000_000_000


def config(**overrides: Any) -> LogConfig:
    """A small-segment config; keyword names use ``_`` for Kafka's ``.``."""
    values: dict[str, Any] = {
        "segment.bytes": 8192,
        "max.message.bytes": 65536,
        "index.interval.bytes": 512,
        "fsync.policy": "always",
    }
    values.update({k.replace("_", "."): v for k, v in overrides.items()})
    return LogConfig.parse(values)


@dataclass(frozen=True)
class Record:
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Produced:
    """One producer batch and the records it holds (offsets relative to the batch)."""

    data: bytes
    timestamps: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]

    def __len__(self) -> int:
        return len(self.values)

    def records(self, base: int) -> list[Record]:
        return [
            Record(base + i, t, k, v)
            for i, (t, k, v) in enumerate(zip(self.timestamps, self.keys, self.values, strict=True))
        ]


def produce(
    rng: random.Random,
    *,
    count: int | None = None,
    value_size: int | None = None,
    ts: int = T0,
    jitter: int = 0,
) -> Produced:
    """A batch of ``count`` records with random content; timestamps ``ts`` +- ``jitter``."""
    n = rng.randint(1, 7) if count is None else count
    keys: list[bytes | None] = [
        None if rng.random() < 0.2 else rng.randbytes(rng.randint(0, 12)) for _ in range(n)
    ]
    values: list[bytes | None] = [
        rng.randbytes(rng.randint(0, 600) if value_size is None else value_size) for _ in range(n)
    ]
    timestamps = [ts + rng.randint(-jitter, jitter) for _ in range(n)]
    data = encode_batch(values, keys=keys, timestamps=timestamps)
    return Produced(data, timestamps, keys, values)


def decode(buf: Any) -> list[Record]:
    """Every record of the whole batches in ``buf`` (CRC-checked), as plain values."""
    table = decode_batches(buf, verify=True)
    return [
        Record(o, t, k, v)
        for o, t, k, v in zip(
            table.column("offset").to_pylist(),
            table.column("timestamp").cast(pa.int64()).to_pylist(),
            table.column("key").to_pylist(),
            table.column("value").to_pylist(),
            strict=True,
        )
    ]


def read_all(log: PartitionLog, start: int | None = None, max_bytes: int = 1 << 20) -> list[Record]:
    """Every record from ``start`` (default: the log start) to the log end, read slice by slice."""
    offset = log.log_start_offset if start is None else start
    out: list[Record] = []
    while offset < log.log_end_offset:
        s = log.read(offset, max_bytes)
        assert s.batch_count >= 1 and s.next_offset > offset
        out.extend(r for r in decode(s.data) if r.offset >= offset)
        offset = s.next_offset
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    """Name -> contents of every file in ``directory``."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}
