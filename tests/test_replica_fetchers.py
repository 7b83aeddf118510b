"""A replica fetcher that dies of an unexpected error is started again.

The expected failures (connection loss, timeouts, protocol errors) are retried inside the
fetch loop and covered by the replication tests with real agents. A *bug* — an exception the
loop does not expect — cannot be produced through a real leader, so here the real
``ReplicaFetchers`` runs with its fetch loop replaced by one that fails once: the supervisor
must log it and start a new fetcher for the same leader, not leave replication stopped until
the next leadership change.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from broker_agents.replication import ReplicaFetchers
from broker_agents.view import ClusterView


def test_a_fetcher_that_dies_of_a_bug_is_restarted_and_stop_ends_it() -> None:
    follower = SimpleNamespace(role="follower", state=SimpleNamespace(leader=7, adding=[]))
    partitions: Any = SimpleNamespace(partitions={("t", 0): follower})
    config = SimpleNamespace(follower_replication_throttled_rate=0)
    fetchers = ReplicaFetchers(1, partitions, ClusterView(), cast(Any, config))
    fetchers.restart_delay = 0.01
    calls: list[int] = []

    async def run() -> None:
        second = asyncio.Event()

        async def follow(leader: int, moving: bool) -> None:
            assert not moving
            calls.append(leader)
            if len(calls) == 1:
                raise RuntimeError("a bug in the fetch loop")
            second.set()
            await asyncio.Event().wait()  # a healthy fetcher runs until cancelled

        fetchers._follow = follow  # type: ignore[method-assign]
        fetchers.update()
        first = fetchers.tasks[7, False]
        async with asyncio.timeout(5):
            await second.wait()
        assert fetchers.tasks[7, False] is not first and not fetchers.tasks[7, False].done()
        await fetchers.stop()
        assert fetchers.tasks == {}
        fetchers.update()  # stopped: no new fetcher
        assert fetchers.tasks == {}

    asyncio.run(run())
    assert calls == [7, 7]


def test_the_move_throttle_holds_its_rate_and_pays_back_debt() -> None:
    from broker_agents.replication import MoveThrottle

    now = [0.0]
    t = MoveThrottle(1000, clock=lambda: now[0])
    assert t.available() == 1000  # a second's worth of burst
    t.spend(1500)  # one batch past the allowance: debt
    assert t.available() == 0 and t.wait_s() > 0.5
    now[0] += t.wait_s()
    assert t.available() >= 1
    now[0] += 10.0  # idle: the burst is capped at a second's worth
    assert t.available() == 1000
    spent = 0
    for _ in range(100):  # a greedy copier over 10 s gets about 10 s of rate
        now[0] += 0.1
        take = t.available()
        t.spend(take)
        spent += take
    assert 9_000 <= spent <= 11_000
