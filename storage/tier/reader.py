"""Reads from the object tier: footers, a bounded block cache, read-ahead.

A segment object's data is read in aligned blocks of ``block_bytes`` (one ranged GET each).
Blocks live in an LRU cache bounded by bytes; concurrent readers of one block share one GET.
A read walks batch headers from the footer index's position to the batch holding the
requested offset, returns whole batches (at least one, then up to ``max_bytes``) exactly as
stored after checking each one's CRC32C, and starts fetching the next ``readahead_blocks``
blocks in the background — into the next segment when the caller names it — so a consumer
catching up sequentially finds its next blocks already cached. Memory: at most
``cache_bytes`` of blocks plus ``readahead_blocks`` blocks in flight per reader.
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
        if f is None:
            tail = await self.store.get_range(key, entry.data_length, entry.size)
            f = decode_footer(tail, where=key)
            self._footers[key] = f
            if len(self._footers) > self._max_footers:
                self._footers.popitem(last=False)
        else:
            self._footers.move_to_end(key)
        return f

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

    async def _bytes(self, key: str, entry: SegmentEntry, start: int, end: int) -> bytes:
        end = min(end, entry.data_length)
        first, last = start // self.block_bytes, (end - 1) // self.block_bytes
        blocks = [await self._block(key, entry, i) for i in range(first, last + 1)]
        joined = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        off = first * self.block_bytes
        return joined[start - off : end - off]

    async def read(
        self,
        key: str,
        entry: SegmentEntry,
        offset: int,
        max_bytes: int,
        following: tuple[str, SegmentEntry] | None = None,
    ) -> bytes:
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
            check_batch(memoryview(data)[p : p + bh.size])
        self._read_ahead(key, entry, end, following)
        return data

    def _read_ahead(
        self,
        key: str,
        entry: SegmentEntry,
        end: int,
        following: tuple[str, SegmentEntry] | None,
    ) -> None:
        todo: list[tuple[str, SegmentEntry, int]] = []
        i = end // self.block_bytes
        last = (entry.data_length - 1) // self.block_bytes
        while len(todo) < self.readahead_blocks and i <= last:
            todo.append((key, entry, i))
            i += 1
        if following is not None:
            nkey, nentry = following
            j = 0
            nlast = (nentry.data_length - 1) // self.block_bytes
            while len(todo) < self.readahead_blocks and j <= nlast:
                todo.append((nkey, nentry, j))
                j += 1
            if nkey not in self._footers:
                self._spawn(self.footer(nkey, nentry))
        for k, e, b in todo:
            if (k, b) not in self._inflight and self.cache.get((k, b)) is None:
                self._spawn(self._block(k, e, b))

    def _spawn(self, coro: Any) -> None:
        if len(self._background) >= self.readahead_blocks * 2:
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
