"""Plumbing of bench/compare_bench.py (the benchmark itself never runs in the tests)."""

from __future__ import annotations

from bench.compare_bench import SIZES, _pcts, _rate, _strip, loopback_mb_per_s, render


def _fake() -> dict[str, object]:
    produce = {str(s): _rate(1000, s, 0.01) for s in SIZES}
    lat = {
        "rate": 1000,
        "achieved_rate": 999.0,
        "ack": _pcts([0.001] * 10),
        "ack_with_consumer": _pcts([0.003] * 10),
        "e2e": _pcts([0.002] * 10),
    }
    peer = {"produce": produce, "consume": _rate(1000, 1024, 0.01), "latency": lat}
    return {
        "date": "2026-01-01",
        "machine": "test",
        "command": "make bench",
        "elapsed_s": 60.0,
        "shared": True,
        "partitions": 4,
        "rate": 1000,
        "latency_seconds": 1.0,
        "limits": {
            "disk_fdatasync_mb_per_s": 500.0,
            "disk_runs_mb_per_s": [400.0, 500.0],
            "fsyncs_per_s": 1000.0,
            "loopback_mb_per_s": 3000.0,
        },
        "strata_acks1": {
            str(s): {"send": produce[str(s)], "send_batch": produce[str(s)]} for s in SIZES
        },
        "strata_acksall": {
            str(s): {"send": produce[str(s)], "send_batch": produce[str(s)]} for s in SIZES
        },
        "lat_strata_acks1": lat,
        "lat_strata_acksall": lat,
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
    }


def test_render_quotes_ratios_targets_and_unavailable_peers() -> None:
    text = render(_fake())
    assert text.startswith("<!-- compare-bench:begin") and text.endswith(
        "<!-- compare-bench:end -->"
    )
    assert "Strata ÷ Redis Streams: **1.00x**" in text
    assert "RabbitMQ streams | not measured: did not start" in text
    assert "Shared machine" in text and "peak **200 MiB**" in text
    assert "**10.0x** the acks=1 rate" in text
    assert "produce→ack ≤ 5 ms with acks=1: met (1.00 ms)" in text
    assert "With a consumer in the producer's event loop: 3.00 and 3.00 ms" in text
    assert "| Redis Streams | 1.00 | 1.00 | 1.00 | 2.00 | 2.00 | 2.00 | 3.00 / 3.00 | 999 |" in text


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
