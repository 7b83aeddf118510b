"""``MetadataStore`` against a real ZooKeeper: the controller seat."""

from __future__ import annotations

import asyncio

from storage.metadata import AsyncZooKeeper, MetadataStore
from tests.harness import ZooKeeperChroot


def test_a_session_that_holds_the_controller_seat_gets_it_back_and_others_do_not(
    zk_chroot: ZooKeeperChroot,
) -> None:
    """A controller that stopped acting while its connection was suspended asks for the seat
    again once reconnected; its session still owns ``/controller``, so the seat is its own,
    at the same epoch. Another session's claim is refused while that node lives, and gets a
    new epoch once the holder's session is gone."""

    async def run() -> None:
        one = AsyncZooKeeper(zk_chroot.connect_string)
        two = AsyncZooKeeper(zk_chroot.connect_string)
        await one.start()
        await two.start()
        try:
            first = await MetadataStore(one).try_become_controller(1)
            assert first is not None
            assert await MetadataStore(one).try_become_controller(1) == first
            assert await MetadataStore(two).try_become_controller(2) is None
            await one.stop()  # the session ends: its ephemeral seat goes with it
            taken = await MetadataStore(two).try_become_controller(2)
            assert taken is not None
            assert (taken.agent_id, taken.epoch) == (2, first.epoch + 1)
        finally:
            await two.stop()
            await one.stop()

    asyncio.run(run())
