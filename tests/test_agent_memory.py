"""The agent keeps freed request-sized buffers mapped (``broker_agents.main.keep_freed_memory``):
receiving request after request into fresh 1 MiB buffers must not fault new pages in each
time. Measured in child processes (the setting is per process), against a control without it.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import resource, sys
import numpy as np
from broker_agents.main import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def one_round():  # what a connection with 8 requests in flight allocates and frees
    bufs = [np.empty(1 << 20, dtype=np.uint8) for _ in range(8)]
    for b in bufs:
        b.fill(1)  # every byte written, as a received frame is

one_round()
before = faults()
for _ in range(20):
    one_round()
print(kept, faults() - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_agent_reuses_freed_request_buffers_instead_of_faulting_them_in_again() -> None:
    kept, with_setting = _faults("keep")
    _, control = _faults("plain")
    assert kept == "True"
    pages_per_round = 8 * (1 << 20) // 4096
    # 20 rounds of 8 MiB: the control faults most of them in again (glibc trims the freed heap
    # top); with the setting, at most about one round's pages are new
    assert with_setting < pages_per_round, (with_setting, control)
    assert control > 10 * with_setting, (with_setting, control)
