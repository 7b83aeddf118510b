"""The storage-engine step of ``make demo``: a real log on disk, end to end.

Writes a few hundred thousand keyed messages (with headers and tags) through the write-ahead
log with group-commit fsync, as concurrent producers would; closes it; reopens it (running
crash recovery over the active segment); reads every batch back as zero-copy slices, decodes
them to Arrow and checks every record against what was sent; looks an offset up by
timestamp; and prints what it did. Exits non-zero if any check fails.

``infra.demo`` (the full demo) runs it first; ``python -m infra.demo_storage`` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa

from storage.codec import Compression, decode_batches, encode_batch
from storage.config import LogConfig
from storage.wal import GroupCommitLog, PartitionLog

BATCH = 500
PRODUCERS = 8
T0 = 1_763_000_000_000  # a fixed epoch-ms so every run writes the same records


def _records(batch_no: int) -> tuple[list[bytes], list[bytes], int]:
    first = batch_no * BATCH
    keys = [b"user-%d" % ((first + i) % 997) for i in range(BATCH)]
    values = [b"event %d: %s" % (first + i, b"x" * (150 + (first + i) % 100)) for i in range(BATCH)]
    return keys, values, T0 + batch_no * 10


def _digest(values: list[bytes] | pa.Array) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for v in values if isinstance(values, list) else values.to_pylist():
        h.update(v)
    return h.digest()


async def _produce(log: PartitionLog, batches: int) -> tuple[GroupCommitLog, bytes, int]:
    """Append every batch in order; up to PRODUCERS appends wait on fsync at once (group commit)."""
    committer = GroupCommitLog(log)
    await committer.start()
    in_flight = asyncio.Semaphore(PRODUCERS)
    sent = hashlib.blake2b(digest_size=16)
    nbytes = 0

    async def acknowledged(end_offset: int) -> None:
        try:
            await committer.wait_durable(end_offset)
        finally:
            in_flight.release()

    async with asyncio.TaskGroup() as tg:
        for n in range(batches):
            keys, values, ts = _records(n)
            data = encode_batch(
                values,
                keys=keys,
                timestamps=ts,
                headers=[[("source", b"demo")]] * BATCH,
                tags=[["even" if (n * BATCH + i) % 2 == 0 else "odd"] for i in range(BATCH)],
                compression=Compression.NONE,
            )
            for v in values:
                sent.update(v)
            await in_flight.acquire()
            info = log.append(data, leader_epoch=1)
            nbytes += len(data)
            tg.create_task(acknowledged(info.last_offset + 1), name=f"ack-{n}")
    return committer, sent.digest(), nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--dir", type=Path, default=Path("var/demo/orders-0"))
    args = parser.parse_args(argv)
    batches = max(1, args.messages // BATCH)
    total = batches * BATCH
    shutil.rmtree(args.dir, ignore_errors=True)
    config = LogConfig.parse({"segment.bytes": 16 << 20, "fsync.policy": "always"})

    print(f"Strata storage demo: {total:,} messages in batches of {BATCH} -> {args.dir}")
    log = PartitionLog.open(args.dir, config)
    t = time.perf_counter()
    committer, sent_digest, nbytes = asyncio.run(_produce(log, batches))
    write_s = time.perf_counter() - t
    segments = len(log.segments)
    asyncio.run(committer.close())
    print(
        f"  wrote    {total:>9,} msgs  {nbytes / 1e6:8.1f} MB  in {write_s:6.2f} s"
        f"  ({total / write_s:,.0f} msgs/s, {nbytes / 1e6 / write_s:.0f} MB/s)"
        f"  fsync=always: {committer.fsyncs} group commits for {batches} batches, {segments} segments"
    )

    t = time.perf_counter()
    log = PartitionLog.open(args.dir, config)
    reopen_s = time.perf_counter() - t
    print(
        f"  reopened in {reopen_s * 1000:.0f} ms: log [{log.log_start_offset}, {log.log_end_offset}),"
        f" {log.size_bytes / 1e6:.1f} MB on disk in {len(log.segments)} segments"
    )

    t = time.perf_counter()
    got = hashlib.blake2b(digest_size=16)
    rows = 0
    offset = log.log_start_offset
    expected_offset = 0
    tags_even = 0
    while offset < log.log_end_offset:
        chunk = log.read(offset, 4 << 20)
        table = decode_batches(chunk.data)
        offsets = table.column("offset").to_numpy()
        if offsets[0] != expected_offset or not (offsets[1:] - offsets[:-1] == 1).all():
            print(f"FAIL: offsets not contiguous at {offsets[0]}", file=sys.stderr)
            return 1
        for v in table.column("value").to_pylist():
            got.update(v)
        tags_even += table.column("tags").to_pylist().count(["even"])
        rows += table.num_rows
        expected_offset = offset = chunk.next_offset
    read_s = time.perf_counter() - t
    print(
        f"  read     {rows:>9,} msgs back as Arrow in {read_s:6.2f} s ({rows / read_s:,.0f} msgs/s),"
        f" {tags_even:,} tagged 'even'"
    )

    target = T0 + (batches // 2) * 10
    found = log.offset_for_timestamp(target)
    log.close()

    checks = {
        "every message read back, in order": rows == total,
        "contents byte-identical (blake2b of all values)": got.digest() == sent_digest,
        "tags survived": tags_even == (total + 1) // 2,
        "group commit shared fsyncs": committer.fsyncs < batches,
        "timestamp lookup": found == (batches // 2) * BATCH,
    }
    print(f"  timestamp {target} -> offset {found}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
