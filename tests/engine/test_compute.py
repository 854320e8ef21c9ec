"""engine.compute: every call runs on the one compute thread, one at a time, re-entrant,
with its result or its exception handed back to the caller."""

from __future__ import annotations

import threading
import time

import pytest

from engine import compute


def test_calls_run_on_one_thread_and_return_their_result() -> None:
    seen = [compute.run(lambda: (threading.get_ident(), compute.on_compute_thread()))
            for _ in range(3)]
    assert len({ident for ident, _ in seen}) == 1
    assert all(on for _, on in seen)
    assert seen[0][0] != threading.get_ident() and not compute.on_compute_thread()
    assert compute.run(lambda a, b=0: a + b, 2, b=3) == 5


def test_a_call_from_the_compute_thread_runs_in_place() -> None:
    def outer() -> tuple[int, int]:
        return threading.get_ident(), compute.run(threading.get_ident)

    ident, inner = compute.run(outer)
    assert ident == inner


def test_an_exception_reaches_the_caller_and_the_thread_keeps_serving() -> None:
    class Boom(Exception):
        pass

    def fail() -> None:
        raise Boom("no")

    with pytest.raises(Boom, match="no"):
        compute.run(fail)
    assert compute.run(lambda: 7) == 7


def test_callers_on_many_threads_are_served_one_at_a_time() -> None:
    running, overlaps, results = [0], [], {}
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            running[0] += 1
            overlaps.append(running[0])
        time.sleep(0.002)  # long enough for another caller's call to start if it could
        with lock:
            running[0] -= 1
        return i * i

    def caller(i: int) -> None:
        results[i] = compute.run(job, i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: i * i for i in range(8)}
    assert max(overlaps) == 1
