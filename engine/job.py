"""The skeleton shared by the page's background workloads (a race, a sweep): a daemon
thread, a stop event, a heartbeat from the page, and start/finish times.

Subclasses set up their own state, implement `_run` (which sets `_t_done` when it ends)
and `_live_handles` (the requests `stop` cancels).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from engine.outputs import RequestHandle

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package allows 3.10
    from typing import Self


class BackgroundJob:
    """A workload on its own thread that cancels itself once the page stops touching it."""

    def __init__(self, name: str, heartbeat_timeout: float | None) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t_start: float | None = None
        self._t_done: float | None = None
        self._last_touch = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def _live_handles(self) -> list[RequestHandle]:
        """The requests submitted so far (called under `_lock`)."""
        raise NotImplementedError

    def start(self) -> Self:
        self._t_start = self._last_touch = time.monotonic()
        self._thread.start()
        return self

    def touch(self) -> None:
        """Heartbeat from the page; a job left untouched cancels itself."""
        self._last_touch = time.monotonic()

    def stop(self) -> None:
        """Cancel every request submitted so far (queued ones too); blocks are freed."""
        self._stop.set()
        with self._lock:
            handles = self._live_handles()
        for h in handles:
            h.cancel()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def finished(self) -> bool:
        return self._t_done is not None

    def _heartbeat_expired(self) -> bool:
        limit = self.heartbeat_timeout
        return limit is not None and time.monotonic() - self._last_touch > limit
