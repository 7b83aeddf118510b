"""An S3 outage longer than the local disk can buffer (#19).

The agent's S3 endpoint is a fault-injecting proxy in front of moto that answers every request
``503 SlowDown`` for as long as the outage lasts. Segments then cannot leave the disk, and the
upload backlog bound (``tier.max.pending.bytes``, 4 GiB by default) is far above what this
"disk" holds: the agent's data directory is a 32 MiB disk (the ``fileio`` seam's byte quota,
``storage.wal.crashfs``: free space is what the quota leaves, a write past it fails with
``ENOSPC``) and ``log.dir.min.free.bytes`` is 8 MiB, so the agent has 24 MiB to fill. (The
machine's real free space is not used: other processes on the same filesystem move it.)
Checked:

* producers are refused with the retriable ``LogDirFullError`` before the floor is crossed by
  more than one request (the disk never fills: no append fails, no replica goes offline);
* once the outage ends, uploads commit, committed segments leave the disk, writes are
  accepted again, and every acknowledged record is read back in order.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlsplit

from kazoo.client import KazooClient

from storage.codec import encode_batch
from storage.errors import LogDirFullError, NotLeaderError
from storage.protocol import messages as m
from storage.wal import crashfs
from tests.cluster import Cluster, WireClient, produce_request
from tests.fault_support import data_dir, journal_dir, start_recorded
from tests.faulty_proxy import FaultyProxy
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot
from tests.test_tier import TOPIC, _consume, _manifest

DISK = 32 << 20
FLOOR = 8 << 20
SEGMENT = 1 << 20


def _used(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_an_s3_outage_fills_no_disk_and_writes_resume_after(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    upstream = urlsplit(s3.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultyProxy(upstream.hostname, upstream.port, seed=3) as proxy:
        cluster = Cluster(processes, zk_chroot, tmp_path / "data")
        data = data_dir(cluster, 1)
        crashfs.start_recording(data, journal_dir(cluster, 1))
        crashfs.set_faults(journal_dir(cluster, 1), quota_bytes=DISK)
        agent = start_recorded(
            cluster,
            1,
            f"s3.bucket={s3.bucket}",
            "tier.check.interval.ms=100",
            "s3.request.timeout.ms=1000",
            "s3.max.attempts=2",
            f"log.dir.min.free.bytes={FLOOR}",
            env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url},
        )
        cluster.create_topic(
            TOPIC,
            1,
            configs={"segment.bytes": SEGMENT, "segment.ms": 300, "local.retention.ms": 0},
        )
        cluster.wait_for_leaders(TOPIC)

        async def run() -> tuple[list[bytes], int, int, float]:
            client = await WireClient.connect(agent.host, agent.port)
            acked: list[bytes] = []
            refused = 0
            lowest = DISK - _used(data)
            request_bytes = 0
            try:

                async def produce_until(done: object) -> None:
                    nonlocal refused, lowest, request_bytes
                    while not done():  # type: ignore[operator]
                        values = [b"%09d" % (len(acked) + i) + bytes(1000) for i in range(256)]
                        records = encode_batch(values)
                        request_bytes = max(request_bytes, len(records))
                        resp = await client.call(
                            m.ApiKey.PRODUCE, produce_request(TOPIC, 0, records), wait_s=30
                        )
                        r = resp.topics[0].partitions[0]
                        lowest = min(lowest, DISK - _used(data))
                        if r.error_code == 0:
                            assert r.base_offset == len(acked)
                            acked.extend(values)
                        elif r.error_code == NotLeaderError.code and not acked:
                            await asyncio.sleep(0.05)  # named leader, not serving it yet
                        else:
                            assert r.error_code == LogDirFullError.code, r.error_message
                            refused += 1
                            await asyncio.sleep(0.05)  # the producer's backoff

                await produce_until(lambda: _manifest(zk_client).end > 0)  # healthy first
                proxy.set_faults({"slowdown": 1})  # the outage: S3 answers nothing but 503
                deadline = time.monotonic() + 120
                await produce_until(lambda: refused >= 20 or time.monotonic() > deadline)
                assert refused >= 20, "the agent never refused writes during the outage"
                proxy.clear()
                cleared = time.monotonic()
                before = len(acked)
                await produce_until(
                    lambda: len(acked) >= before + 2560 or time.monotonic() > cleared + 60
                )
                resumed = time.monotonic() - cleared
                assert len(acked) >= before + 2560, "writes did not resume after the outage"
            finally:
                await client.close()
            return acked, lowest, request_bytes, resumed

        acked, lowest, request_bytes, resumed = asyncio.run(run())
        print(
            f"acked={len(acked)} lowest free={(lowest - FLOOR) >> 10} KiB above the floor,"
            f" writes resumed {resumed:.1f} s after the outage, proxy={proxy.counts()}"
        )
        # refused before the floor was crossed by more than the request that found it above
        assert lowest >= FLOOR - 2 * request_bytes - SEGMENT, (lowest, FLOOR)
        log_text = agent.process.log_text()
        assert "offline" not in log_text and "No space left" not in log_text
        got = asyncio.run(_consume(cluster.bootstrap, len(acked)))
        assert got == acked
