"""CPU load of other processes between two samples, so a timing can say how the cores were
shared (Linux /proc/stat; elsewhere only this process's CPU time is known)."""

from __future__ import annotations

import os
import time

CpuSample = tuple[float, float, float]


def cpu_sample() -> CpuSample:
    """(all CPUs' seconds, their busy seconds, this process's CPU seconds); Linux /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0, 0.0, time.process_time()
    hz = os.sysconf("SC_CLK_TCK")
    return sum(v) / hz, (sum(v) - v[3] - v[4]) / hz, time.process_time()


def others_busy(a: CpuSample, b: CpuSample) -> float:
    """Share of all CPU time between two samples used by other processes."""
    total = b[0] - a[0]
    return max(0.0, (b[1] - a[1] - (b[2] - a[2])) / total) if total > 0 else 0.0
