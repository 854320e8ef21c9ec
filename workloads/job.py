"""The skeleton shared by the page's background workloads (a race, a sweep, a KV scenario):
a daemon thread, a stop event, a heartbeat from the page, start/finish times, and how a
run ends (an error goes into the job, the final phase, what the job owns shut down)::

    job = Race(...).start()   thread: _work() -> [error] -> owned sides shut down -> phase
    page: job.touch() · job.shown() · job.stop() · job.finished · job.error · job.close()

A job is abandoned (cancels its requests) when the page's `connected` check (if given)
has been false for `DISCONNECT_GRACE_S` (a closed tab: its blocks are free a step later,
well within 2 s), or when the page has not touched it for `heartbeat_timeout` seconds and
is not known to be connected. A connected tab whose refreshes are merely late (a busy
viewer's machine) keeps its job.

A failure meant for the page's reader is a `WorkloadError`, shown as it is; any other
exception is shown with its type. A shared engine the admin replaced while the job ran
ends it with `engine_changed`'s plain sentence.

Subclasses set up their own state, implement `_work` (the run itself) and `_live_handles`
(the requests `stop` cancels); `_on_finish` clears their own state at the end.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from engine.outputs import RequestHandle

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the package allows 3.10
    from typing import Self

CANCEL_GRACE_S = 30.0  # a stopped job whose requests have not ended by then fails
DISCONNECT_GRACE_S = 0.5  # a tab whose websocket has been gone this long was closed


class WorkloadError(RuntimeError):
    """A failure worded for the page's reader: shown as it is, without a type name."""


ENGINE_CHANGED = "The admin changed the engine settings"


def engine_changed(kind: str) -> WorkloadError:
    """What a job says when the shared engine it ran on was replaced under it."""
    return WorkloadError(f"{ENGINE_CHANGED}; this {kind} was stopped.")


class Closable(Protocol):
    """Something a job shuts down when it ends (a serving side it built for itself)."""

    def shutdown(self) -> None: ...


class BackgroundJob:
    """A workload on its own thread that cancels itself once the page stops touching it.

    `kind` starts the job's id (and so the id of every request it submits); `owned` are
    shut down when the run ends, however it ends (or by `close` if it never started)."""

    def __init__(self, kind: str, heartbeat_timeout: float | None = None,
                 connected: Callable[[], bool] | None = None,
                 owned: Iterable[Closable] = ()) -> None:
        self.job_id = f"{kind}-{uuid.uuid4().hex[:8]}"
        self.heartbeat_timeout, self.connected = heartbeat_timeout, connected
        self._owned = tuple(owned)
        self._phase = "waiting"
        self._error: str | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t_start: float | None = None
        self._t_done: float | None = None
        self._last_touch = time.monotonic()
        self._shown = threading.Event()
        self._disconnected_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"batchlens-{self.job_id}",
                                        daemon=True)

    def _work(self) -> None:
        raise NotImplementedError

    def _on_finish(self) -> None:
        """Clear the subclass's in-flight state (called under `_lock` when the run ends)."""

    def _live_handles(self) -> list[RequestHandle]:
        """The requests submitted so far (called under `_lock`)."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self._work()
        except WorkloadError as exc:
            self._error = str(exc)
            self.stop()
        except Exception as exc:  # surface in the job; never kill the page
            self._error = f"{type(exc).__name__}: {exc}"
            self.stop()
        finally:
            self._end()

    def _end(self) -> None:
        for side in self._owned:
            side.shutdown()
        with self._lock:
            self._phase = ("error" if self._error else "abandoned" if self._abandoned
                           else "stopped" if self._stop.is_set() else "done")
            self._on_finish()
            self._t_done = time.monotonic()

    # ---- public API ------------------------------------------------------------------
    def start(self) -> Self:
        self._t_start = self._last_touch = time.monotonic()
        self._thread.start()
        return self

    def touch(self) -> None:
        """Heartbeat from the page; a job left untouched cancels itself."""
        self._last_touch = time.monotonic()

    def shown(self) -> None:
        """The page has drawn the job's live view (called after each redraw)."""
        self._shown.set()

    def _wait_shown(self, timeout: float) -> None:
        """Wait until the page has drawn the job once (`shown`), until stopped, or at most
        `timeout` seconds (a page that never draws it must not hold the job back)."""
        end = time.monotonic() + timeout
        while not self._shown.is_set() and not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._shown.wait(min(left, 0.05))

    def stop(self) -> None:
        """Cancel every request submitted so far (queued ones too); blocks are freed."""
        self._stop.set()
        with self._lock:
            handles = self._live_handles()
        for h in handles:
            h.cancel()

    def wait_cancelled(self, timeout: float) -> bool:
        """After `stop`: wait up to `timeout` s until every request submitted so far has
        ended (an engine's blocks are free by then); True if they all did."""
        end = time.monotonic() + timeout
        with self._lock:
            handles = self._live_handles()
        for h in handles:
            try:
                h.result(timeout=max(end - time.monotonic(), 0.0))
            except TimeoutError:
                return False
        return True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the end; True once the thread is gone (or was never started)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float = 60.0) -> bool:
        """Stop (if still running) and wait until what the job owns is shut down."""
        self.stop()
        if self._thread.ident is None:  # never started: only what it owns to release
            if not self.finished:
                self._end()
            return True
        return self.join(timeout)

    def follow(self, progress: Callable[[], str], every_s: float) -> None:
        """A headless run's wait: print `progress()` every `every_s` seconds until the job
        ends; Ctrl-C stops it and waits until what it holds is freed. The job is polled,
        not joined: a Ctrl-C inside `Thread.join` can leave the thread looking ended."""
        try:
            shown = time.monotonic()
            while not self.finished:
                time.sleep(0.1)
                if time.monotonic() - shown >= every_s:
                    print(progress(), flush=True)
                    shown = time.monotonic()
        except KeyboardInterrupt:
            self.close()

    @property
    def finished(self) -> bool:
        """The run ended (done, stopped, abandoned or failed) and what it owns is shut down."""
        return self._t_done is not None

    @property
    def error(self) -> str | None:
        """Why the run failed, or None."""
        return self._error

    def _heartbeat_expired(self) -> bool:
        """Its tab gone for `DISCONNECT_GRACE_S`, or untouched for `heartbeat_timeout`
        seconds and not known to be connected."""
        now = time.monotonic()
        if self.connected is not None:
            if self.connected():
                self._disconnected_since = None
            else:
                self._disconnected_since = self._disconnected_since or now
                if now - self._disconnected_since >= DISCONNECT_GRACE_S:
                    return True
        limit = self.heartbeat_timeout
        if limit is None or now - self._last_touch <= limit:
            return False
        return self.connected is None or not self.connected()
