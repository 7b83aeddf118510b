"""Crashes on a record count as failed attempts: a group member's side (``docs/retries.md``,
"Poison messages and crashes").

A record that raises is handed to ``retry_later``. A record that *kills* its consumer (kill
-9, an OOM, a segfault in a native library) cannot be: nobody is left to say which one it
was. So a consumer with retries tells its group coordinator, before it hands records out,
which offsets it is about to process (``ConsumerProgress``: [first, end) per partition, each
note replacing the last; an empty poll says nothing is in flight). If the member's session
then expires, the coordinator counts one crash against those ranges and keeps them, with the
group, as *suspects*; every note is answered with the group's suspects, so whoever owns the
partition next learns them (the first note after each assignment is awaited for that).

The owner of a partition with a suspect [first, end):

* hands out the records before ``first`` as usual, never in one poll with the suspect range;
* inside the range, hands out **one record per poll, and nothing else in that poll**, each
  after a note naming it alone that the coordinator has acknowledged, so a crash there pins
  that one record (its count then includes the crash of the range it was found in: the
  records before it in that range were just processed without one);
* a record a crash *pinned* (the dead member had that one record in flight and nothing
  else), with ``n`` crashes, is not handed out: it is written as a failure record, its attempt counted ``n`` times
  (``Retrier.submit(crashes=n)``), and takes the retry path: back after the policy's backoff,
  to the dead-letter topic after ``max_attempts``. A poison record therefore costs at most
  ``max_attempts + 1`` crashes, each detected within one session timeout.

A note must have reached the coordinator before the records are processed (a process
killed right after handing them out may never run another line), so notes are awaited: one
round trip to the coordinator. To keep that off most polls, a note outside a suspect names
more than the poll hands out, up to the partition's high watermark and at most ``NOTE_SPAN``
offsets ahead, and a poll whose records lie inside what was last noted sends none; a crash
then blames a wider range, which costs only the careful pass above. An empty poll (the
application asked for more: what it had is done) clears the note without waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any

from sdk.group import GroupClient
from sdk.records import TopicPartition
from storage.errors import StrataError, UnsupportedVersionError

log = logging.getLogger(__name__)

Suspects = dict[TopicPartition, tuple[int, int, int, bool]]
#: how far past its first offset one note may name a partition's offsets as in flight
NOTE_SPAN = 10_000


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
        self._noted: dict[TopicPartition, tuple[int, int]] = {}  # what the last note said

    def assigned(self) -> None:
        """A new assignment: learn the suspects again before the next hand-out."""
        self._stale = True

    async def learn(self, owned: Collection[TopicPartition]) -> None:
        if not self._stale or not self.enabled:
            return
        got = await self._note({})
        if got is not None:
            self.suspects = {tp: s for tp, s in got.items() if tp in owned}
            self._stale = False

    def cap(self, tp: TopicPartition, position: int | None) -> int | None:
        """Most records of ``tp`` one poll may hand out from ``position`` (None: no limit)."""
        s = self.suspects.get(tp)
        if s is None or position is None:
            return None
        first, end = s[0], s[1]
        if position >= end:  # past it (its range was processed)
            del self.suspects[tp]
            return None
        return first - position if position < first else 1

    def careful(self, tp: TopicPartition, position: int | None) -> bool:
        """Whether ``tp``'s next record lies in its suspect range (handed out alone)."""
        s = self.suspects.get(tp)
        return s is not None and position is not None and s[0] <= position < s[1]

    def crashes_of(self, tp: TopicPartition, offset: int, rows: int) -> int:
        """The crashes the record at ``offset`` caused, if it is about to be handed out
        alone and a crash pinned it (0 otherwise); it is then settled here."""
        s = self.suspects.get(tp)
        if s is None or rows != 1 or s[:2] != (offset, offset + 1) or not s[3]:
            return 0
        del self.suspects[tp]
        return s[2]

    def span(self, tp: TopicPartition, first: int, end: int, high_watermark: int) -> int:
        """The end to note for records [first, end) handed out: exactly ``end`` in a
        suspect's range, else as far as the high watermark, ``NOTE_SPAN`` at most."""
        if tp in self.suspects:
            return end
        return max(end, min(high_watermark, first + NOTE_SPAN))

    async def note(self, ranges: Mapping[TopicPartition, tuple[int, int]]) -> None:
        """Say what is in flight now (awaited), unless the last note covers it and none is
        a suspect's; an empty ``ranges`` clears the last note without waiting."""
        if not self.enabled:
            return
        if not ranges:
            if self._noted:
                self._noted = {}
                self._spawn(self._send_off({}), "strata-consumer-progress")
            return
        noted = self._noted
        careful = any(tp in self.suspects for tp in ranges)
        if not careful and all(
            tp in noted and noted[tp][0] <= first and end <= noted[tp][1]
            for tp, (first, end) in ranges.items()
        ):
            return
        self._noted = dict(ranges)
        await self._note(ranges)

    async def _send_off(self, ranges: dict[TopicPartition, tuple[int, int]]) -> None:
        await self._note(ranges)

    async def _note(self, ranges: Mapping[TopicPartition, tuple[int, int]]) -> Suspects | None:
        try:
            return await self.group.progress(ranges)
        except UnsupportedVersionError:
            log.warning("the group coordinator does not count crashes (an older agent)")
            self.enabled = False
        except (StrataError, TimeoutError) as exc:
            log.debug("progress note not taken: %r", exc)
        return None
