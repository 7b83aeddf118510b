"""Crashes on a record count as failed attempts: a group member's side (``docs/retries.md``,
"Poison messages and crashes").

A record that raises is handed to ``retry_later``. A record that *kills* its consumer (kill
-9, an OOM, a segfault in a native library) cannot be: nobody is left to say which one it
was. So a consumer with retries tells its group coordinator, before it hands records out,
which offsets it is about to process (``ConsumerProgress``: [first, end) per partition, each
note replacing the last; an empty poll says nothing is in flight). If the member's session
then expires, the coordinator counts one crash against those ranges and keeps them, with the
group, as *suspects*. Whoever owns the partition next learns them: the first note after each
assignment asks for the suspects of the partitions assigned, and is awaited for that.

The owner of a partition with a suspect [first, end) (a partition can have several, disjoint:
a member that dies on the records before one leaves that one as it was; they are taken in
offset order):

* hands out the records before ``first`` as usual, never in one poll with the suspect range;
* inside the range, hands out **one record per poll, and nothing else in that poll**, each
  after a note naming it alone that the coordinator has acknowledged, so a crash there pins
  that one record (its count then includes the crash of the range it was found in: the
  records before it in that range were just processed without one);
* a record a crash *pinned* (the dead member had that one record in flight and nothing
  else), with ``n`` crashes, is not handed out: it is written as a failure record, its
  attempt counted ``n`` times (``Retrier.submit(crashes=n)``), and takes the retry path:
  back after the policy's backoff, to the dead-letter topic after ``max_attempts``. A
  poison record therefore costs at most ``max_attempts + 1`` crashes, each detected within
  one session timeout.

A note must be on its way before the records are processed (a process killed right after
handing them out may never run another line): the poll waits until the note is in the
socket, which the kernel delivers even if the process dies next; only a note of a suspect's
record also waits for the coordinator's answer. To keep notes off most polls, a note names
more than the poll hands out (``NOTE_SPAN`` offsets ahead of it) and keeps naming the other
partitions of the last note from their position on; a poll whose records lie inside what
was last noted sends none. A crash then blames wider ranges, which costs only the careful
pass above (one round trip per record). An empty poll (the application asked for more: what
it had is done) clears the note without waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

from sdk.group import GroupClient
from sdk.records import TopicPartition
from storage.errors import StrataError, UnsupportedVersionError

log = logging.getLogger(__name__)

#: per partition, (first, end, crashes, pinned) ranges: disjoint, in offset order
Suspects = dict[TopicPartition, list[tuple[int, int, int, bool]]]
#: how far past its first offset one note may name a partition's offsets as in flight
NOTE_SPAN = 2_000


class CrashWatch:
    """What one retry-enabled member knows of its partitions' suspects, and its notes."""

    def __init__(
        self, group: GroupClient, spawn: Callable[[Coroutine[Any, Any, None], str], Any]
    ) -> None:
        self.group = group
        self._spawn = spawn
        self.suspects: Suspects = {}
        self.enabled = True  # off against agents that do not serve ConsumerProgress
        self._stale = True  # learn the suspects before handing anything out
        self._assignments = 0  # assignments seen (one coming while learning: learn again)
        self._noted: dict[TopicPartition, tuple[int, int]] = {}  # what the last note said

    def assigned(self) -> None:
        """A new assignment: learn the suspects again before the next hand-out."""
        self._stale = True
        self._assignments += 1

    async def learn(self, owned: Collection[TopicPartition]) -> None:
        """Ask for the suspects of ``owned`` (the partitions assigned), unless known."""
        if not self._stale or not self.enabled:
            return
        seen, asked = self._assignments, set(owned)
        got = await self._note({}, asked=asked)
        if got is not None and seen == self._assignments:
            self.suspects = {tp: list(s) for tp, s in got.items() if tp in asked and s}
            self._stale = False

    def _current(
        self, tp: TopicPartition, position: int | None
    ) -> tuple[int, int, int, bool] | None:
        """``tp``'s next suspect from ``position`` on; those it is past (their ranges were
        processed) are forgotten."""
        ranges = self.suspects.get(tp)
        if ranges is None or position is None:
            return None
        while ranges and position >= ranges[0][1]:
            ranges.pop(0)
        if not ranges:
            del self.suspects[tp]
            return None
        return ranges[0]

    def _settle(self, tp: TopicPartition) -> None:
        ranges = self.suspects[tp]
        ranges.pop(0)
        if not ranges:
            del self.suspects[tp]

    def cap(self, tp: TopicPartition, position: int | None) -> int | None:
        """Most records of ``tp`` one poll may hand out from ``position`` (None: no limit)."""
        s = self._current(tp, position)
        if s is None or position is None:
            return None
        first = s[0]
        return first - position if position < first else 1

    def caught_up(self, tp: TopicPartition, position: int | None, high_watermark: int) -> None:
        """Forget ``tp``'s suspect once the position, inside its range, has reached a high
        watermark this owner saw (``high_watermark``, -1: none yet): everything the dead
        member was handed lay below the high watermark of its time, which is no later than
        any this owner sees, so the rest of the range (notes reach ahead) was never in
        flight."""
        s = self._current(tp, position)
        if s is None or position is None or position < s[0]:
            return
        if 0 <= high_watermark <= position:
            self._settle(tp)

    def careful(self, tp: TopicPartition, position: int | None) -> bool:
        """Whether ``tp``'s next record lies in its suspect range (handed out alone)."""
        s = self._current(tp, position)
        return s is not None and position is not None and s[0] <= position < s[1]

    def crashes_of(self, tp: TopicPartition, offset: int, rows: int) -> int:
        """The crashes the record at ``offset`` caused, if it is about to be handed out
        alone and a crash pinned it (0 otherwise); it is then settled here."""
        s = self._current(tp, offset)
        if s is None or rows != 1 or s[:2] != (offset, offset + 1) or not s[3]:
            return 0
        self._settle(tp)
        return s[2]

    async def note(
        self,
        ranges: Mapping[TopicPartition, tuple[int, int]],
        position_of: Callable[[TopicPartition], int | None],
        held: Callable[[TopicPartition], bool] = lambda tp: False,
    ) -> None:
        """Say what is in flight now (awaited): ``ranges`` holds the records [first, end)
        handed out per partition. Nothing is sent if the last note covers them and none is
        a suspect's; an empty ``ranges`` clears the last note without waiting. A note names
        exactly [first, end) of a suspect's record, else ``NOTE_SPAN`` offsets ahead (what
        may be handed out next, so the polls after it need no note).

        A note replaces the last one at the coordinator, so it also names the other
        partitions of the last one, from their position on (``position_of``: where their
        next hand-out starts; everything before it is done) and ``NOTE_SPAN`` ahead again.
        So polls that take turns among partitions are covered, and a note is needed about
        once per ``NOTE_SPAN`` offsets of a partition. A note of a suspect's record names
        that record alone.

        A partition ``held`` (paused: the application may still be processing what it was
        handed, as the event-source runner does while a function runs) keeps what the last
        note said of it, also through an empty poll."""
        if not self.enabled:
            return
        if not ranges:
            kept = {tp: r for tp, r in self._noted.items() if held(tp)}
            if kept != self._noted:
                self._noted = kept
                self._spawn(self._send_off(kept), "strata-consumer-progress")
            return
        noted = self._noted
        careful = any(tp in self.suspects for tp in ranges)
        if not careful and all(
            tp in noted and noted[tp][0] <= first and end <= noted[tp][1]
            for tp, (first, end) in ranges.items()
        ):
            return
        merged: dict[TopicPartition, tuple[int, int]] = {}
        if careful:
            merged = dict(ranges)
        else:
            for tp, (first, end) in noted.items():
                position = position_of(tp)
                if tp in ranges:
                    continue
                if held(tp):
                    merged[tp] = (first, end)
                elif position is not None:
                    merged[tp] = (max(first, position), max(end, position + NOTE_SPAN))
            for tp, (first, end) in ranges.items():
                merged[tp] = (first, max(end, first + NOTE_SPAN))
        self._noted = merged
        if careful:
            await self._note(merged)  # the answer too: the record is then known to be in flight
        else:
            await self._out(merged)

    async def _out(self, ranges: dict[TopicPartition, tuple[int, int]]) -> None:
        """Send a note and wait only until it is in the socket (not for the answer): a
        process killed after that still delivers it (the kernel sends what it was given)."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def sent() -> None:
            if not written.done():
                written.set_result(None)

        task = self._spawn(self._send_off(ranges, sent), "strata-consumer-progress")
        await asyncio.wait([written, task], return_when=asyncio.FIRST_COMPLETED)
        if not written.done():
            written.cancel()

    async def _send_off(
        self,
        ranges: dict[TopicPartition, tuple[int, int]],
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        try:
            await self._note(ranges, on_sent)
        except Exception:  # a side channel: never the consumer's end (a bug, logged)
            log.exception("a progress note failed")

    async def _note(
        self,
        ranges: Mapping[TopicPartition, tuple[int, int]],
        on_sent: Callable[[], None] | None = None,
        asked: Collection[TopicPartition] = (),
    ) -> Suspects | None:
        try:
            return await self.group.progress(ranges, on_sent, asked)
        except UnsupportedVersionError:
            log.warning("the group coordinator does not count crashes (an older agent)")
            self.enabled = False
        except (StrataError, TimeoutError) as exc:
            log.debug("progress note not taken: %r", exc)
        return None
