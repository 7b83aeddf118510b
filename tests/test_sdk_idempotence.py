"""The idempotent producer against a real agent: lost responses are retried without storing
records twice, and several batches of a partition in flight keep their order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sdk import Consumer, Producer, TopicPartition
from tests.cluster import Cluster, read_records
from tests.harness import ProcessGroup, ZooKeeperChroot
from tests.lost_reply_proxy import LostReplyProxy

TOPIC = "orders"
PROXY_HOST = "127.0.0.2"  # the agent advertises this address; the proxy listens there


@pytest.fixture
def agent(processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path) -> Cluster:
    c = Cluster(processes, zk_chroot, tmp_path / "data")
    handle = c.start_agent(1, f"advertised.host={PROXY_HOST}")
    handle.host = "127.0.0.1"  # where it listens: the test's own admin calls go there directly
    c.create_topic(TOPIC, 1)
    c.wait_for_leaders(TOPIC)
    return c


async def _everything(bootstrap: str) -> list[Any]:
    tp = TopicPartition(TOPIC, 0)
    async with Consumer({"bootstrap.servers": bootstrap}) as consumer:
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        return await read_records(consumer, end)


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_lost_produce_response_is_retried_without_a_duplicate(
    agent: Cluster, idempotent: bool
) -> None:
    """The proxy resets the connection instead of relaying the answers to three produce
    requests the agent did store. The idempotent producer's retries are recognised: every
    record is stored once, in order, at the offset its acknowledgement named. Without
    idempotence the same retries store records twice (which shows the faults bite)."""
    port = agent.agents[1].port
    values = [b"%05d" % i for i in range(3000)]

    async def run() -> tuple[list[Any], list[Any], LostReplyProxy]:
        async with LostReplyProxy(PROXY_HOST, "127.0.0.1", port, lose={3, 8, 15}) as proxy:
            config = {
                "bootstrap.servers": f"{PROXY_HOST}:{port}",
                "linger.ms": 0,
                "retry.backoff.ms": 10,
                "enable.idempotence": idempotent,
            }
            async with Producer(config) as producer:
                futures: list[asyncio.Future[Any]] = []
                for i in range(0, len(values), 30):
                    futures += [
                        await producer.send(TOPIC, v, partition=0) for v in values[i : i + 30]
                    ]
                    if len(futures) > 90:
                        # a few runs in flight at a time: many requests, pipelined
                        await asyncio.wait([futures[-91]])
                acks = await asyncio.gather(*futures)
            return acks, await _everything(f"{PROXY_HOST}:{port}"), proxy

    acks, stored, proxy = asyncio.run(run())
    print(f"{proxy.produce_requests} produce requests, {proxy.lost} responses lost")
    assert proxy.lost >= 2 and proxy.produce_requests > 15
    stored_values = [r.value for r in stored]
    if not idempotent:
        assert len(stored_values) > len(values)
        return
    assert stored_values == values
    assert [a.offset for a in acks] == [r.offset for r in stored] == list(range(len(values)))
