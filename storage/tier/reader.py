"""Reads from the object tier: footers, a bounded block cache, read-ahead.

A segment object's data is read in aligned blocks of ``block_bytes``. Blocks live in an LRU cache bounded by bytes; concurrent readers of one block share one GET.
A read walks batch headers from the footer index's position to the batch holding the
requested offset, returns whole batches (at least one, then up to ``max_bytes``) exactly as
stored after checking each one's CRC32C, and starts fetching the next ``readahead_blocks``
blocks in the background — into the next segment when the caller names it — so a consumer
catching up sequentially finds its next blocks already cached. A demand miss is one ranged GET
of one block; read-ahead fetches each run of missing blocks with one GET, streamed block by
block (a few large requests, not one per block). Memory: at most ``cache_bytes`` of cached blocks
plus ``cache_bytes / 2`` of read-ahead in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import numpy as np

from storage.codec import HEADER_SIZE, check_batch, decode_batch, iter_batches, read_header
from storage.tier.layout import TRAILER_SIZE, Footer, decode_footer
from storage.tier.manifest import SegmentEntry
from storage.tier.s3 import ObjectStore

log = logging.getLogger(__name__)


class BlockCache:
    """LRU of byte blocks, bounded by total bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._items: OrderedDict[Any, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> bytes | None:
        data = self._items.get(key)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return data

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def put(self, key: Any, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= len(old)
        self._items[key] = data
        self.size += len(data)
        while self.size > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.size -= len(dropped)

    def drop_prefix(self, key: str) -> None:
        for k in [k for k in self._items if k[0] == key]:
            self.size -= len(self._items.pop(k))


class TierReader:
    def __init__(
        self,
        store: ObjectStore,
        *,
        cache_bytes: int = 256 << 20,
        block_bytes: int = 4 << 20,
        readahead_blocks: int = 4,
        max_footers: int = 4096,
    ) -> None:
        self.store = store
        self.block_bytes = block_bytes
        self.readahead_blocks = readahead_blocks
        self.cache = BlockCache(cache_bytes)
        self._footers: OrderedDict[str, Footer] = OrderedDict()
        self._max_footers = max_footers
        self._inflight: dict[tuple[str, int], asyncio.Future[bytes]] = {}
        self._footer_fetches: dict[str, asyncio.Future[Footer]] = {}
        self._background: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def forget(self, key: str) -> None:
        self._footers.pop(key, None)
        self.cache.drop_prefix(key)

    async def footer(self, key: str, entry: SegmentEntry) -> Footer:
        f = self._footers.get(key)
        if f is not None:
            self._footers.move_to_end(key)
            return f
        pending = self._footer_fetches.get(key)
        if pending is not None:  # one GET per footer, however many readers want it
            return await asyncio.shield(pending)
        fut: asyncio.Future[Footer] = asyncio.get_running_loop().create_future()
        self._footer_fetches[key] = fut
        try:
            tail = await self.store.get_range(key, entry.data_length, entry.size)
            f = decode_footer(tail, where=key)
            self._footers[key] = f
            if len(self._footers) > self._max_footers:
                self._footers.popitem(last=False)
            fut.set_result(f)
            return f
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._footer_fetches[key]

    async def _block(self, key: str, entry: SegmentEntry, i: int) -> bytes:
        cached = self.cache.get((key, i))
        if cached is not None:
            return cached
        fut = self._inflight.get((key, i))
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._inflight[(key, i)] = fut
            try:
                start = i * self.block_bytes
                data = await self.store.get_range(
                    key, start, min(start + self.block_bytes, entry.data_length)
                )
                self.cache.put((key, i), data)
                fut.set_result(data)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: waiters re-raise it
                raise
            finally:
                self._inflight.pop((key, i), None)
            return data
        return await asyncio.shield(fut)

    async def _bytes(self, key: str, entry: SegmentEntry, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the segment's data: a view into the cached block when the
        range lies in one block (no copy), else one copy of just the range's pieces."""
        end = min(end, entry.data_length)
        bs = self.block_bytes
        first, last = start // bs, (end - 1) // bs
        if first == last:
            block = await self._block(key, entry, first)
            return memoryview(block)[start - first * bs : end - first * bs]
        pieces = []
        for i in range(first, last + 1):
            view = memoryview(await self._block(key, entry, i))
            lo = start - i * bs if i == first else 0
            hi = end - i * bs if i == last else len(view)
            pieces.append(view[lo:hi])
        return memoryview(b"".join(pieces))

    async def read(
        self,
        key: str,
        entry: SegmentEntry,
        offset: int,
        max_bytes: int,
        following: tuple[str, SegmentEntry] | None = None,
    ) -> memoryview:
        """Whole batches from the one holding ``offset`` to at most ``max_bytes`` (>= 1 batch)."""
        f = await self.footer(key, entry)
        pos = f.position_for_offset(offset)
        while True:
            h = read_header(await self._bytes(key, entry, pos, pos + HEADER_SIZE))
            if h.next_offset > offset:
                break
            pos += h.size
        start, end = pos, pos + h.size
        while end < entry.data_length:
            h = read_header(await self._bytes(key, entry, end, end + HEADER_SIZE))
            if end + h.size - start > max_bytes:
                break
            end += h.size
        data = await self._bytes(key, entry, start, end)
        for bh, p in iter_batches(data):
            check_batch(data[p : p + bh.size])
        self._read_ahead(key, entry, end, following)
        return data

    def _read_ahead(
        self,
        key: str,
        entry: SegmentEntry,
        end: int,
        following: tuple[str, SegmentEntry] | None,
    ) -> None:
        """Keep the ``readahead_blocks`` blocks after ``end`` cached or on their way.

        Missing blocks are fetched in contiguous runs, one GET per run streamed block by
        block, and only once half the window is missing (or the very next block is): so a
        sequential reader issues a few large GETs rather than one per block, and it always
        has at least half a window ahead of it.
        """
        window: list[tuple[str, SegmentEntry, int]] = []
        i = end // self.block_bytes
        last = (entry.data_length - 1) // self.block_bytes
        while len(window) < self.readahead_blocks and i <= last:
            window.append((key, entry, i))
            i += 1
        if following is not None:
            nkey, nentry = following
            j = 0
            nlast = (nentry.data_length - 1) // self.block_bytes
            while len(window) < self.readahead_blocks and j <= nlast:
                window.append((nkey, nentry, j))
                j += 1
            if nkey not in self._footers and nkey not in self._footer_fetches:
                self._spawn(self.footer(nkey, nentry))
        missing = [
            w
            for w in window
            if (w[0], w[2]) not in self._inflight and (w[0], w[2]) not in self.cache
        ]
        if not missing:
            return
        if missing[0] is not window[0] and 2 * len(missing) < len(window):
            return  # enough ahead already; wait to fetch a bigger run
        run: list[tuple[str, SegmentEntry, int]] = []
        for w in missing:
            if run and (w[0] != run[-1][0] or w[2] != run[-1][2] + 1):
                self._fetch_run(run)
                run = []
            run.append(w)
        self._fetch_run(run)

    def _fetch_run(self, run: list[tuple[str, SegmentEntry, int]]) -> None:
        """Blocks ``run`` (one key, consecutive) in one streamed GET, each cached on arrival.

        Skipped while read-ahead already has half the cache's bytes in flight: many
        partitions catching up at once share the cache instead of evicting each other's
        blocks before they are read.
        """
        if (len(self._inflight) + len(run)) * self.block_bytes > self.cache.max_bytes // 2:
            return
        if len(self._background) >= self.readahead_blocks * 2:
            return
        key, entry, first = run[0]
        last = run[-1][2]
        loop = asyncio.get_running_loop()
        futures: dict[int, asyncio.Future[bytes]] = {}
        for _, _, i in run:
            fut = loop.create_future()
            self._inflight[(key, i)] = futures[i] = fut

        def arrived(i: int, data: bytes) -> None:
            fut = futures.get(i)
            if fut is None or fut.done():
                return  # a retried attempt delivering a block again
            self.cache.put((key, i), data)
            self._inflight.pop((key, i), None)
            fut.set_result(data)

        def deliver(pos: int, data: bytes) -> None:  # on the store's worker thread
            loop.call_soon_threadsafe(arrived, pos // self.block_bytes, data)

        async def fetch() -> None:
            bs = self.block_bytes
            try:
                await self.store.stream_range(
                    key, first * bs, min((last + 1) * bs, entry.data_length), bs, deliver
                )
                await asyncio.sleep(0)  # let the last arrived() callback run
            except Exception as exc:
                for i, fut in futures.items():
                    if not fut.done():
                        fut.set_exception(exc)
                        fut.exception()  # retrieved: waiters re-raise it
                        self._inflight.pop((key, i), None)
                raise
            finally:
                for i, fut in futures.items():
                    if not fut.done():  # cancelled (the reader closing)
                        fut.cancel()
                        self._inflight.pop((key, i), None)

        self._spawn(fetch(), always=True)  # its futures are registered: it must run

    def _spawn(self, coro: Any, *, always: bool = False) -> None:
        if not always and len(self._background) >= self.readahead_blocks * 2:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("read-ahead failed: %s", t.exception())

        task.add_done_callback(done)

    async def offset_for_timestamp(self, key: str, entry: SegmentEntry, ts: int) -> int | None:
        """The first offset in this segment with a record timestamp >= ``ts``, or None."""
        if entry.max_timestamp < ts:
            return None
        f = await self.footer(key, entry)
        pos = f.position_for_timestamp(ts)
        while pos < entry.data_length:
            head = await self._bytes(key, entry, pos, pos + HEADER_SIZE)
            h = read_header(head)
            if h.max_timestamp >= ts:
                data = await self._bytes(key, entry, pos, pos + h.size)
                values = decode_batch(data).column("timestamp").cast("int64").to_numpy()
                return h.base_offset + int(np.argmax(values >= ts))
            pos += h.size
        return None


__all__ = ["TRAILER_SIZE", "BlockCache", "TierReader"]
