"""Plumbing of bench/compare_bench.py (the benchmark itself never runs in the tests)."""

from __future__ import annotations

from typing import Any

from bench.compare_bench import (
    SIZES,
    _durability,
    _pcts,
    _rate,
    _strip,
    combine,
    loopback_mb_per_s,
    render,
    summarize,
)


def _latency(ack_s: float) -> dict[str, Any]:
    return {
        "rate": 1000,
        "achieved_rate": 999.0,
        "ack": _pcts([ack_s] * 10),
        "ack_with_consumer": _pcts([0.003] * 10),
        "e2e": _pcts([0.002] * 10),
    }


def _round(strata_seconds: float, disk: float) -> dict[str, Any]:
    """One round: Strata's runs took ``strata_seconds`` for 1,000 messages, every peer 0.01."""
    produce = {str(s): _rate(1000, s, 0.01) for s in SIZES}
    strata = {str(s): _rate(1000, s, strata_seconds) for s in SIZES}
    peer = {"produce": produce, "consume": _rate(1000, 1024, 0.01), "latency": _latency(0.001)}
    durable = {"produce": {"1024": _rate(100, 1024, 0.01)}, "latency": _latency(0.004)}
    return {
        "limits": {
            "append_1mib_mb_per_s": disk,
            "disk_fdatasync_mb_per_s": 500.0,
            "disk_runs_mb_per_s": [400.0, 500.0],
            "fsyncs_per_s": 1000.0,
            "loopback_mb_per_s": 3000.0,
        },
        "strata_acks1": {
            str(s): {"send": strata[str(s)], "send_batch": strata[str(s)]} for s in SIZES
        },
        "strata_acks1_interval": {"1024": {"send": strata["1024"], "send_batch": strata["1024"]}},
        "strata_acksall": {
            str(s): {"send": produce[str(s)], "send_batch": produce[str(s)]} for s in SIZES
        },
        "lat_strata_acks1": _latency(0.002),
        "lat_strata_acks1_interval": _latency(0.001),
        "lat_strata_acksall": _latency(0.002),
        "consume_disk": _rate(1000, 1024, 0.01),
        "consume_tier": {"error": "no moto"},
        "overload": {
            "connections": 16,
            "seconds": 10.0,
            "capacity_msgs_per_s": 1e6,
            "capacity_mb_per_s": 1000.0,
            "accepted_msgs_per_s": 1e5,
            "answers": 1000,
            "errors": 0,
            "sustained_msgs_per_s": 1e5,
            "overload_factor": 10.0,
            "rss_before_mib": 100.0,
            "rss_peak_mib": 200.0,
        },
        "peers": {"Redis Streams": peer, "RabbitMQ streams": {"error": "did not start"}},
        "peers_durable": {"Redis Streams": durable, "NATS JetStream": {"error": "too old"}},
        "_lat": {"raw": [1.0]},
    }


def _result(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return combine(rounds) | {
        "date": "2026-01-01",
        "machine": "test",
        "command": "make bench",
        "elapsed_s": 60.0,
        "shared": True,
        "partitions": 4,
        "rate": 1000,
        "latency_seconds": 1.0,
    }


def test_medians_ranges_and_ratios_within_a_round() -> None:
    # Strata 2x, 4x and 3x the peers; Strata ÷ disk 100, 100 and 300 within the rounds: the
    # median of those is 100, where the ratio of the medians (307.2 / 2.048) would be 150
    rounds = [_round(0.005, 2.048), _round(0.0025, 4.096), _round(1 / 300, 1.024)]
    result = _result(rounds)
    assert "_lat" not in result["rounds"][0]
    assert result["strata_acks1"]["1024"]["send_batch"]["msgs_per_s"] == 300_000
    assert result["range"]["strata_acks1"]["1024"]["send_batch"]["msgs_per_s"] == [
        200_000,
        400_000,
    ]
    text = render(result)
    assert text.startswith("<!-- compare-bench:begin") and text.endswith(
        "<!-- compare-bench:end -->"
    )
    assert "**3 rounds**" in text and "Shared machine" in text
    assert "Strata ÷ disk (1 MiB appends, fdatasync each): **100.000 (100.000-300.000)**" in text
    assert "Strata ÷ Redis Streams (its usual setting): **3.00x (2.00x-4.00x)**" in text
    assert "| 300,000 | 200,000-400,000 |" in text
    assert "RabbitMQ streams | | not measured: did not start" in text
    # same durability: Redis with an fsync per write (10,000 msgs/s) against Strata `always`
    assert (
        "| fsync before the ack | Redis Streams | `appendfsync always` | 10,000 (10,000-10,000) | 30.00x (20.00x-40.00x) |"
        in text
    )
    assert (
        "| fsync before the ack | NATS JetStream | `sync_interval: always` | not measured: too old"
        in text
    )
    assert "| Redis Streams, fsync per write | fsync per write before the ack | 4.00 |" in text
    assert "`always` **missed** (2.00 ms), `interval` met (1.00 ms)" in text
    assert "peak **200 (200-200) MiB**" in text and "**10.0x** the acks=1 rate" in text


def test_summarize_keeps_a_peer_that_failed_in_one_round() -> None:
    good = {"peers": {"X": {"produce": 10.0}}}
    bad = {"peers": {"X": {"error": "crashed"}}}
    assert summarize([good, bad, {"peers": {"X": {"produce": 30.0}}}], max) == {
        "peers": {"X": {"produce": 30.0, "error": "crashed"}}
    }


def test_each_row_says_what_its_ack_means() -> None:
    assert "every in-sync replica" in _durability("Strata acks=all RF=3 (3 agents), `send`")
    assert "within 50 ms" in _durability("Strata acks=1, `fsync.policy=interval`, `send`")
    assert "before the ack" in _durability("Strata acks=1, `send_batch`")
    assert _durability("NATS JetStream, fsync per write") == "fsync per write before the ack"
    assert "2 min" in _durability("NATS JetStream")


def test_percentiles_and_private_keys() -> None:
    p = _pcts([0.001 * i for i in range(1, 1001)])
    assert 499 < p["p50_ms"] < 502 and 989 < p["p99_ms"] < 991
    assert _strip({"a": {"_raw": [1], "b": 2}}) == {"a": {"b": 2}}


def test_loopback_probe_moves_bytes() -> None:
    assert loopback_mb_per_s(0.05) > 1


def test_overload_generator_offers_bytes_to_a_discard_sink() -> None:
    import subprocess
    import sys

    from bench.overload import flood

    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.overload", "sink"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        result = flood(f"127.0.0.1:{port}", "t", 2, 0.3, 2)
    finally:
        sink.kill()
        sink.wait()
        if sink.stdout is not None:
            sink.stdout.close()
    assert result["requests"] > 2 and result["bytes"] > result["requests"] * 1_000_000
    assert result["answers"] == 0  # a sink never answers
