"""Reads from the object tier: footers, a bounded block cache, streamed read-ahead.

A segment object's data is read in aligned blocks of ``block_bytes``, cached in a fixed
arena of ``cache_bytes`` (``BlockCache``). A read walks batch headers from the footer
index's position to the batch holding the requested offset and returns whole batches (at
least one, then up to ``max_bytes``) exactly as stored after checking each one's CRC32C —
a view into the cached block, no copy, unless the batches straddle two blocks.

Blocks come from S3 through *streams*: one ranged GET from a block to the end of the
segment object, fed block slots as the reader makes room. A miss opens a stream at the
missing block; every read then keeps the next ``readahead_blocks`` blocks cached or handed
to the stream (into the next segment when the caller names it, with a stream of its own),
so a consumer catching up sequentially is served by one GET per segment object and finds
its next blocks already received. A stream left without new slots for a moment closes
(its connection is paused by TCP flow control meanwhile). Concurrent readers of one block
share one fetch. At most ``max_streams`` streams stay open waiting for slots; past that a
miss is served by a stream that ends with its block. Memory: the arena, ``cache_bytes``,
for cached blocks and blocks in flight together; read-ahead reserves at most half of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from storage.codec import HEADER_SIZE, check_batch, decode_batch, iter_batches, read_header
from storage.errors import ObjectStoreError
from storage.tier.layout import TRAILER_SIZE, Footer, decode_footer
from storage.tier.manifest import SegmentEntry
from storage.tier.s3 import ObjectStore, Targets

log = logging.getLogger(__name__)

#: how often a demand read waits for a block that is evicted again before it can be read
_EVICTED_RETRIES = 8


class BlockCache:
    """LRU of fixed-size blocks held in one preallocated arena of ``max_bytes``.

    The arena is a single private anonymous mapping (backed lazily: the process's memory
    grows only as slots are first used, never past ``max_bytes``), advised for transparent
    huge pages: the 4 KiB pages of hundreds of separately allocated blocks cost a TLB miss (a
    nested one under a hypervisor) every few kilobytes of every copy into or out of them.
    Slots are reused as blocks are evicted, so a long catch-up read receives into warm memory
    instead of faulting in fresh pages.

    A slot is free, reserved (a fetch is writing into it), or holds one cached block. ``get``
    hands out a view of the slot without copying; a slot that still has views alive when its
    block is evicted is *held* — out of the cache, not reused — until the last view is gone
    (each slot is one numpy array over the arena, and every memoryview of it keeps a
    reference to it, so "no views" is its reference count back at the cache's own).
    """

    def __init__(self, max_bytes: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slots = max(2, max_bytes // block_bytes)
        self.max_bytes = self.slots * block_bytes
        self._arena = mmap.mmap(-1, self.max_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._arena.madvise(mmap.MADV_HUGEPAGE)
        self._slots = [
            np.frombuffer(self._arena, np.uint8, block_bytes, i * block_bytes)
            for i in range(self.slots)
        ]
        self._free = list(range(self.slots - 1, -1, -1))
        self._held: list[int] = []  # evicted, but views of them are still alive
        self._items: OrderedDict[Any, tuple[int, int]] = OrderedDict()  # key -> slot, length
        self.size = 0  # bytes of cached blocks
        self.reserved = 0  # slots being filled
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> memoryview | None:
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return self.slot_view(*item)

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def slot_view(self, slot: int, length: int) -> memoryview:
        return self._slots[slot].data[:length]

    def _pinned(self, slot: int) -> bool:
        # the list's reference and getrefcount's argument; any more is a live view
        return sys.getrefcount(self._slots[slot]) > 2

    def _unused(self, slot: int) -> None:
        (self._held if self._pinned(slot) else self._free).append(slot)

    def reserve(self) -> int | None:
        """A slot to fill: a free one, a held one whose views are gone, else the least
        recently used block's; None when every slot is being filled or viewed."""
        slot = self._free.pop() if self._free else self._reclaim()
        if slot is None:
            return None
        self.reserved += 1
        return slot

    def _reclaim(self) -> int | None:
        for j, slot in enumerate(self._held):
            if not self._pinned(slot):
                del self._held[j]
                return slot
        while self._items:
            _, (slot, length) = self._items.popitem(last=False)
            self.size -= length
            if not self._pinned(slot):
                return slot
            self._held.append(slot)
        return None

    def commit(self, key: Any, slot: int, length: int) -> None:
        """The reserved ``slot`` now holds ``key``'s ``length`` bytes."""
        self.reserved -= 1
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= old[1]
            self._unused(old[0])
        self._items[key] = (slot, length)
        self.size += length

    def release(self, slot: int) -> None:
        """A reserved slot that was not filled."""
        self.reserved -= 1
        self._unused(slot)

    def drop_prefix(self, key: str) -> None:
        for k in [k for k in self._items if k[0] == key]:
            slot, length = self._items.pop(k)
            self.size -= length
            self._unused(slot)


class _Stream:
    """One streamed GET of a segment object from a block up to ``end`` (the object's data end
    for an open-ended stream): the blocks handed to it so far, in order, and the next block
    it can take."""

    __slots__ = (
        "blocks",
        "closed",
        "delivered",
        "end",
        "key",
        "next_block",
        "open_ended",
        "targets",
    )

    def __init__(self, key: str, first: int, end: int, *, open_ended: bool) -> None:
        self.key = key
        self.end = end
        self.open_ended = open_ended
        self.next_block = first
        self.targets = Targets()
        #: block, slot, length, future
        self.blocks: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self.delivered = 0
        self.closed = False


class TierReader:
    def __init__(
        self,
        store: ObjectStore,
        *,
        cache_bytes: int = 256 << 20,
        block_bytes: int = 4 << 20,
        readahead_blocks: int = 4,
        max_footers: int = 4096,
        max_streams: int = 4,
        stream_idle_s: float = 2.0,
    ) -> None:
        self.store = store
        self.block_bytes = block_bytes
        self.readahead_blocks = readahead_blocks
        self.max_streams = max_streams
        self.stream_idle_s = stream_idle_s
        self.cache = BlockCache(cache_bytes, block_bytes)
        self._footers: OrderedDict[str, Footer] = OrderedDict()
        self._max_footers = max_footers
        self._inflight: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._footer_fetches: dict[str, asyncio.Future[Footer]] = {}
        self._streams: list[_Stream] = []
        self._background: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for st in self._streams:
            st.targets.close()
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

    async def _block(self, key: str, entry: SegmentEntry, i: int) -> memoryview:
        """Block ``i`` of the segment's data, as a view of its cache slot."""
        for _ in range(_EVICTED_RETRIES):
            view = self.cache.get((key, i))
            if view is not None:
                return view
            fut = self._inflight.get((key, i))
            if fut is None:
                fut = self._fetch([(key, entry, i)], demand=True)
                if fut is None:  # every slot is being filled or viewed: read past the cache
                    start = i * self.block_bytes
                    end = min(start + self.block_bytes, entry.data_length)
                    return memoryview(await self.store.get_range(key, start, end))
            await asyncio.shield(fut)
            # received (or its stream gave up on it), then maybe evicted before we ran: again
        raise ObjectStoreError(
            f"block {i} of {key} was evicted {_EVICTED_RETRIES} times before it could be"
            f" read: tier.cache.bytes ({self.cache.max_bytes}) is too small for this load"
        )

    async def _bytes(self, key: str, entry: SegmentEntry, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the segment's data: a view into the cached block when the
        range lies in one block (no copy; the block's slot is not reused while the view
        lives), else one copy of just the range's pieces."""
        end = min(end, entry.data_length)
        bs = self.block_bytes
        first, last = start // bs, (end - 1) // bs
        if first == last:
            block = await self._block(key, entry, first)
            return block[start - first * bs : end - first * bs]
        pieces = []
        for i in range(first, last + 1):
            view = await self._block(key, entry, i)
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
        """Keep the ``readahead_blocks`` blocks after ``end`` cached or on their way: each
        run of missing blocks goes to the stream already positioned at its first block, or
        opens one."""
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
        run: list[tuple[str, SegmentEntry, int]] = []
        for w in window:
            if (w[0], w[2]) in self._inflight or (w[0], w[2]) in self.cache:
                if run:
                    self._fetch(run)
                    run = []
                continue
            if run and w[0] != run[-1][0]:
                self._fetch(run)
                run = []
            run.append(w)
        if run:
            self._fetch(run)

    def _fetch(
        self, run: list[tuple[str, SegmentEntry, int]], *, demand: bool = False
    ) -> asyncio.Future[None] | None:
        """Hand blocks ``run`` (one key, consecutive) to the stream positioned at the first,
        or open one there; each block gets a reserved cache slot it is received straight
        into. Returns the first block's future, or None when nothing could be handed over.

        Read-ahead (not ``demand``) stops while half the cache is being filled (many
        partitions catching up at once share the cache instead of evicting each other's
        blocks before they are read). At most ``max_streams`` streams are open-ended (each
        holds a worker thread and a connection while it waits for slots); past that,
        read-ahead stops and a demand miss gets a stream that ends with its run.
        """
        key, entry, first = run[0]
        bs = self.block_bytes
        stream = next(
            (
                st
                for st in self._streams
                if st.key == key
                and st.next_block == first
                and first * bs < st.end
                and not st.closed
            ),
            None,
        )
        if stream is None:
            if sum(st.open_ended for st in self._streams) < self.max_streams:
                stream = _Stream(key, first, entry.data_length, open_ended=True)
            elif demand:
                end = min((run[-1][2] + 1) * bs, entry.data_length)
                stream = _Stream(key, first, end, open_ended=False)
            else:
                return None
            opened = True
        else:
            opened = False
        cache = self.cache
        loop = asyncio.get_running_loop()
        head: asyncio.Future[None] | None = None
        for _, _, i in run:
            if not demand and (cache.reserved + 1) * 2 > cache.slots:
                break
            slot = cache.reserve()
            if slot is None:
                break
            length = min(bs, entry.data_length - i * bs)
            fut: asyncio.Future[None] = loop.create_future()
            self._inflight[(key, i)] = fut
            stream.blocks.append((i, slot, length, fut))
            stream.next_block = i + 1
            stream.targets.put(cache.slot_view(slot, length))
            head = head or fut
        if opened and head is not None:
            self._streams.append(stream)
            self._spawn(self._run_stream(stream), always=True)
        return head

    async def _run_stream(self, st: _Stream) -> None:
        cache = self.cache

        def filled(j: int) -> None:
            i, slot, length, fut = st.blocks[j]
            st.delivered = j + 1
            if fut.done():
                return  # abandoned: released() returns the slot once the worker stops
            self._inflight.pop((st.key, i), None)
            cache.commit((st.key, i), slot, length)
            fut.set_result(None)

        def released() -> None:
            for _, slot, _, _ in st.blocks[st.delivered :]:
                cache.release(slot)

        error: BaseException | None = None
        try:
            await self.store.read_into(
                st.key,
                st.blocks[0][0] * self.block_bytes,
                st.end,
                st.targets,
                filled,
                released,
                idle=self.stream_idle_s,
            )
        except BaseException as exc:
            error = exc
            raise
        finally:
            st.closed = True
            self._streams.remove(st)
            for i, _, _, fut in st.blocks[st.delivered :]:
                self._inflight.pop((st.key, i), None)
                if fut.done():
                    continue
                if isinstance(error, Exception):
                    fut.set_exception(error)
                    fut.exception()  # retrieved: waiters re-raise it
                else:  # the stream ended first (idle, closed, cancelled): waiters retry
                    fut.set_result(None)

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
