"""`pytest --rss-log DIR`: every test's RSS before and after it, one file per worker.

A line per test, tab-separated: seconds, RSS MiB before, after, the change, the machine's
MemAvailable MiB after, the test's id; in DIR/<worker>.log (`main.log` without
pytest-xdist). Linux only (/proc). What found the cleared shared engine whose pool stayed
alive (docs/benchmarks.md, "The test suite's time").
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--rss-log", metavar="DIR", default=None,
                     help="log every test's RSS (MiB) before and after it into DIR/<worker>.log")


def _mib(path: str, key: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    folder = item.config.getoption("--rss-log")
    if folder is None:
        yield
        return
    before, start = _mib("/proc/self/status", "VmRSS:"), time.monotonic()
    yield
    after = _mib("/proc/self/status", "VmRSS:")
    available = _mib("/proc/meminfo", "MemAvailable:")
    Path(folder).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(folder) / f"{worker}.log", "a") as f:
        f.write(f"{time.monotonic() - start:.1f}\t{before}\t{after}\t{after - before}\t"
                f"{available}\t{item.nodeid}\n")
