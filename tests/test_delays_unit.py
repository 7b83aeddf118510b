"""The pure parts of delayed messages: levels, schedule ids, due times, lanes; the runner's
event and answer shapes."""

from __future__ import annotations

import base64
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from handlers.retry import handler as router_handler
from handlers.retry import record_of as retry_record_of
from handlers.runtime import wants_native_records
from handlers.scheduler import handler as scheduler_handler
from handlers.scheduler import lanes_of
from infra.event_source import build_event, failures_of, item_id, parse_item_id
from sdk import delays as d
from sdk.records import ConsumerRecord, TopicPartition
from storage.errors import InvalidDelayError
from storage.metadata.models import MAX_DELAY_MS, TopicConfig

NOW = 1_800_000_000_000


def test_level_for_never_overshoots_and_the_last_mile_takes_the_rest() -> None:
    assert d.level_for(0) == d.level_for(255) == d.MIN_LEVEL
    assert d.level_for(256) == 8 and d.level_for(511) == 8 and d.level_for(512) == 9
    assert d.level_for(MAX_DELAY_MS) == d.MAX_LEVEL
    rng = random.Random(1)
    for _ in range(10_000):
        r = rng.randrange(256, MAX_DELAY_MS)
        k = d.level_for(r)
        assert d.level_delay_ms(k) <= r < 2 * d.level_delay_ms(k)


@given(st.integers(min_value=0, max_value=MAX_DELAY_MS))
def test_hops_are_at_most_popcount_plus_one(delay: int) -> None:
    remaining, hops = delay, 0
    while remaining >= d.LAST_MILE_MS:
        remaining -= d.level_delay_ms(d.level_for(remaining))  # left exactly on time
        hops += 1
    assert hops <= bin(delay >> 8).count("1")
    assert 0 <= remaining < d.LAST_MILE_MS  # then the last mile, delivered when due


def test_level_topics_are_reserved_names_in_order() -> None:
    names = d.level_topics()
    assert names[0] == "__strata_delay_07" and names[-1] == "__strata_delay_35"
    assert [d.level_of(n) for n in names] == list(d.LEVELS)
    assert d.level_of("orders") is None and d.level_of("__strata_delay_99") is None


def test_delay_max_ms_default_is_one_year_in_both_places() -> None:
    assert TopicConfig().delay_max_ms == d.DEFAULT_DELAY_MAX_MS == 365 * 24 * 3600 * 1000
    assert 2 * d.level_delay_ms(d.MAX_LEVEL) > MAX_DELAY_MS


def test_due_times() -> None:
    limit = d.DEFAULT_DELAY_MAX_MS
    assert d.due_ms(NOW, delay_ms=0, max_delay_ms=limit) == NOW
    assert d.due_ms(NOW, delay_ms=1500, max_delay_ms=limit) == NOW + 1500
    assert d.due_ms(NOW, deliver_at_ms=NOW - 10, max_delay_ms=limit) == NOW  # past: now
    assert d.due_ms(NOW, deliver_at_ms=NOW + 10, max_delay_ms=limit) == NOW + 10
    assert d.due_ms(NOW, delay_level=3, max_delay_ms=limit) == NOW + 10_000  # RocketMQ
    assert d.due_ms(NOW, delay_level=18, max_delay_ms=limit) == NOW + 7_200_000
    assert d.due_ms(NOW, delay_ms=limit, max_delay_ms=limit) == NOW + limit


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_ms": -1},
        {"delay_ms": 1.5},
        {"delay_ms": 10, "deliver_at_ms": NOW},
        {"delay_ms": 10, "delay_level": 1},
        {},
        {"delay_level": 0},
        {"delay_level": 19},
        {"deliver_at_ms": "soon"},
        {"delay_ms": 10_001},
        {"deliver_at_ms": NOW + 10_001},
    ],
)
def test_bad_delays_raise_invalid_delay(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidDelayError) as info:
        d.due_ms(NOW, max_delay_ms=10_000, **kwargs)  # type: ignore[arg-type]
    assert info.value.code == 1040 and not info.value.retriable


@given(
    st.integers(min_value=0, max_value=2**45),
    st.integers(min_value=0, max_value=10_000),
    st.binary(max_size=20) | st.none(),
    st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True),
)
def test_schedule_ids_round_trip(due: int, partition: int, key: bytes | None, topic: str) -> None:
    sid = d.ScheduleId.new(due, topic, partition, key, "abc123")
    assert d.ScheduleId.parse(sid.encode()) == sid
    assert 0 <= sid.lane_in(4) < 4


@pytest.mark.parametrize(
    "text",
    ["", "x", "1~2~3~4", "1~2~zzzzzzzz~n~t", "-1~0~00000000~n~t", "1~0~00000000~n~", "1~0~0~n~t"],
)
def test_malformed_schedule_ids_are_refused(text: str) -> None:
    with pytest.raises(InvalidDelayError):
        d.ScheduleId.parse(text)


def test_one_key_keeps_one_lane_and_keyless_records_spread() -> None:
    lanes = {d.ScheduleId.new(0, "t", 1, b"k", f"n{i}").lane_in(8) for i in range(50)}
    assert len(lanes) == 1
    spread = {d.ScheduleId.new(0, "t", 1, None, f"n{i}").lane_in(8) for i in range(200)}
    assert len(spread) == 8


def test_the_event_is_lambdas_kafka_event() -> None:
    tp = TopicPartition("my-topic-2", 3)
    rec = ConsumerRecord("my-topic-2", 3, 7, 1000, b"k", b"\x00v", [("h", b"\x01\x02")], ["t"])
    event = build_event({tp: [rec]}, "a:1")
    assert event["eventSource"] == "SelfManagedKafka" and event["bootstrapServers"] == "a:1"
    (r,) = event["records"]["my-topic-2-3"]
    assert base64.b64decode(r["key"]) == b"k" and base64.b64decode(r["value"]) == b"\x00v"
    assert r["headers"] == [{"h": [1, 2]}] and r["tags"] == ["t"]
    assert (r["topic"], r["partition"], r["offset"], r["timestamp"]) == ("my-topic-2", 3, 7, 1000)
    assert r["timestampType"] == "CREATE_TIME"


def test_the_scheduler_and_router_read_the_same_records_from_either_event() -> None:
    """The runner hands the delay scheduler and the retry router the records it read (no
    base64); on Lambda they get Lambda's event. Both give them the same records."""
    tp = TopicPartition(d.level_topic(9), 1)
    sid = d.ScheduleId.new(5000, "target", 0, b"k", "n1").encode()
    recs = [
        ConsumerRecord(tp.topic, 1, 8, 1000, None, b"b", [], ()),
        ConsumerRecord(tp.topic, 1, 7, 999, b"k", b"\x00v", [(d.HEADER_ID, sid.encode())], ("t",)),
    ]
    lambda_event = build_event({tp: recs}, "a:1")
    native_event = build_event({tp: recs}, "a:1", native=True)
    assert "records" not in native_event and native_event["bootstrapServers"] == "a:1"
    assert lanes_of(native_event) == lanes_of(lambda_event)
    (lane,) = lanes_of(native_event).values()
    assert [r.offset for r in lane] == [7, 8] and lane[0].sid is not None
    from_lambda = [retry_record_of(doc) for doc in lambda_event["records"][f"{tp.topic}-1"]]
    assert [tuple(r) for r in sorted(from_lambda, key=lambda r: r.offset)] == [
        (*r[:6], list(r.headers), r.tags) for r in sorted(recs, key=lambda r: r.offset)
    ]
    assert wants_native_records(scheduler_handler) and wants_native_records(router_handler)


def test_item_ids_and_partial_failures() -> None:
    tp = TopicPartition("a-b-c", 12)
    assert parse_item_id(item_id("a-b-c", 12, 99)) == (tp, 99)
    answer = {
        "batchItemFailures": [
            {"itemIdentifier": "a-b-c-12@99"},
            {"itemIdentifier": "a-b-c-12@50", "retryAfterMs": 250},
            {"itemIdentifier": "x-0@1"},
        ]
    }
    assert failures_of(answer) == {tp: (50, 250), TopicPartition("x", 0): (1, None)}
    assert failures_of(None) == {} and failures_of({"batchItemFailures": []}) == {}
    with pytest.raises(ValueError):
        parse_item_id("no-offset")
