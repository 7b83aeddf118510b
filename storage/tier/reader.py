"""Reads from the object tier: footers, a bounded block cache, streamed read-ahead.

A segment object's data is read in aligned blocks of ``block_bytes``, cached in a fixed
arena of ``cache_bytes`` (``BlockCache``). A read walks batch headers from the footer
index's position to the batch holding the requested offset and returns whole batches (at
least one, then up to ``max_bytes``) exactly as stored, every one's CRC32C checked — a view
into the cached block, no copy, unless the batches straddle two blocks. The CRCs are
checked where the bytes arrive: the thread receiving a stream runs each block it fills
through a ``CrcVerifier`` while the bytes are still in the CPU's cache, and a read of
batches that stream has verified (in blocks it filled) checks nothing again; any other read
checks its batches itself.

Blocks come from S3 through *streams*: one ranged GET from a block to the end of the
segment's data, fed block slots as the reader makes room. A miss opens a stream at the
missing block; every read then keeps the next ``readahead_blocks`` blocks cached or handed
to the stream (into the next segment when the caller names it, with a stream of its own),
so a consumer catching up sequentially is served by one GET per segment object and finds
its next blocks already received. A stream from a segment's first block asks for the whole
object (no range) and hands its footer over at the end; a read needs the footer only to
find where an offset starts, and a sequential reader never does: a segment's first offset
is at position 0 and every read remembers where the next offset starts. A stream left
without new slots for a moment closes (its connection is paused by TCP flow control
meanwhile). Concurrent readers of one block share one fetch. At most ``max_streams``
streams stay open waiting for slots; past that a miss is served by a stream that ends with
its block. Memory: the arena, ``cache_bytes``, for cached blocks and blocks in flight
together; read-ahead reserves at most half of it.
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
from storage.codec.batch import CrcVerifier
from storage.errors import ObjectStoreError, StrataError
from storage.tier.layout import TRAILER_SIZE, Footer, decode_footer
from storage.tier.manifest import SegmentEntry
from storage.tier.s3 import ObjectStore, Targets

log = logging.getLogger(__name__)

#: how often a demand read waits for a block that is evicted again before it can be read
_EVICTED_RETRIES = 8
#: the block number of a whole-object stream's last buffer: the object's footer
_FOOTER = -1


class BlockCache:
    """LRU of fixed-size blocks held in one preallocated arena of ``max_bytes``.

    The arena is a single private anonymous mapping (backed lazily: the process's memory
    grows only as slots are first used, never past ``max_bytes``), advised for transparent
    huge pages: the 4 KiB pages of hundreds of separately allocated blocks cost a TLB miss (a
    nested one under a hypervisor) every few kilobytes of every copy into or out of them.
    Slots are reused as blocks are evicted, so a long catch-up read receives into warm memory
    instead of faulting in fresh pages.

    A slot is free, reserved (a fetch is writing into it), or holds one cached block.
    ``lookup`` hands out a view of the slot without copying; a slot that still has views
    alive when its block is evicted is *held* — out of the cache, not reused — until the last
    view is gone (each slot is one numpy array over the arena, and every memoryview of it
    keeps a reference to it, so "no views" is its reference count back at the cache's own).
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
        #: key -> slot, length, tag (what the filler says about the bytes: a ``CrcVerifier``)
        self._items: OrderedDict[Any, tuple[int, int, Any]] = OrderedDict()
        self.size = 0  # bytes of cached blocks
        self.reserved = 0  # slots being filled
        self.hits = 0
        self.misses = 0

    def lookup(self, key: Any) -> tuple[memoryview, Any] | None:
        """A view of ``key``'s block and its tag, or None."""
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return self.slot_view(item[0], item[1]), item[2]

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
            _, (slot, length, _) = self._items.popitem(last=False)
            self.size -= length
            if not self._pinned(slot):
                return slot
            self._held.append(slot)
        return None

    def commit(self, key: Any, slot: int, length: int, tag: Any = None) -> None:
        """The reserved ``slot`` now holds ``key``'s ``length`` bytes."""
        self.reserved -= 1
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= old[1]
            self._unused(old[0])
        self._items[key] = (slot, length, tag)
        self.size += length

    def release(self, slot: int) -> None:
        """A reserved slot that was not filled."""
        self.reserved -= 1
        self._unused(slot)

    def drop_prefix(self, key: str) -> None:
        for k in [k for k in self._items if k[0] == key]:
            slot, length, _ = self._items.pop(k)
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
        "footer",
        "key",
        "next_block",
        "open_ended",
        "targets",
        "verifier",
        "whole",
    )

    def __init__(
        self, key: str, first: int, end: int, *, open_ended: bool, whole: bool = False
    ) -> None:
        self.key = key
        self.end = end
        self.open_ended = open_ended
        #: the GET asks for the whole object: its footer follows the last data block
        self.whole = whole
        self.footer: bytearray | None = None  # the footer's buffer, once handed over
        #: checks the CRCs of the batches it receives, when it starts at a known batch boundary
        self.verifier: CrcVerifier | None = None
        self.next_block = first
        self.targets = Targets()
        #: block (or _FOOTER), slot (-1 for the footer), length, future
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
        max_positions: int = 4096,
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
        #: (key, offset) -> where that offset's batch starts, for the next sequential read
        self._positions: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._max_positions = max_positions
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
        for k in [k for k in self._positions if k[0] == key]:
            del self._positions[k]
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
            self._keep_footer(key, f)
            fut.set_result(f)
            return f
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._footer_fetches[key]

    def _keep_footer(self, key: str, f: Footer) -> None:
        self._footers[key] = f
        if len(self._footers) > self._max_footers:
            self._footers.popitem(last=False)

    async def _position(self, key: str, entry: SegmentEntry, offset: int) -> int:
        """Where to start looking for ``offset``'s batch: exact for a segment's first offset
        and for where an earlier read ended, else the footer index's entry at or before it."""
        if offset <= entry.base_offset:
            return 0
        pos = self._positions.get((key, offset))
        if pos is not None:
            return pos
        return (await self.footer(key, entry)).position_for_offset(offset)

    async def _block(
        self, key: str, entry: SegmentEntry, i: int, boundary: int | None = None
    ) -> tuple[memoryview, CrcVerifier | None]:
        """Block ``i`` of the segment's data, as a view of its cache slot, and the verifier of
        the stream that filled it. ``boundary``: a batch starts there (in block ``i``), for a
        stream that a miss opens to check batches from."""
        for _ in range(_EVICTED_RETRIES):
            found = self.cache.lookup((key, i))
            if found is not None:
                return found
            fut = self._inflight.get((key, i))
            if fut is None:
                fut = self._fetch([(key, entry, i)], demand=True, boundary=boundary)
                if fut is None:  # every slot is being filled or viewed: read past the cache
                    start = i * self.block_bytes
                    end = min(start + self.block_bytes, entry.data_length)
                    return memoryview(await self.store.get_range(key, start, end)), None
            await asyncio.shield(fut)
            # received (or its stream gave up on it), then maybe evicted before we ran: again
        raise ObjectStoreError(
            f"block {i} of {key} was evicted {_EVICTED_RETRIES} times before it could be"
            f" read: tier.cache.bytes ({self.cache.max_bytes}) is too small for this load"
        )

    async def _bytes(
        self,
        key: str,
        entry: SegmentEntry,
        start: int,
        end: int,
        tags: list[CrcVerifier | None] | None = None,
    ) -> memoryview:
        """Bytes ``[start, end)`` of the segment's data, ``start`` a batch boundary: a view into
        the cached block when the range lies in one block (no copy; the block's slot is not
        reused while the view lives), else one copy of just the range's pieces. ``tags`` gets
        the verifier of each block's stream."""
        end = min(end, entry.data_length)
        bs = self.block_bytes
        first, last = start // bs, (end - 1) // bs
        if first == last:
            block, tag = await self._block(key, entry, first, start)
            if tags is not None:
                tags.append(tag)
            return block[start - first * bs : end - first * bs]
        pieces = []
        for i in range(first, last + 1):
            view, tag = await self._block(key, entry, i, start if i == first else None)
            if tags is not None:
                tags.append(tag)
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
        pos = await self._position(key, entry, offset)
        while True:
            h = read_header(await self._bytes(key, entry, pos, pos + HEADER_SIZE))
            if h.next_offset > offset:
                break
            pos += h.size
        start, end, after = pos, pos + h.size, h.next_offset
        while end < entry.data_length:
            h = read_header(await self._bytes(key, entry, end, end + HEADER_SIZE))
            if end + h.size - start > max_bytes:
                break
            end += h.size
            after = h.next_offset
        tags: list[CrcVerifier | None] = []
        data = await self._bytes(key, entry, start, end, tags)
        v = tags[0]
        if v is None or not v.covers(start, end) or any(t is not v for t in tags):
            for bh, p in iter_batches(data):
                check_batch(data[p : p + bh.size])
        if end < entry.data_length:
            self._positions[(key, after)] = end
            if len(self._positions) > self._max_positions:
                self._positions.popitem(last=False)
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
        run: list[tuple[str, SegmentEntry, int]] = []

        def fetch() -> None:
            # a batch starts at ``end``: where a stream opened in this segment checks from
            self._fetch(run, boundary=end if run[0][0] == key else None)

        for w in window:
            if (w[0], w[2]) in self._inflight or (w[0], w[2]) in self.cache:
                if run:
                    fetch()
                    run = []
                continue
            if run and w[0] != run[-1][0]:
                fetch()
                run = []
            run.append(w)
        if run:
            fetch()

    def _fetch(
        self,
        run: list[tuple[str, SegmentEntry, int]],
        *,
        demand: bool = False,
        boundary: int | None = None,
    ) -> asyncio.Future[None] | None:
        """Hand blocks ``run`` (one key, consecutive) to the stream positioned at the first,
        or open one there; each block gets a reserved cache slot it is received straight
        into. Returns the first block's future, or None when nothing could be handed over.
        A new stream checks CRCs from the segment's start, or from ``boundary`` if a batch
        starts there in the run's first block.

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
                if first == 0:  # the whole object: no range, and the footer comes with it
                    stream = _Stream(key, 0, entry.size, open_ended=True, whole=True)
                else:
                    stream = _Stream(key, first, entry.data_length, open_ended=True)
            elif demand:
                end = min((run[-1][2] + 1) * bs, entry.data_length)
                stream = _Stream(key, first, end, open_ended=False)
            else:
                return None
            if first == 0:
                stream.verifier = CrcVerifier(0, 0)
            elif boundary is not None and boundary // bs == first:
                stream.verifier = CrcVerifier(first * bs, boundary)
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
            if stream.whole and (i + 1) * bs >= entry.data_length:
                stream.footer = bytearray(entry.size - entry.data_length)
                stream.blocks.append((_FOOTER, -1, len(stream.footer), loop.create_future()))
                stream.targets.put(memoryview(stream.footer))
        if opened and head is not None:
            self._streams.append(stream)
            self._spawn(self._run_stream(stream), always=True)
        return head

    async def _run_stream(self, st: _Stream) -> None:
        cache = self.cache

        def filled(j: int) -> None:
            i, slot, length, fut = st.blocks[j]
            st.delivered = j + 1
            if i == _FOOTER:  # received in full, even if the stream has ended since
                self._footer_received(st)
                if not fut.done():
                    fut.set_result(None)
                return
            if fut.done():
                return  # abandoned: released() returns the slot once the worker stops
            self._inflight.pop((st.key, i), None)
            cache.commit((st.key, i), slot, length, st.verifier)
            fut.set_result(None)

        def released() -> None:
            for _, slot, _, _ in st.blocks[st.delivered :]:
                if slot >= 0:
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
                whole=st.whole,
                inspect=None if st.verifier is None else st.verifier.feed,
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

    def _footer_received(self, st: _Stream) -> None:
        """A whole-object stream's footer arrived: kept unless one is cached already (a
        damaged one is left for ``footer()`` to fetch and report when a read needs it)."""
        assert st.footer is not None
        if st.key in self._footers:
            return
        try:
            self._keep_footer(st.key, decode_footer(st.footer, where=st.key))
        except StrataError as exc:
            log.warning("footer streamed with %s not kept: %s", st.key, exc)

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
