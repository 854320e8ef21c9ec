"""The skeleton shared by the page's background workloads (a race, a sweep): a daemon
thread, a stop event, a heartbeat from the page, start/finish times, and how a run ends
(an error goes into the snapshot, the final phase, the local runner closed if owned).

A job is abandoned (cancels its requests) when the page has not touched it for
`heartbeat_timeout` seconds and, if the page gave a `connected` check, its browser session
is gone too. A connected tab whose refreshes are merely late (a busy viewer's machine)
keeps its job; a closed tab loses it within `heartbeat_timeout`.

Subclasses set up their own state, implement `_work` (the run itself) and `_live_handles`
(the requests `stop` cancels); `_on_finish` clears their own state at the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.outputs import RequestHandle

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package allows 3.10
    from typing import Self

    from engine.local import LocalPC


class BackgroundJob:
    """A workload on its own thread that cancels itself once the page stops touching it."""

    def __init__(self, name: str, heartbeat_timeout: float | None, local: LocalPC,
                 close_local: bool, connected: Callable[[], bool] | None = None) -> None:
        self.heartbeat_timeout, self.connected = heartbeat_timeout, connected
        self.local, self.close_local = local, close_local
        self._phase = "waiting"
        self._error: str | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t_start: float | None = None
        self._t_done: float | None = None
        self._last_touch = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _work(self) -> None:
        raise NotImplementedError

    def _on_finish(self) -> None:
        """Clear the subclass's in-flight state (called under `_lock` when the run ends)."""

    def _run(self) -> None:
        try:
            self._work()
        except Exception as exc:  # surface in the snapshot; never kill the page
            self._error = f"{type(exc).__name__}: {exc}"
            self.stop()
        finally:
            if self.close_local:
                self.local.shutdown()
            with self._lock:
                self._phase = ("error" if self._error else "abandoned" if self._abandoned
                               else "stopped" if self._stop.is_set() else "done")
                self._on_finish()
                self._t_done = time.monotonic()

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
        """Untouched for `heartbeat_timeout` seconds, and not known to be connected."""
        limit = self.heartbeat_timeout
        if limit is None or time.monotonic() - self._last_touch <= limit:
            return False
        return self.connected is None or not self.connected()
