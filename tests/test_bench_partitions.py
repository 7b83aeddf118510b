"""Plumbing of bench/partitions_bench.py (the benchmark itself never runs in the tests)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.partitions_bench import (
    agent_env,
    command,
    phase_figures,
    render,
    row_key,
    row_order,
    summarize,
    targets,
)


def _row(produce: float, fsyncs: float, arrow: float, getmany: float) -> dict[str, Any]:
    """One row's phases: ``produce`` etc. in msgs/s over 1 s, ``fsyncs`` per second, the agent
    using 1 CPU second for every phase."""
    return {
        "produce": phase_figures(int(produce), 1.0, (0.0, 0.0), (1.0, fsyncs)),
        "consume_arrow": phase_figures(int(arrow), 1.0, (0.0, 0.0), (1.0, 0.0)),
        "consume_getmany": phase_figures(int(getmany), 1.0, (0.0, 0.0), (1.0, 0.0)),
        "fresh_topic": False,
    }


def _round(base: float, at_1024: float) -> dict[str, Any]:
    """``always`` and ``interval`` at 16 and 1,024 partitions; the 1,024 rows produce and
    consume ``at_1024`` when the 16 rows do ``base``; under ``always`` fsyncs/s double."""
    return {
        row_key(policy, 16): _row(base, 100, base * 2, base) for policy in ("always", "interval")
    } | {
        row_key("always", 1024): _row(at_1024, 200, at_1024 * 2, at_1024),
        row_key("interval", 1024): _row(base, 20, base * 2, base),
    }


def _result(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarize(rounds, [16, 1024])
    return {
        "date": "2026-01-01",
        "machine": "test",
        "command": "make bench-partitions",
        "note": "",
        "seconds": 8.0,
        "rounds_run": len(rounds),
        "interval_ms": 50,
        "agent_settings": {"STRATA_AGENT_METRICS_HOST": "127.0.0.1"},
        "elapsed_s": 600.0,
        "created_s": {"always-1024": 12.5},
        "plot": "bench-partitions.png",
        "summary": summary,
        "targets": targets(summary),
    }


def test_ratios_are_taken_within_a_round_then_medianed() -> None:
    # 1,024 ÷ 16 within the rounds: 0.2, 0.6, 0.4 -> median 0.4; the ratio of the medians
    # (the 1,024 medians 120,000 over the 16 medians 200,000) would be 0.6
    rounds = [_round(100_000, 20_000), _round(200_000, 120_000), _round(300_000, 120_000)]
    summary = summarize(rounds, [16, 1024])
    row = summary["rows"]["always-1024"]
    assert summary["base_partitions"] == 16
    assert row["rounds"] == 3
    assert row["produce"]["msgs_per_s"] == {"median": 120_000, "min": 20_000, "max": 120_000}
    assert row["ratio"]["produce.msgs_per_s"]["median"] == pytest.approx(0.4)
    assert row["ratio"]["consume_arrow.msgs_per_s"]["median"] == pytest.approx(0.4)
    assert row["ratio"]["produce.fsyncs_per_s"]["median"] == pytest.approx(2.0)
    # 1 CPU second for 120,000 records: 1/120 s per 1,000 (the median round)
    assert row["produce"]["cpu_s_per_1k"]["median"] == pytest.approx(1 / 120)
    assert summary["rows"]["interval-1024"]["ratio"]["produce.msgs_per_s"]["median"] == 1.0


def test_targets_and_table() -> None:
    rounds = [_round(100_000, 20_000), _round(200_000, 120_000), _round(300_000, 120_000)]
    result = _result(rounds)
    verdicts = {t["what"]: t for t in result["targets"]}
    assert verdicts["produce at 1,024 partitions, `always`"]["met"] is False
    assert verdicts["produce at 1,024 partitions, `interval`"]["met"] is True
    assert verdicts["produce at 4,096 partitions, `always`"]["met"] is None  # not measured
    fsync = next(t for t in result["targets"] if "fsyncs" in t["what"])
    assert fsync["ratio"] == pytest.approx(2.0) and fsync["met"] is False
    text = render(result)
    assert text.startswith("<!-- partitions-bench:begin") and text.endswith(
        "<!-- partitions-bench:end -->"
    )
    assert "**3 round(s)**" in text and "`STRATA_AGENT_METRICS_HOST=127.0.0.1`" in text
    assert (
        "| `always` | 1,024 | 120,000 (20,000-120,000) | 0.40x (0.20x-0.60x) | 200 | 2.00x |"
        in text
    )
    assert "| `always` | 16 | 200,000 (100,000-300,000) | 1.00x | 100 | 1.00x |" in text
    assert "* produce at 1,024 partitions, `always` ≥ 0.5x: **missed** (0.40x)" in text
    assert "* produce at 1,024 partitions, `interval` ≥ 0.5x: met (1.00x)" in text
    assert "* produce at 4,096 partitions, `always` ≥ 0.3x: not measured" in text
    assert "always-1024 12.5 s" in text and "img/bench-partitions.png" in text


def test_a_row_that_failed_in_a_round_counts_with_the_others() -> None:
    rounds = [_round(100_000, 50_000), _round(100_000, 30_000), _round(100_000, 10_000)]
    del rounds[1]["always-1024"]
    rounds[2]["always-16"] = {"error": "DeliveryTimeoutError: expired"}
    summary = summarize(rounds, [16, 1024])
    row = summary["rows"]["always-1024"]
    # round 2 has no 1,024 row, round 3 no base row to divide by: only round 1's ratio
    assert row["rounds"] == 2 and row["ratio"]["produce.msgs_per_s"]["median"] == 0.5
    assert summary["errors"] == {"always-16": ["DeliveryTimeoutError: expired"]}
    result = _result(rounds)
    assert "| always-16 failed in 1 round(s): DeliveryTimeoutError: expired |" in render(result)


def test_rows_alternate_between_rounds() -> None:
    first = row_order([16, 256], 0)
    assert first == [("always", 16), ("always", 256), ("interval", 16), ("interval", 256)]
    assert row_order([16, 256], 1) == first[::-1]
    assert row_order([16, 256], 2) == first
    assert row_order([16, 256], 1, ("interval",)) == [("interval", 256), ("interval", 16)]


def test_agent_settings_become_environment_variables() -> None:
    assert agent_env(["metrics.host=0.0.0.0", "LISTEN_HOST=127.0.0.2"]) == {
        "STRATA_AGENT_METRICS_HOST": "0.0.0.0",
        "STRATA_AGENT_LISTEN_HOST": "127.0.0.2",
    }
    assert agent_env(["STRATA_AGENT_METRICS_PORT=0"]) == {"STRATA_AGENT_METRICS_PORT": "0"}
    with pytest.raises(SystemExit, match="no setting STRATA_AGENT_NO_SUCH_THING"):
        agent_env(["no.such.thing=1"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        agent_env(["metrics.host"])


def test_command_leaves_out_what_the_target_adds() -> None:
    assert command(["--write-docs", "--note", "on main"]) == "make bench-partitions"
    assert (
        command(["--quick", "--agent-setting", "wal.mode=on"])
        == 'make bench-partitions BENCH_ARGS="--quick --agent-setting wal.mode=on"'
    )
