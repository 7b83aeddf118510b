"""The agent's half of a topic delete (step 3): remove the topic's local logs, then say so.

When an agent learns that a topic is being deleted (its spec's ``deletion`` is set, through
the spec watch or a state the reconciler applies), it at once stops opening any partition of
that incarnation (``PartitionManager.forbid``), then, in this component's loop:

1. closes every hosted partition of the incarnation and deletes every ``<topic>-<p>``
   directory (``PartitionManager.remove_topic``);
2. waits until no tiering pass over the topic is running (``Tiering.quiesce``): from then on
   this agent uploads nothing and writes no snapshot for the topic;
3. writes ``/topics/<topic>/removed/<agent id>`` with the topic id.

The controller's step 3 waits for that node from every live replica. A failure (a disk error,
ZooKeeper unavailable) is retried after a backoff; a restarted agent does it all again (the
spec watch brings the mark back), which is harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from storage.errors import StrataError

if TYPE_CHECKING:
    from storage.metadata import MetadataStore, TopicSpec

log = logging.getLogger(__name__)


class Remover(Protocol):
    """What the removal needs of the partition manager."""

    def forbid(self, topic_id: str) -> None: ...
    async def remove_topic(self, topic: str, topic_id: str) -> int: ...


class LocalRemoval:
    def __init__(
        self,
        agent_id: int,
        partitions: Remover,
        store: MetadataStore,
        quiesce: Callable[[str], Awaitable[None]],
        *,
        retry_s: float = 1.0,
    ) -> None:
        self.agent_id = agent_id
        self.partitions = partitions
        self.store = store
        self.quiesce = quiesce
        self.retry_s = retry_s
        self._wanted: dict[tuple[str, str], None] = {}
        self.done: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()

    def request(self, spec: TopicSpec) -> None:
        """``spec`` is marked for deletion: stop opening it now, remove it in ``run``."""
        key = (spec.name, spec.topic_id)
        self.partitions.forbid(spec.topic_id)
        if key not in self.done and key not in self._wanted:
            self._wanted[key] = None
            self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for topic, topic_id in list(self._wanted):
                try:
                    await self._remove(topic, topic_id)
                except (StrataError, OSError) as exc:
                    log.warning(
                        "cannot remove deleted topic %s (id %s) here yet: %s", topic, topic_id, exc
                    )
                    asyncio.get_running_loop().call_later(self.retry_s, self._wake.set)
                    continue
                del self._wanted[(topic, topic_id)]
                self.done.add((topic, topic_id))

    async def _remove(self, topic: str, topic_id: str) -> None:
        await self.partitions.remove_topic(topic, topic_id)
        await self.quiesce(topic)
        if await self.store.ack_removal(topic, topic_id, self.agent_id):
            log.info("topic %s (id %s): local logs removed, acknowledged", topic, topic_id)
