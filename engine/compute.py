"""One thread runs every tensor computation of the process: the CPU's "device queue".

Why: torch on CPU parallelises each op with an OpenMP team owned by the calling thread.
Every thread that runs ops keeps a team alive, and once teams hold more threads than there
are cores, OpenMP stops spinning between ops and every op pays a wake-up: with two teams
(main thread + engine thread) on a small CPU a batch-1 decode step takes 1.6-1.9x as long
as from a single team. So model loading, engine steps and local-side steps all run here,
one at a time, which is also how one real device serialises its work.

A call is handed over through a queue and one lock, not concurrent.futures: every engine
step is handed over and back, and right after a forward pass, which streamed the weights
through every cache, each line of Python on that path runs from memory, so the fewer the
better (a future's submit and result run several times as many; `scripts/step_anatomy.py`
times the trip).
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")
_NAME = "batchlens-compute"


class _Call:
    """One call handed to the compute thread; `done` is released when it has run."""

    __slots__ = ("fn", "args", "kwargs", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None


_calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start = threading.Lock()


def _serve() -> None:
    while (call := _calls.get()) is not None:
        try:
            call.result = call.fn(*call.args, **call.kwargs)
        except BaseException as exc:  # the caller raises it
            call.error = exc
        call.done.release()
        del call  # its result is the caller's now: hold no reference while waiting


def _started() -> None:
    """Start the compute thread on first use. A daemon, so that the interpreter's exit does
    not wait on its queue; at exit it finishes the call it is running, then stops."""
    global _thread
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name=_NAME, daemon=True)
            _thread.start()
            atexit.register(_stop, _thread)


def _stop(thread: threading.Thread) -> None:
    _calls.put(None)
    thread.join()


def on_compute_thread() -> bool:
    return threading.current_thread().name.startswith(_NAME)


def run(fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
    """Run `fn` on the compute thread and wait for its result (re-entrant); what it
    raises is raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    if _thread is None:
        _started()
    call = _Call(fn, args, kwargs)
    _calls.put(call)
    call.done.acquire()
    if call.error is not None:
        error, call.error = call.error, None  # no cycle through the traceback's frames
        raise error
    return call.result
