"""``TierReader`` against the real moto server: what a Fetch below the local log goes through.

Segment objects are built with the tier layout (batches + footer) and uploaded to moto, then
read back the way the agent reads them: sequentially from the first offset, ``max_bytes`` per
call, the next segment named for read-ahead. Checked: the bytes are exactly the stored
batches; one streamed GET serves a sequential read of each segment object, and a stream left
idle closes; the cache and the blocks in flight stay within the arena; a viewed block's slot
is not reused; S3 faults (resets, 503s) cost retries, never wrong bytes; a corrupted batch is
a typed error, never served.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest

import storage.tier.reader as reader_module
from storage.codec import check_batch, encode_batch, iter_batches, stamp
from storage.errors import CorruptBatchError, ObjectStoreError
from storage.tier import BlockCache, ObjectStore, ObjectStoreConfig, SegmentEntry, TierReader
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
    s3: S3Target, s3_credentials: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    segs = [_segment(0, 40, 50), _segment(2000, 40, 50)]
    checked_at_read = []  # batches a read checked itself: none, the receiving thread did

    def counting_check(*args: Any, **kwargs: Any) -> Any:
        checked_at_read.append(1)
        return check_batch(*args, **kwargs)

    monkeypatch.setattr(reader_module, "check_batch", counting_check)
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
            await store.close()

    got, gets, watch = asyncio.run(run())
    assert got == segs[0][0] + segs[1][0]
    # one streamed GET per segment object (its footer included), however many blocks
    assert blocks > 30
    assert gets == 2, (gets, blocks)
    assert not checked_at_read
    # bounded: cached blocks and blocks in flight share the cache's arena
    assert max(watch) <= cache


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
            await store.close()

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
            await store.close()

    asyncio.run(run())


def test_a_cache_slot_is_not_reused_while_a_view_of_it_lives() -> None:
    """``read`` hands out views of cached blocks; evicting a viewed block must not let a fetch
    overwrite the bytes a caller is still sending."""
    cache = BlockCache(2 * 4096, 4096)  # two slots
    first = cache.reserve()
    assert first is not None
    cache.slot_view(first, 4096)[:] = b"a" * 4096
    cache.commit(("k", 0), first, 4096)
    found = cache.lookup(("k", 0))
    assert found is not None
    viewed = found[0]
    second = cache.reserve()
    assert second is not None
    cache.commit(("k", 1), second, 4096)
    cache.lookup(("k", 1))  # ("k", 0) is now the least recently used
    again = cache.reserve()  # ("k", 0) is viewed: it is dropped, its slot held; ("k", 1) goes
    assert again == second
    cache.slot_view(again, 4096)[:] = b"b" * 4096
    assert ("k", 0) not in cache and ("k", 1) not in cache
    assert cache.reserve() is None  # one slot being filled, the other still viewed
    assert bytes(viewed) == b"a" * 4096
    del viewed, found
    assert cache.reserve() == first  # the view is gone: the slot is free again


def test_one_get_streams_each_segment_and_an_idle_stream_closes(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    data, body, entry = _segment(0, 40, 50)
    _upload(s3, [("seg-s", body)])

    async def run() -> tuple[bytes, int, int, int]:
        store = _store(s3)
        reader = TierReader(
            store,
            cache_bytes=1 << 20,
            block_bytes=BLOCK,
            readahead_blocks=4,
            stream_idle_s=0.2,
        )
        try:
            out = bytearray()
            offset = 0
            half = entry.next_offset // 2
            while offset < half:
                chunk = await reader.read("seg-s", entry, offset, 48 << 10)
                out += chunk
                offset = [h for h, _ in iter_batches(chunk)][-1].next_offset
            gets_while_reading = store.requests.get("GET", 0)
            # the consumer pauses: the stream gets no new slots and closes after its idle time
            await asyncio.gather(*reader._background)
            assert not reader._streams
            while offset < entry.next_offset:
                chunk = await reader.read("seg-s", entry, offset, 48 << 10)
                out += chunk
                offset = [h for h, _ in iter_batches(chunk)][-1].next_offset
            return (
                bytes(out),
                gets_while_reading,
                store.requests.get("GET", 0),
                reader.cache.reserved,
            )
        finally:
            await reader.close()
            await store.close()

    got, first_half, total, reserved = asyncio.run(run())
    assert got == data
    # one streamed GET of the whole object for everything read so far: a read from the
    # segment's first offset needs no footer, and each later read starts where the last ended
    assert first_half == 1
    assert total == 2  # after the pause: one new (ranged) stream from where the reader stood
    assert reserved == 0


def test_streams_waiting_for_slots_are_bounded_and_misses_past_the_bound_still_read(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    """Each open-ended stream holds a worker thread and a connection while it waits for the
    reader: however many segments are read at once, at most ``max_streams`` do that; a miss
    past the bound is served by a stream that ends with its block."""
    segs = [_segment(0, 20, 50), _segment(1000, 20, 50), _segment(2000, 20, 50)]
    keys = ["seg-x", "seg-y", "seg-z"]
    _upload(s3, [(k, body) for k, (_, body, _) in zip(keys, segs, strict=True)])

    async def run() -> tuple[list[bytes], int]:
        store = _store(s3)
        reader = TierReader(
            store, cache_bytes=1 << 20, block_bytes=BLOCK, readahead_blocks=4, max_streams=1
        )
        outs = [bytearray() for _ in segs]
        offsets = [entry.base_offset for _, _, entry in segs]
        most = 0
        try:
            # three consumers catching up on three segments, one read each in turn
            while any(o < e.next_offset for o, (_, _, e) in zip(offsets, segs, strict=True)):
                for n, (key, (_, _, entry)) in enumerate(zip(keys, segs, strict=True)):
                    if offsets[n] >= entry.next_offset:
                        continue
                    chunk = await reader.read(key, entry, offsets[n], 48 << 10)
                    outs[n] += chunk
                    offsets[n] = [h for h, _ in iter_batches(chunk)][-1].next_offset
                    most = max(most, sum(st.open_ended for st in reader._streams))
            return [bytes(o) for o in outs], most
        finally:
            await reader.close()
            await store.close()

    outs, most = asyncio.run(run())
    assert outs == [data for data, _, _ in segs]
    assert most == 1


def test_the_whole_object_stream_brings_the_footer_for_later_lookups(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    """A catch-up from a segment's first offset is one GET of the whole object, no footer GET
    first; the footer arrives at the stream's end and serves later random reads and timestamp
    lookups without another request. Where each read ended is remembered, boundedly."""
    data, body, entry = _segment(0, 30, 40)
    _upload(s3, [("seg-w", body)])
    positions = [p for _, p in iter_batches(data)]

    async def run() -> tuple[bytes, bytes, int | None, int, int]:
        store = _store(s3)
        reader = TierReader(
            store, cache_bytes=4 << 20, block_bytes=BLOCK, readahead_blocks=64, max_positions=3
        )
        try:
            out = await _read_all(reader, [("seg-w", entry)], 48 << 10, [])
            await asyncio.gather(*reader._background)  # the stream has ended with the footer
            assert "seg-w" in reader._footers
            middle = await reader.read("seg-w", entry, 17 * 40 + 5, 1)  # batch 17
            ts = await reader.offset_for_timestamp("seg-w", entry, 1_700_000_000_000 + 401)
            return out, bytes(middle), ts, store.requests.get("GET", 0), len(reader._positions)
        finally:
            await reader.close()
            await store.close()

    out, middle, ts, gets, remembered = asyncio.run(run())
    assert out == data
    assert middle == data[positions[17] : positions[18]]
    assert ts == 440  # every record of a batch carries its first offset's timestamp
    assert gets == 1
    assert remembered == 3


def test_a_whole_object_get_of_the_wrong_size_is_refused(
    s3: S3Target, s3_credentials: S3Target
) -> None:
    """The manifest says how long the object is; a whole-object GET that answers another length
    (the object replaced behind the manifest's back) is an error, not bytes to serve."""
    _, body, entry = _segment(0, 10, 40)
    _upload(s3, [("seg-l", body + b"\0" * 100)])

    async def run() -> None:
        store = _store(s3, max_attempts=2)
        store._backoff = lambda attempt: 0.01  # type: ignore[method-assign]
        reader = TierReader(store, cache_bytes=1 << 20, block_bytes=BLOCK, readahead_blocks=2)
        try:
            with pytest.raises(ObjectStoreError, match="bytes"):
                await reader.read("seg-l", entry, 0, 1 << 20)
        finally:
            await reader.close()
            await store.close()

    asyncio.run(run())
