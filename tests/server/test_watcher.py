"""The server's `HandleWatcher`: coroutines waiting on requests that another thread feeds
are woken by the handles themselves, once per loop however many handles move, and lose
nothing pushed around the moment they start waiting. Handles here are real
`RequestHandle`s fed by a thread, as the engine thread feeds them; no model."""

from __future__ import annotations

import asyncio
import random
import threading

from engine.metrics import RequestMetrics
from engine.outputs import RequestHandle, RequestOutput
from server.routes import HandleWatcher, _Waiting

HANG_GUARD_S = 60.0  # a lost wake-up hangs forever; this only turns a hang into a failure


def handle(rid: str) -> RequestHandle:
    return RequestHandle(rid, [1, 2, 3], lambda _rid: None)


def finish(h: RequestHandle, tokens: int) -> None:
    output = RequestOutput(h.request_id, [1, 2, 3], list(range(tokens)), "", "length",
                           RequestMetrics(0.0))
    h._finish(output)


async def read_all(watcher: HandleWatcher, h: RequestHandle) -> str:
    text = ""
    while True:
        delta, done = await watcher.next_text(h)
        text += delta
        if done:
            return text


def test_many_streams_fed_by_a_thread_get_every_piece_and_the_end():
    handles = [handle(f"r{i}") for i in range(40)]
    watcher = HandleWatcher()
    sent: dict[RequestHandle, str] = dict.fromkeys(handles, "")

    def feed() -> None:  # the engine thread: a token for each live request per "step"
        rng = random.Random(0)
        left = {h: rng.randint(1, 30) for h in handles}
        n = 0
        while left:
            for h in list(left):
                n += 1
                sent[h] += f"{h.request_id}.{n} "
                h._push(f"{h.request_id}.{n} ", n)
                left[h] -= 1
                if not left[h]:
                    finish(h, n)
                    del left[h]
            if n % 7 == 0:  # let the loop run between some steps, not all
                threading.Event().wait(0.001)

    async def main() -> list[str]:
        feeder = threading.Thread(target=feed)
        readers = [asyncio.create_task(read_all(watcher, h)) for h in handles]
        feeder.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*readers), HANG_GUARD_S)
        finally:
            feeder.join()

    texts = asyncio.run(main())
    for h, text in zip(handles, texts, strict=True):
        assert text == sent[h]  # every piece, in order, and nothing else
    assert watcher._waiting == {}  # nothing waits: no loop is kept


def test_a_push_between_the_poll_and_the_wait_wakes_the_waiter():
    """The handle reports to the loop from before its poll, so a push that lands after
    the poll found nothing (and before the coroutine waits) still wakes it."""
    watcher = HandleWatcher()
    h = handle("r")
    real_poll = h.poll
    pushed = threading.Event()

    def poll_then_push() -> str:
        text = real_poll()
        if not pushed.is_set():  # the first poll: empty; the push comes right after it
            pushed.set()
            threading.Thread(target=lambda: h._push("late", 1)).start()
        return text

    h.poll = poll_then_push  # type: ignore[method-assign]

    async def main() -> tuple[str, bool]:
        return await asyncio.wait_for(watcher.next_text(h), HANG_GUARD_S)

    assert asyncio.run(main()) == ("late", False)


def test_wait_done_wakes_at_the_end():
    watcher = HandleWatcher()
    h = handle("r")

    async def main() -> None:
        threading.Timer(0.01, lambda: finish(h, 2)).start()
        await asyncio.wait_for(watcher.wait_done(h), HANG_GUARD_S)

    asyncio.run(main())
    assert h.done


def test_many_pushes_queue_one_wake_up_per_loop_turn():
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop)
        calls = 0
        real = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal calls
            calls += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        pusher = threading.Thread(target=lambda: [waiting.wake() for _ in range(100)])
        pusher.start()
        pusher.join()  # the loop has not run meanwhile: one wake-up covers all 100
        first = calls
        await asyncio.wait_for(waiting.moved.wait(), HANG_GUARD_S)
        waiting.wake()  # after the wake-up ran, the next push queues a new one
        return first, calls

    assert asyncio.run(main()) == (1, 2)


def test_a_wake_up_for_a_closed_loop_is_dropped():
    loop = asyncio.new_event_loop()
    waiting = _Waiting(loop)
    loop.close()
    waiting.wake()  # the engine thread must not fail because a client's loop is gone


def test_an_idle_request_costs_the_loop_no_polls():
    """Between pushes nothing looks at a waiting handle: the loop sleeps until told."""
    watcher = HandleWatcher()
    h = handle("r")
    polls = 0
    real_poll = h.poll

    def counted() -> str:
        nonlocal polls
        polls += 1
        return real_poll()

    h.poll = counted  # type: ignore[method-assign]

    async def main() -> tuple[int, tuple[str, bool]]:
        waiter = asyncio.create_task(watcher.next_text(h))
        for _ in range(20):  # twenty turns of an otherwise idle loop, with time passing
            await asyncio.sleep(0.005)
        idle = polls
        threading.Thread(target=lambda: h._push("x", 1)).start()
        return idle, await asyncio.wait_for(waiter, HANG_GUARD_S)

    idle, got = asyncio.run(main())
    assert idle == 1  # next_text's own look, none after it
    assert got == ("x", False)
