"""Stalls are visible in production: the agent's event-loop lag and GC pauses on ``/metrics``.

The stall is a real one: the agent process is stopped (SIGSTOP) for a second and continued, as
a long GC pause, a blocking call on the loop or a starved CPU would hold it.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.harness import ProcessGroup, ZooKeeperChroot, metric_value, scrape_metrics

pytestmark = pytest.mark.slow

LAG = "strata_event_loop_lag_seconds"


def _over(text: str, bound: str) -> float:
    """Samples of the loop-lag histogram above ``bound`` seconds."""
    found = re.search(rf'^{LAG}_bucket\{{le="{bound}"\}} (\S+)$', text, re.M)
    assert found, f"no {bound} bucket in the {LAG} histogram"
    return metric_value(text, f"{LAG}_count") - float(found.group(1))


def test_a_stopped_event_loop_shows_in_the_lag_histogram_and_the_log(
    processes: ProcessGroup, zk_chroot: ZooKeeperChroot, tmp_path: Path
) -> None:
    cluster = Cluster(processes, zk_chroot, tmp_path / "data")
    (agent,) = cluster.start(1)
    deadline = time.monotonic() + 30
    while metric_value(scrape_metrics(agent.metrics_url), f"{LAG}_count") < 5:
        assert time.monotonic() < deadline, "the loop-lag probe records nothing"
        time.sleep(0.1)
    text = scrape_metrics(agent.metrics_url)
    before = _over(text, "0.5")
    assert metric_value(text, "strata_gc_pause_seconds_count") > 0, "no GC pause timed"

    processes.kill(agent.process.pid, signal.SIGSTOP)
    time.sleep(1.0)  # the fault itself: the whole process stopped for a second
    processes.kill(agent.process.pid, signal.SIGCONT)

    deadline = time.monotonic() + 30
    while _over(scrape_metrics(agent.metrics_url), "0.5") < before + 1:
        assert time.monotonic() < deadline, "the stall never reached the histogram"
        time.sleep(0.1)
    assert re.search(r"event loop stalled for \d+ ms", agent.process.log_text())
