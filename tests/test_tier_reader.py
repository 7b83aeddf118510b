"""``TierReader`` against the real moto server: what a Fetch below the local log goes through.

Segment objects are built with the tier layout (batches + footer) and uploaded to moto, then
read back the way the agent reads them: sequentially from the first offset, ``max_bytes`` per
call, the next segment named for read-ahead. Checked: the bytes are exactly the stored
batches; read-ahead fetches runs of blocks with few GETs; the cache and the read-ahead in
flight stay within their bounds; S3 faults (resets, 503s) cost retries, never wrong bytes; a
corrupted batch is a typed error, never served.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from storage.codec import encode_batch, iter_batches, stamp
from storage.errors import CorruptBatchError
from storage.tier import ObjectStore, ObjectStoreConfig, SegmentEntry, TierReader
from storage.tier.layout import build_footer, decode_footer
from tests.faulty_proxy import FaultyProxy
from tests.harness import S3Target

BLOCK = 64 << 10


def _segment(base: int, batches: int, records: int) -> tuple[bytes, bytes, SegmentEntry]:
    """(data, object bytes, manifest entry) of a segment of ``batches`` stamped batches."""
    data = bytearray()
    offset = base
    for b in range(batches):
        values = [b"seg-%d-batch-%d-record-%d-" % (base, b, i) * 40 for i in range(records)]
        raw = bytearray(encode_batch(values, timestamps=[1_700_000_000_000 + offset] * records))
        raw[:16] = stamp(offset, len(raw) - 12, 3)
        data += raw
        offset += records
    footer = build_footer(bytes(data))
    entry = SegmentEntry.of(decode_footer(footer))
    return bytes(data), bytes(data) + footer, entry


def _store(s3: S3Target, endpoint: str | None = None, **kw: float) -> ObjectStore:
    return ObjectStore(
        ObjectStoreConfig(
            bucket=s3.bucket,
            endpoint_url=endpoint or s3.endpoint_url,
            region=s3.region,
            **kw,  # type: ignore[arg-type]
        )
    )


def _upload(s3: S3Target, segments: list[tuple[str, bytes]]) -> None:
    for key, body in segments:
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body)


async def _read_all(
    reader: TierReader, segs: list[tuple[str, SegmentEntry]], max_bytes: int, watch: list[int]
) -> bytes:
    """Everything, sequentially from each segment's base offset; ``watch`` gets the largest
    cache + in-flight bytes seen after each call."""
    out = bytearray()
    for i, (key, entry) in enumerate(segs):
        following = segs[i + 1] if i + 1 < len(segs) else None
        offset = entry.base_offset
        while offset < entry.next_offset:
            data = await reader.read(key, entry, offset, max_bytes, following)
            out += data
            for h, _ in iter_batches(data):
                offset = h.next_offset
            inflight = len(reader._inflight) * reader.block_bytes
            watch.append(max(watch[-1] if watch else 0, reader.cache.size + inflight))
    return bytes(out)


def test_sequential_read_returns_the_stored_batches_with_few_large_gets(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    segs = [_segment(0, 40, 50), _segment(2000, 40, 50)]
    keys = ["seg-a", "seg-b"]
    _upload(s3, [(k, body) for k, (_, body, _) in zip(keys, segs, strict=True)])
    blocks = sum(-(-entry.data_length // BLOCK) for _, _, entry in segs)
    cache = 1 << 20

    async def run() -> tuple[bytes, int, list[int]]:
        store = _store(s3)
        reader = TierReader(store, cache_bytes=cache, block_bytes=BLOCK, readahead_blocks=8)
        watch: list[int] = []
        try:
            got = await _read_all(
                reader, [(k, e) for k, (_, _, e) in zip(keys, segs, strict=True)], 48 << 10, watch
            )
            return got, store.requests.get("GET", 0), watch
        finally:
            await reader.close()
            store.close()

    got, gets, watch = asyncio.run(run())
    assert got == segs[0][0] + segs[1][0]
    # two footers plus the data: runs of blocks, so well under one GET per block
    assert blocks > 30
    assert gets <= 2 + blocks // 3, (gets, blocks)
    # bounded: cached blocks plus read-ahead in flight never pass 1.5 x the cache
    assert max(watch) <= cache + cache // 2


def test_reads_survive_s3_faults_byte_for_byte(s3: S3Target, s3_credentials: S3Target) -> None:
    data, body, entry = _segment(0, 30, 40)
    _upload(s3, [("seg-f", body)])
    upstream = urlsplit(s3.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None

    async def run(proxy: FaultyProxy) -> bytes:
        store = _store(s3, proxy.endpoint_url, request_timeout=2.0, max_attempts=30)
        store._backoff = lambda attempt: 0.01  # type: ignore[method-assign]
        reader = TierReader(store, cache_bytes=1 << 20, block_bytes=BLOCK, readahead_blocks=2)
        try:
            return await _read_all(reader, [("seg-f", entry)], 40 << 10, [])
        finally:
            await reader.close()
            store.close()

    with FaultyProxy(upstream.hostname, upstream.port, seed=11) as proxy:
        proxy.set_faults({"reset": 2, "slowdown": 2, "pass": 3})
        got = asyncio.run(run(proxy))
        _, outcomes = proxy.counts()
    assert got == data
    assert outcomes.get("reset", 0) + outcomes.get("slowdown", 0) > 0, outcomes  # faults happened


def test_a_corrupted_batch_is_a_typed_error_and_the_reader_serves_the_rest(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    data, body, entry = _segment(0, 10, 40)
    positions = [p for _, p in iter_batches(data)]
    bad = bytearray(body)
    bad[positions[4] + 200] ^= 0xFF  # inside batch 4's CRC-covered bytes
    _upload(s3, [("seg-c", bytes(bad))])

    async def run() -> None:
        store = _store(s3)
        reader = TierReader(store, cache_bytes=1 << 20, block_bytes=BLOCK, readahead_blocks=4)
        try:
            first = await reader.read("seg-c", entry, 0, 1, None)  # one batch
            assert bytes(first) == data[: positions[1]]
            batch4 = 4 * 40
            with pytest.raises(CorruptBatchError):
                await reader.read("seg-c", entry, batch4, 1, None)
            fifth = await reader.read("seg-c", entry, batch4 + 40, 1, None)
            assert bytes(fifth) == data[positions[5] : positions[6]]
        finally:
            await reader.close()
            store.close()

    asyncio.run(run())
