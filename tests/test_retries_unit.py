"""The pure parts of retries: the policy's backoff, the redrive task's state table, the key
order bookkeeping of a ``retry.ordering=key`` consumer."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from broker_agents.groups.coordinator import add_crash
from handlers import redrive
from handlers.retry import Seen
from sdk.crashes import NOTE_SPAN, CrashWatch
from sdk.records import ConsumerRecord, TopicPartition
from sdk.retry import DROP, H_DEAD, HAND_OUT, HOLD, PARK, KeyOrder, retry_topic
from storage.errors import InvalidRequestError
from storage.retry_policy import RetryPolicy


def test_backoff_grows_caps_and_jitters_deterministically_within_half_to_full() -> None:
    policy = RetryPolicy.parse({"initial_ms": 1000, "multiplier": 2, "max_ms": 5000})
    for attempt, full in [(1, 1000), (2, 2000), (3, 4000), (4, 5000), (9, 5000)]:
        wait = policy.backoff_ms(attempt, "g/t/0/7")
        assert full // 2 <= wait <= full
        assert wait == policy.backoff_ms(attempt, "g/t/0/7")  # a redo computes the same
    fixed = RetryPolicy.parse({"backoff": "fixed", "initial_ms": 300, "jitter": False})
    assert [fixed.backoff_ms(a) for a in (1, 2, 5)] == [300, 300, 300]
    assert not policy.gives_up(7) and policy.gives_up(8)  # max_attempts 8 by default


@pytest.mark.parametrize(
    ("state", "event"), list(itertools.product(redrive.STATES, redrive.EVENTS))
)
def test_redrive_task_states_every_pair(state: str, event: str) -> None:
    expected = redrive.TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(InvalidRequestError):
            redrive.transition(state, event)
    else:
        assert redrive.transition(state, event) == expected
        assert state == redrive.RUNNING  # done and cancelled are final


def rec(
    key: bytes, offset: int, *, retried_from: int | None = None, dead: bool = False
) -> ConsumerRecord:
    if retried_from is None:
        return ConsumerRecord("orders", 0, offset, 0, key, b"v", [], ())
    headers = [
        ("strata.retry.topic", b"orders"),
        ("strata.retry.partition", b"0"),
        ("strata.retry.offset", str(retried_from).encode()),
        ("strata.retry.attempt", b"1"),
    ]
    if dead:
        headers.append((H_DEAD, b"1"))
    return ConsumerRecord(retry_topic("g"), 0, offset, 0, key, b"v", headers, ())


def test_key_order_holds_later_records_of_a_key_until_the_retried_one_succeeds() -> None:
    ko = KeyOrder()
    first, second, other = rec(b"k", 1), rec(b"k", 2), rec(b"x", 3)
    assert ko.admit(first) == HAND_OUT
    ko.failed(first)  # retry_later
    assert ko.admit(second) == HOLD  # k waits behind offset 1
    assert ko.admit(other) == HAND_OUT  # another key does not
    assert ko.next_ready() is None
    assert ko.commit_caps() == {("orders", 0): 2}  # the held record is not committed
    back = rec(b"k", 10, retried_from=1)
    assert ko.admit(back) == HAND_OUT
    assert ko.next_ready() == second  # offset 1 succeeded: offset 2's turn
    assert ko.next_ready() is None and ko.commit_caps() == {}


def test_key_order_a_dead_letter_notice_releases_the_key_and_a_full_memory_parks() -> None:
    ko = KeyOrder(max_held=1)
    assert ko.admit(rec(b"k", 1)) == HAND_OUT
    ko.failed(rec(b"k", 1))
    assert ko.admit(rec(b"k", 2)) == HOLD
    assert ko.admit(rec(b"k", 3)) == PARK  # one held at most
    assert ko.admit(rec(b"k", 11, retried_from=1, dead=True)) == DROP
    assert ko.next_ready() == rec(b"k", 2)
    # asking for the next record settles 2 (it succeeded): the parked 3 is next in line
    assert ko.admit(rec(b"k", 12, retried_from=3)) == HAND_OUT
    assert ko.admit(rec(b"k", 4)) == HAND_OUT and ko.lines == {}


class _Group:
    """A GroupClient stand-in that answers notes with fixed suspects and records them."""

    def __init__(self, suspects: dict[TopicPartition, list[tuple[int, int, int, bool]]]) -> None:
        self.suspects = suspects
        self.notes: list[dict[TopicPartition, tuple[int, int]]] = []
        self.asked: list[set[TopicPartition]] = []

    async def progress(
        self, ranges: dict[TopicPartition, tuple[int, int]], on_sent: Any, asked: Any = ()
    ) -> Any:
        self.notes.append(dict(ranges))
        self.asked.append(set(asked))
        if on_sent is not None:
            on_sent()
        await asyncio.sleep(0)  # the answer comes later
        return {tp: list(s) for tp, s in self.suspects.items() if tp in self.asked[-1]}


def test_crash_watch_hands_a_suspect_range_out_one_by_one_and_diverts_only_pinned_records() -> None:
    a, b, c = TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("t", 2)
    group = _Group({a: [(10, 20, 1, False)], b: [(7, 8, 2, True)], c: [(3, 4, 1, False)]})
    spawned: list[asyncio.Task[None]] = []

    def spawn(coro: Any, name: str) -> asyncio.Task[None]:
        spawned.append(asyncio.ensure_future(coro))
        return spawned[-1]

    watch = CrashWatch(group, spawn)  # type: ignore[arg-type]

    async def run() -> None:
        await watch.learn({a, b, c})
        assert group.notes == [{}] and group.asked == [{a, b, c}]
        assert set(watch.suspects) == {a, b, c}
        await watch.learn({a, b, c})  # learnt: no note until the next assignment
        assert len(group.notes) == 1
        # before the range: as usual, up to its start; inside: one record
        assert (watch.cap(a, 4), watch.cap(a, 10), watch.cap(a, 19)) == (6, 1, 1)
        assert watch.careful(a, 12) and not watch.careful(a, 9)
        # a single-record suspect no crash pinned is handed out alone, not diverted
        assert watch.crashes_of(c, 3, 1) == 0 and c in watch.suspects
        # a pinned one is settled here, with its crashes
        assert watch.crashes_of(b, 7, 1) == 2 and b not in watch.suspects
        # notes: a suspect's range is exact and awaited; others reach ahead and are skipped
        # while covered
        free = TopicPartition("u", 0)
        positions: dict[TopicPartition, int] = {}
        await watch.note({free: (100, 150)}, positions.get)
        await watch.note({free: (150, 400)}, positions.get)
        assert group.notes[1:] == [{free: (100, 100 + NOTE_SPAN)}]
        # another partition's records: noted with what is left of the last note
        other = TopicPartition("u", 1)
        positions[free] = 400
        await watch.note({other: (0, 50)}, positions.get)
        assert group.notes[2] == {free: (400, 400 + NOTE_SPAN), other: (0, NOTE_SPAN)}
        await watch.note({free: (400, 450)}, positions.get)  # covered: taking turns
        assert len(group.notes) == 3
        await watch.note({a: (12, 13)}, positions.get)  # a suspect's: exact, always sent
        await watch.note({a: (12, 13)}, positions.get)
        assert group.notes[3:] == [{a: (12, 13)}, {a: (12, 13)}]
        # past the range, the suspect is forgotten; an empty poll clears without waiting
        assert watch.cap(a, 20) is None and a not in watch.suspects
        await watch.note({}, positions.get)
        await asyncio.gather(*spawned)
        assert group.notes[-1] == {}
        watch.assigned()
        await watch.learn({a})
        assert group.asked[-1] == {a} and set(watch.suspects) == {a}
        # the range reaches ahead of what existed: once the position inside it reaches a high
        # watermark seen, the rest was never in flight
        watch.caught_up(a, 9, 9)  # before the range
        watch.caught_up(a, 12, -1)  # no high watermark seen yet
        watch.caught_up(a, 12, 15)  # records of the range still to come
        assert set(watch.suspects) == {a}
        watch.caught_up(a, 12, 12)
        assert watch.suspects == {}
        assert all(not asked for asked in group.asked[1:-1])  # only a learning note asks

    asyncio.run(run())


def test_a_crash_short_of_a_pinned_record_leaves_it_pinned() -> None:
    """A member dies on records before a suspect (handed out as usual): the pinned record
    keeps its crashes (one run lost them, and the record then killed two members more)."""
    pinned = [(36, 37, 2, True)]
    after = add_crash(pinned, 33, 36, False)
    assert after == [(33, 36, 1, False), (36, 37, 2, True)]
    # narrowed down inside one of them: one crash more there, the other unchanged
    assert add_crash(after, 34, 35, True) == [
        (34, 35, 2, True),
        (36, 37, 2, True),
    ]
    # a range over a suspect (its owner did not know it) starts again and replaces it
    assert add_crash(after, 30, 40, False) == [(30, 40, 1, False)]
    assert add_crash([], 5, 6, True) == [(5, 6, 1, True)]


def test_crash_watch_takes_a_partitions_suspects_in_offset_order() -> None:
    tp = TopicPartition("t", 0)
    group = _Group({tp: [(33, 36, 1, False), (36, 37, 2, True)]})
    watch = CrashWatch(group, lambda coro, name: asyncio.ensure_future(coro))  # type: ignore[arg-type]

    async def run() -> None:
        await watch.learn({tp})
        for position in (33, 34, 35):  # the first range, one record at a time
            assert watch.careful(tp, position) and watch.cap(tp, position) == 1
            assert watch.crashes_of(tp, position, 1) == 0
        assert watch.careful(tp, 36) and watch.cap(tp, 36) == 1  # the pinned one, alone
        assert watch.crashes_of(tp, 36, 1) == 2 and tp not in watch.suspects
        assert watch.cap(tp, 37) is None

    asyncio.run(run())


def test_the_routers_memory_of_failures_keeps_the_newest_up_to_its_size() -> None:
    seen = Seen(3)
    seen.extend({("a", 1, 0, False): None, ("b", 1, 0, False): None}, 2)
    seen.extend({("c", 1, 0, False): None, ("d", 1, 0, False): None}, 4)
    assert list(seen.ids) == [("b", 1, 0, False), ("c", 1, 0, False), ("d", 1, 0, False)]
    assert seen.end == 4
