"""A ZooKeeper call cancelled in the loop turn its reply lands in is cancelled, not answered.

``asyncio.wait_for`` on Python 3.11 returns the result and drops the cancellation in that case
(gh-86296). The agent's controller makes thousands of calls; when its task was cancelled at
stop, one such call swallowed the cancel, the controller went on, and the agent's graceful
stop hung until it was killed (2 stops in 4 of an agent with 10,000 partitions). The race
cannot be produced on demand against a server, so the reply here is a stand-in with the two
methods of kazoo's ``IAsyncResult`` that ``AsyncZooKeeper`` uses; the call path is the real
one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from storage.metadata import AsyncZooKeeper


class _Reply:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def rawlink(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def get_nowait(self) -> bytes:
        return b"data"


def test_a_call_cancelled_as_its_reply_lands_raises_cancelled() -> None:
    async def run() -> None:
        zk = AsyncZooKeeper("127.0.0.1:1")  # never started: only the call's handling is used
        reply = _Reply()
        task = asyncio.create_task(zk._call(reply, "get /x"))
        await asyncio.sleep(0)  # the call waits for its reply
        for callback in reply.callbacks:
            callback(reply)  # the reply lands (kazoo's thread hands it to the next turn) ...
        task.cancel()  # ... and the task is cancelled before that turn
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_call_answered_without_a_cancel_returns_the_reply() -> None:
    async def run() -> bytes:
        zk = AsyncZooKeeper("127.0.0.1:1")
        reply = _Reply()
        task = asyncio.create_task(zk._call(reply, "get /x"))
        await asyncio.sleep(0)
        for callback in reply.callbacks:
            callback(reply)
        result: bytes = await task
        return result

    assert asyncio.run(run()) == b"data"
