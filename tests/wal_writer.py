"""A WAL writer process for the crash tests: ``python tests/wal_writer.py DIR``.

It appends batches with content derived from the batch number alone, fsyncs each one
(``fsync.policy=always`` plus ``flush``), and only then prints the last offset of the batch on
stdout: a printed offset is an acknowledged one. It runs until it is killed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.codec import encode_batch
from storage.config import LogConfig
from storage.wal import PartitionLog

T0 = 1_700_000_000_000
CONFIG = {
    "segment.bytes": 8192,
    "index.interval.bytes": 1024,
    "fsync.policy": "always",
}


def batch_values(batch: int) -> list[bytes]:
    return [b"%d-%d" % (batch, i) + b"." * (batch % 97) for i in range(1 + batch % 5)]


def batch_timestamp(batch: int) -> int:
    return T0 + batch


def expected_records(count: int) -> list[tuple[int, int, bytes, bytes]]:
    """(offset, timestamp, key, value) of the first ``count`` records the writer writes."""
    out: list[tuple[int, int, bytes, bytes]] = []
    batch = 0
    while len(out) < count:
        for value in batch_values(batch):
            out.append((len(out), batch_timestamp(batch), b"k%d" % batch, value))
        batch += 1
    return out[:count]


def main(directory: str, limit: int = 1_000_000) -> None:
    log = PartitionLog.open(directory, LogConfig.parse(CONFIG))
    for batch in range(limit):
        values = batch_values(batch)
        data = encode_batch(
            values, keys=[b"k%d" % batch] * len(values), timestamps=batch_timestamp(batch)
        )
        info = log.append(data, leader_epoch=1)
        log.flush()
        sys.stdout.write(f"{info.last_offset}\n")
        sys.stdout.flush()
    log.close()


if __name__ == "__main__":
    main(sys.argv[1])
