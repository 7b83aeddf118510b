"""The object tier under S3 faults: a real agent whose S3 endpoint is a fault-injecting proxy.

The proxy (``tests/faulty_proxy.py``) sits in front of the session's moto server. While a
producer writes steadily (acks=1, raw protocol so every answer is seen), the proxy answers
503 SlowDown, stalls, resets connections and drops replies of requests it did forward, for
``FAULT_S``; then the faults are cleared. Checked:

* every acknowledged message is read back afterwards from offset 0, in order, byte-identical
  (from S3: local retention is 0, so committed segments leave the disk);
* the manifest is contiguous with no segment twice, and the bucket holds exactly the committed
  objects (a lost PUT reply was retried into the same key, not into a second object);
* while faults last, the agent's RSS stays below a bound, its uncommitted bytes stay bounded
  by ``tier.max.pending.bytes`` (plus the one request that found it below), and producers
  are refused with the retriable ``UploadBacklogError`` instead;
* after the faults clear, the manifest reaches the log end within 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kazoo.client import KazooClient

from storage.codec import encode_batch
from storage.errors import ObjectExistsError, ObjectStoreError, UploadBacklogError
from storage.protocol import messages as m
from storage.tier import ObjectStore, ObjectStoreConfig
from tests.cluster import Cluster, WireClient, produce_request
from tests.faulty_proxy import FaultyProxy
from tests.harness import ProcessGroup, S3Target, ZooKeeperChroot, rss_bytes
from tests.test_tier import TOPIC, _consume, _keys, _manifest

FAULT_S = 12.0
RESUME_S = 30.0
MAX_PENDING = 3 << 20
SEGMENT = 256 << 10
RSS_HEADROOM = 64 << 20
FAULTS = {"slowdown": 4, "stall": 1, "reset": 2, "lost_reply": 2, "pass": 1}


def _uncommitted_bytes(zk: KazooClient, log_dir: Path) -> int:
    """Bytes of local segments at or above the manifest's end.

    The scan is repeated until the manifest's end is the same before and after it: a commit
    (and the local retention after it) landing mid-scan would otherwise count a segment that
    was already committed when the agent last checked its backlog.
    """
    while True:
        end = _manifest(zk).end
        total = 0
        for entry in os.scandir(log_dir):
            if entry.name.endswith(".log") and int(entry.name[:-4]) >= end:
                with contextlib.suppress(FileNotFoundError):  # removed by local retention
                    total += entry.stat().st_size
        if _manifest(zk).end == end:
            return total


def _values(start: int, n: int) -> list[bytes]:
    return [
        b"faulty-%08d-" % i + bytes([i % 251]) * (300 + i % 97) for i in range(start, start + n)
    ]


def test_lost_put_reply_is_retried_into_the_same_key_and_recognised(
    s3_credentials: S3Target,
) -> None:
    """A PUT whose reply was lost answers 412 on retry; the suffix GET reads the trailer back."""
    s3 = s3_credentials
    upstream = urlsplit(s3.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None
    body = bytes(range(256)) * 1000

    async def run(proxy: FaultyProxy) -> None:
        store = ObjectStore(
            ObjectStoreConfig(
                bucket=s3.bucket,
                endpoint_url=proxy.endpoint_url,
                region=s3.region,
                request_timeout=2.0,
                max_attempts=1,
            )
        )
        try:
            proxy.set_faults({"lost_reply": 1})
            with pytest.raises(ObjectStoreError):
                await store.put_if_absent("k", body)
            proxy.clear()
            with pytest.raises(ObjectExistsError):
                await store.put_if_absent("k", body)
            assert await store.get_range("k", -88, 0) == body[-88:]  # "bytes=-88"
            assert await store.get_range("k", 10, 20) == body[10:20]
        finally:
            await store.close()

    with FaultyProxy(upstream.hostname, upstream.port) as proxy:
        asyncio.run(run(proxy))
    assert _keys(s3) == {"k"}


@pytest.mark.slow
def test_s3_faults_lose_nothing_commit_once_bound_memory_and_recover(
    processes: ProcessGroup,
    zk_chroot: ZooKeeperChroot,
    zk_client: KazooClient,
    s3: S3Target,
    tmp_path: Path,
) -> None:
    upstream = urlsplit(s3.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None
    with FaultyProxy(upstream.hostname, upstream.port, seed=7) as proxy:
        cluster = Cluster(processes, zk_chroot, tmp_path / "data")
        env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url}
        agent = cluster.start_agent(
            1,
            f"s3.bucket={s3.bucket}",
            "tier.check.interval.ms=100",
            "s3.request.timeout.ms=1000",
            "s3.max.attempts=3",
            f"tier.max.pending.bytes={MAX_PENDING}",
            env=env,
        )
        cluster.create_topic(
            TOPIC,
            1,
            configs={"segment.bytes": SEGMENT, "segment.ms": 300, "local.retention.ms": 0},
        )
        cluster.wait_for_leaders(TOPIC)
        spec = json.loads(zk_client.get(f"/topics/{TOPIC}")[0])
        log_dir = next((tmp_path / "data" / "agent-1").rglob(f"{TOPIC}-0"))
        report = asyncio.run(
            _scenario(proxy, agent.host, agent.port, agent.process.pid, zk_client, log_dir)
        )
        acked: list[bytes] = report["acked"]

        # 1. nothing acknowledged is lost: all of it, from the start, byte for byte (from S3)
        got = asyncio.run(_consume(cluster.bootstrap, len(acked)))
        assert got == acked

        # 2. no segment committed twice; the bucket holds exactly the committed objects
        manifest = _manifest(zk_client)
        assert manifest.start == 0 and manifest.end == len(acked)
        bases = [s.base_offset for s in manifest.segments]
        assert len(set(bases)) == len(bases)
        for a, b in zip(manifest.segments, manifest.segments[1:], strict=False):
            assert a.next_offset == b.base_offset  # contiguous, no overlap
        committed = [s.key(TOPIC, spec["topic_id"], 0) for s in manifest.segments]
        assert len(set(committed)) == len(committed)
        assert set(committed) == {k for k in _keys(s3) if k.endswith(".seg")}

    # 3. bounded while faults lasted; producers got the retriable backlog error
    print(
        f"acked={len(acked)} backlog_errors={report['backlog_errors']} "
        f"rss_base={report['rss_base'] >> 20} MiB rss_max={report['rss_max'] >> 20} MiB "
        f"uncommitted_max={report['uncommitted_max']} resume_s={report['resume_s']:.1f} "
        f"proxy={proxy.counts()} segments={len(manifest.segments)}"
    )
    summary = {k: v for k, v in report.items() if k != "acked"}
    assert report["backlog_errors"] > 0, summary
    assert UploadBacklogError.retriable
    assert report["uncommitted_max"] <= MAX_PENDING + report["max_request"], summary
    assert report["rss_max"] <= report["rss_base"] + RSS_HEADROOM, summary
    outcomes = proxy.counts()[1]
    assert all(outcomes.get(k, 0) > 0 for k in FAULTS), outcomes

    # 4. uploads resumed: the manifest reached the log end within 30 s of the faults clearing
    assert report["resume_s"] <= RESUME_S, summary


async def _scenario(
    proxy: FaultyProxy, host: str, port: int, pid: int, zk: KazooClient, log_dir: Path
) -> dict[str, object]:
    client = await WireClient.connect(host, port)
    acked: list[bytes] = []
    state = {"backlog_errors": 0, "max_request": 0, "next": 0}
    stop = asyncio.Event()
    acked_after_clear = asyncio.Event()
    cleared = False

    async def produce() -> None:
        while not stop.is_set():
            values = _values(state["next"], 200)
            records = encode_batch(values)
            state["max_request"] = max(state["max_request"], len(records))
            while True:
                resp = await client.call(
                    m.ApiKey.PRODUCE, produce_request(TOPIC, 0, records, acks=1), wait_s=30
                )
                r = resp.topics[0].partitions[0]
                if r.error_code == 0:
                    assert r.base_offset == len(acked)
                    acked.extend(values)
                    state["next"] += len(values)
                    if cleared:
                        acked_after_clear.set()
                    break
                assert r.error_code == UploadBacklogError.code, r.error_message
                state["backlog_errors"] += 1
                await asyncio.sleep(0.05)  # the producer's retry backoff
            await asyncio.sleep(0.05)  # pacing: ~2 MB/s

    async def until(what: str, check: object, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not await asyncio.to_thread(check):  # type: ignore[arg-type]
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            await asyncio.sleep(0.1)

    producer = asyncio.create_task(produce())
    try:
        # healthy first: uploads flow, then the baseline is taken
        await until("first segments committed", lambda: _manifest(zk).end > 0, 20)
        rss_base = rss_bytes(pid)
        rss_max = rss_base
        uncommitted_max = 0
        proxy.set_faults(FAULTS)
        fault_end = time.monotonic() + FAULT_S
        while time.monotonic() < fault_end:
            assert not producer.done() or producer.result() is None
            rss_max = max(rss_max, rss_bytes(pid))
            uncommitted_max = max(
                uncommitted_max, await asyncio.to_thread(_uncommitted_bytes, zk, log_dir)
            )
            await asyncio.sleep(0.1)  # sampling period
        proxy.clear()
        cleared = True
        t_clear = time.monotonic()
        async with asyncio.timeout(RESUME_S):
            await acked_after_clear.wait()  # producers are accepted again
        stop.set()
        await producer
        end = len(acked)
        await until("manifest reaches the log end", lambda: _manifest(zk).end == end, RESUME_S)
        resume_s = time.monotonic() - t_clear
    finally:
        stop.set()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        await client.close()
    return {
        "acked": acked,
        "backlog_errors": state["backlog_errors"],
        "max_request": state["max_request"],
        "rss_base": rss_base,
        "rss_max": rss_max,
        "uncommitted_max": uncommitted_max,
        "resume_s": resume_s,
    }
