"""One thread runs every tensor computation of the process: the CPU's "device queue".

Why: torch on CPU parallelises each op with an OpenMP team owned by the calling thread.
Every thread that runs ops keeps a team alive, and once teams hold more threads than there
are cores, OpenMP stops spinning between ops and every op pays a wake-up: with two teams
(main thread + engine thread) on a small CPU a batch-1 decode step takes 1.6-1.9x as long
as from a single team. So model loading, engine steps and local-side steps all run here,
one at a time, which is also how one real device serialises its work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")
_NAME = "batchlens-compute"
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_NAME)


def on_compute_thread() -> bool:
    return threading.current_thread().name.startswith(_NAME)


def run(fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
    """Run `fn` on the compute thread and wait for its result (re-entrant)."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()
