"""Waiting in tests: poll a condition until it holds or a timeout fails the test."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 60.0,
             message: str = "timed out", interval: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, message
        time.sleep(interval)
