"""The producer's sender logic without a network: grouping by leader, the in-flight window,
retry versus failure. Metadata is fed in as a decoded MetadataResponse."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from sdk.accumulator import RecordAccumulator
from sdk.cluster import Cluster
from sdk.config import ProducerConfig
from sdk.errors import DeliveryTimeoutError
from sdk.producer import Sender
from sdk.records import TopicPartition
from storage.errors import CorruptBatchError, NotLeaderError, RequestTimedOutError
from storage.protocol.messages import (
    AgentInfo,
    MetadataResponse,
    PartitionMetadata,
    ProducePartitionResult,
    ProduceRequest,
    ProduceResponse,
    ProduceTopicResult,
    TopicMetadata,
)


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def metadata(leaders: dict[int, int], epoch: int = 1) -> MetadataResponse:
    return MetadataResponse(
        agents=[AgentInfo(1, "a1", 1), AgentInfo(2, "a2", 2)],
        controller_id=1,
        topics=[
            TopicMetadata(
                0,
                "t",
                [
                    PartitionMetadata(0, p, leader, epoch, [leader], [leader])
                    for p, leader in leaders.items()
                ],
            )
        ],
    )


def setup(**config: Any) -> tuple[Sender, RecordAccumulator, Cluster, Clock]:
    cfg = ProducerConfig.parse(
        {"bootstrap.servers": "a1:1", "linger.ms": 0, "retry.backoff.ms": 100, **config}
    )
    clock = Clock()
    cluster = Cluster(cfg, clock=clock)
    cluster.apply_metadata(metadata({0: 1, 1: 1, 2: 2}))
    acc = RecordAccumulator(
        batch_size=cfg.batch_size,
        linger_ms=cfg.linger_ms,
        buffer_memory=cfg.buffer_memory,
        delivery_timeout_ms=cfg.delivery_timeout_ms,
        max_request_size=cfg.max_request_size,
        clock=clock,
    )

    def no_spawn(coro: Coroutine[Any, Any, None], name: str) -> Any:
        coro.close()
        raise AssertionError("plan() must not start tasks")

    sender = Sender(cfg, acc, cluster, no_spawn, clock=clock, backoff=lambda attempt: 0.1)  # type: ignore[arg-type]
    return sender, acc, cluster, clock


def test_one_request_per_leader_with_several_partitions() -> None:
    async def go() -> None:
        sender, acc, _, clock = setup()
        for p in (0, 1, 2):
            await acc.append(TopicPartition("t", p), b"x%d" % p)
        requests, _ = sender.plan(clock.now)
        by_agent = {agent: sorted(b.tp.partition for b in batches) for agent, batches in requests}
        assert by_agent == {1: [0, 1], 2: [2]}
        (batches,) = [b for agent, b in requests if agent == 1]
        request = sender.request_for(batches)
        assert request.acks == 1 and request.timeout_ms == 30_000
        assert [(t.name, sorted(p.partition for p in t.partitions)) for t in request.topics] == [
            ("t", [0, 1])
        ]
        assert all(
            p.records == [b.encoded]
            for b, p in zip(
                sorted(batches, key=lambda b: b.tp.partition),
                sorted(request.topics[0].partitions, key=lambda p: p.partition),
                strict=True,
            )
        )

    asyncio.run(go())


def test_in_flight_window_per_leader() -> None:
    async def go() -> None:
        sender, acc, _, clock = setup(**{"max.in.flight.requests.per.connection": 1})
        await acc.append(TopicPartition("t", 0), b"a")
        (req,), _ = sender.plan(clock.now)
        assert req[0] == 1
        await acc.append(TopicPartition("t", 1), b"b")  # same leader, window full
        await acc.append(TopicPartition("t", 2), b"c")  # other leader, free
        requests, _ = sender.plan(clock.now)
        assert [agent for agent, _ in requests] == [2]
        sender.request_done(1)
        requests, _ = sender.plan(clock.now)
        assert [(agent, [b.tp.partition for b in bs]) for agent, bs in requests] == [(1, [1])]

    asyncio.run(go())


def test_full_batches_fill_the_in_flight_window_in_one_pass() -> None:
    """Each ready partition's head batch fills a request alone: one pass sends them all (up to
    the window), not one request per pass — the sender is only woken again by a response."""

    async def go() -> None:
        sender, acc, cluster, clock = setup(
            **{"max.in.flight.requests.per.connection": 2, "max.request.size": 4096}
        )
        cluster.apply_metadata(metadata({0: 1, 1: 1, 2: 1}))
        for p in (0, 1, 2):
            await acc.append(TopicPartition("t", p), bytes(3000))
        requests, _ = sender.plan(clock.now)
        assert [(agent, len(bs)) for agent, bs in requests] == [(1, 1), (1, 1)]
        assert sender.in_flight == 2
        assert sender.plan(clock.now)[0] == []  # window full
        sender.request_done(1)
        requests, _ = sender.plan(clock.now)
        assert [(agent, len(bs)) for agent, bs in requests] == [(1, 1)]

    asyncio.run(go())


def test_unknown_leader_waits_and_asks_for_metadata() -> None:
    async def go() -> None:
        sender, acc, cluster, clock = setup()
        cluster.apply_metadata(metadata({0: -1, 1: 1, 2: 2}))
        await acc.append(TopicPartition("t", 0), b"a")
        assert not cluster.update_requested
        requests, delay = sender.plan(clock.now)
        assert requests == [] and delay == pytest.approx(0.1)
        assert cluster.update_requested
        cluster.apply_metadata(metadata({0: 2, 1: 1, 2: 2}, epoch=2))
        requests, _ = sender.plan(clock.now)
        assert [agent for agent, _ in requests] == [2]

    asyncio.run(go())


def test_retriable_error_goes_back_to_the_head_after_backoff() -> None:
    async def go() -> None:
        sender, acc, cluster, clock = setup()
        tp = TopicPartition("t", 0)
        fut = await acc.append(tp, b"a")
        await acc.append(tp, b"b")  # same batch (linger 0 but still open)
        ((_, (batch,)),), _ = sender.plan(clock.now)
        sender.retry_or_fail(batch, NotLeaderError("moved"))
        assert cluster.update_requested
        assert acc.batches(tp)[0] is batch and batch.attempts == 1
        assert sender.plan(clock.now)[0] == []  # backing off
        clock.now += 0.1
        ((_, (again,)),), _ = sender.plan(clock.now)
        assert again is batch
        acc.complete(batch, 10)
        assert (await fut).offset == 10

    asyncio.run(go())


def test_non_retriable_error_fails_at_once() -> None:
    async def go() -> None:
        sender, acc, _, clock = setup()
        fut = await acc.append(TopicPartition("t", 0), b"a")
        ((_, (batch,)),), _ = sender.plan(clock.now)
        sender.retry_or_fail(batch, CorruptBatchError("bad crc"))
        with pytest.raises(CorruptBatchError):
            await fut

    asyncio.run(go())


def test_retries_are_bounded_by_the_retries_setting() -> None:
    async def go() -> None:
        sender, acc, _, clock = setup(retries=1)
        fut = await acc.append(TopicPartition("t", 0), b"a")
        ((_, (batch,)),), _ = sender.plan(clock.now)
        sender.retry_or_fail(batch, RequestTimedOutError("slow"))
        clock.now += 0.1
        ((_, (batch,)),), _ = sender.plan(clock.now)
        sender.retry_or_fail(batch, RequestTimedOutError("still slow"))
        with pytest.raises(RequestTimedOutError, match="still slow"):
            await fut

    asyncio.run(go())


def test_retries_stop_at_the_delivery_timeout() -> None:
    async def go() -> None:
        sender, acc, _, clock = setup(**{"delivery.timeout.ms": 30_100})
        fut = await acc.append(TopicPartition("t", 0), b"a")
        ((_, (batch,)),), _ = sender.plan(clock.now)
        clock.now += 30.05  # a retry after the 0.1 s backoff would be too late
        sender.retry_or_fail(batch, NotLeaderError("moved"))
        with pytest.raises(DeliveryTimeoutError, match=r"delivery\.timeout\.ms") as info:
            await fut
        assert isinstance(info.value.__cause__, NotLeaderError)

    asyncio.run(go())


def test_metadata_never_goes_back_to_an_older_leader_epoch() -> None:
    async def go() -> None:
        _, _, cluster, _ = setup()
        cluster.apply_metadata(metadata({0: 2, 1: 1, 2: 2}, epoch=5))
        cluster.apply_metadata(metadata({0: 1, 1: 1, 2: 2}, epoch=4))  # a lagging agent
        assert cluster.leader_for("t", 0) == 2
        assert cluster.leader_epoch("t", 0) == 5
        cluster.apply_metadata(metadata({0: 1, 1: 1, 2: 2}, epoch=6))
        assert cluster.leader_for("t", 0) == 1

    asyncio.run(go())


def test_a_partitions_queued_batches_share_one_request_and_keep_their_order() -> None:
    """Closed batches queued behind a partition's head go in the same request, back to back
    in its records field: stored from the answered base offset in order; on a retriable error
    they all go back to the head of the queue in their original order."""

    async def go() -> None:
        sender, acc, cluster, clock = setup(**{"batch.size": 100, "max.request.size": 1 << 20})
        tp = TopicPartition("t", 0)
        futures = [await acc.append(tp, b"v%d" % i) for i in range(3)]  # one batch each
        ((agent, batches),), _ = sender.plan(clock.now)
        assert [b.record_count for b in batches] == [1, 1, 1]
        request = sender.request_for(batches)
        (part,) = request.topics[0].partitions
        assert part.records == [b.encoded for b in batches]
        answers = iter([(NotLeaderError.code, -1), (0, 40)])
        sent: list[Any] = []

        async def send(agent_id: int, body: ProduceRequest, expect_response: bool) -> Any:
            sent.append(body)
            code, base = next(answers)
            result = ProducePartitionResult(0, code, "moved" if code else None, base, 0, 1, 1)
            return ProduceResponse([ProduceTopicResult("t", [result])])

        cluster.send = send  # type: ignore[method-assign]
        await sender._produce(agent, batches)
        assert list(acc.batches(tp)) == batches  # all back, in order
        clock.now += 0.1
        ((agent, again),), _ = sender.plan(clock.now)
        assert again == batches
        await sender._produce(agent, again)
        assert [(await f).offset for f in futures] == [40, 41, 42]
        assert len(sent) == 2

    asyncio.run(go())
