"""How a race or a sweep ends, with fake serving sides (no model): Stop without spinning,
a closed tab within a second, an engine replaced under a job in plain words, both sides'
prompt limits checked at once, counts with their plural."""

from __future__ import annotations

import threading
import time

import pytest
from polling import wait_for

from engine import RequestHandle, RequestMetrics, RequestOutput, SamplingParams, ServingStats
from workloads.job import DISCONNECT_GRACE_S
from workloads.race import Race
from workloads.sides import count, prompts_for_sides
from workloads.sweep import Sweep, SweepPlan

PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to three."]
CHANGED = "The admin changed the engine settings; this race was stopped."


class FakeSide:
    """Stand-in serving side (tests only): requests run until cancelled (`cancel_delay_s`
    later, as an engine finishing its current step), or end at once as "cancelled" by the
    side itself (`self_cancel`, a shared engine shut down under the race). Counts its
    `stats` calls."""

    def __init__(self, cancel_delay_s: float = 0.0, self_cancel: bool = False,
                 stopped: str | None = None, limit: int | None = None) -> None:
        self.cancel_delay_s, self.self_cancel = cancel_delay_s, self_cancel
        self.stopped, self.limit = stopped, limit
        self.handles: dict[str, RequestHandle] = {}
        self.stats_calls = 0

    def check(self, prompt, params):
        if self.limit is not None and len(prompt) >= self.limit:
            raise ValueError(f"prompt: {len(prompt)} tokens does not fit the context window "
                             f"of {self.limit} tokens (allowed: 1 to {self.limit - 1} tokens)")
        return None

    def submit_many(self, prompts, params, request_ids=None):
        if self.stopped:
            raise RuntimeError(f"FakeSide is {self.stopped}")
        out = []
        for rid in request_ids:
            h = self.handles[rid] = RequestHandle(rid, [], self.cancel)
            out.append(h)
            if self.self_cancel:
                self._end(rid)
        return out

    def submit(self, prompt, params=None, request_id=None):
        return self.submit_many([prompt], [params], [request_id])[0]

    def cancel(self, request_id):
        threading.Timer(self.cancel_delay_s, self._end, (request_id,)).start()

    def _end(self, rid):
        h = self.handles[rid]
        if not h.done:
            h._finish(RequestOutput(rid, [], [], "", "cancelled",
                                    RequestMetrics(time.monotonic())))

    def stats(self, steps_after=None):
        self.stats_calls += 1
        running = sum(not h.done for h in self.handles.values())
        return ServingStats("fake", "cpu", "float32", "", running, 0, (), (), 0, 0, 0, 0, 0,
                            stopped=self.stopped)

    def shutdown(self):
        pass


def params() -> SamplingParams:
    return SamplingParams(max_tokens=8)


def test_stop_waits_for_the_cancels_without_spinning():
    """After Stop the race polls its side at its interval, not in a busy loop: a loop that
    spins takes the engine's lock and the GIL the step needs to free the blocks."""
    dc, local = FakeSide(cancel_delay_s=0.5), FakeSide()
    race = Race(dc, local, PROMPTS, params(), heartbeat_timeout=None, interval=0.1).start()
    wait_for(lambda: len(dc.handles) == 3, 5)
    race.stop()
    assert race.wait_cancelled(timeout=5)  # the fake ends its requests 0.5 s after cancel
    assert race.join(timeout=5)
    assert race.snapshot().phase == "stopped"
    assert dc.stats_calls < 30, dc.stats_calls  # ~0.5 s at 0.1 s, not thousands of calls


def test_a_headless_follow_prints_progress_and_a_ctrl_c_stops_the_race():
    """`follow` (the race and sweep commands' wait) prints its line while the race runs;
    Ctrl-C during the wait (raised here from the third progress line, in the waiting
    thread, where a terminal's Ctrl-C lands: a pytest-xdist worker ignores a simulated
    SIGINT) stops it, and the race reads "stopped" with its requests cancelled."""
    dc, local = FakeSide(), FakeSide()
    race = Race(dc, local, PROMPTS, params(), heartbeat_timeout=None, interval=0.05).start()
    lines: list[str] = []

    def progress() -> str:
        lines.append("progress")
        if len(lines) == 3:
            raise KeyboardInterrupt
        return "progress"

    race.follow(progress, 0.1)
    assert race.finished and race.snapshot().phase == "stopped"
    assert len(lines) == 3 and all(h.done for h in dc.handles.values())


def test_a_closed_tab_abandons_the_race_without_waiting_for_the_heartbeat():
    dc, local = FakeSide(), FakeSide()
    connected = threading.Event()
    connected.set()
    race = Race(dc, local, PROMPTS, params(), heartbeat_timeout=60.0, interval=0.05,
                connected=connected.is_set).start()
    wait_for(lambda: len(dc.handles) == 3, 5)
    time.sleep(2 * DISCONNECT_GRACE_S)
    assert not race.finished  # connected: untouched, but its tab is open
    connected.clear()  # the tab closes; the heartbeat (60 s) would wait a minute
    assert race.join(timeout=30)  # well before the heartbeat could have ended it
    assert race.snapshot().phase == "abandoned"
    assert all(h.done for h in dc.handles.values())


def test_a_reconnect_within_the_grace_keeps_the_race():
    dc, local = FakeSide(), FakeSide()
    connected = threading.Event()
    connected.set()
    race = Race(dc, local, PROMPTS, params(), heartbeat_timeout=60.0, interval=0.05,
                connected=connected.is_set).start()
    wait_for(lambda: len(dc.handles) == 3, 5)
    for _ in range(2):  # short blips, each shorter than the grace
        connected.clear()
        time.sleep(DISCONNECT_GRACE_S / 4)
        connected.set()
        time.sleep(0.15)
    assert not race.finished
    race.stop()
    assert race.join(timeout=5)
    assert race.snapshot().phase == "stopped"


def test_requests_cancelled_by_the_engine_itself_read_as_an_admin_change():
    race = Race(FakeSide(self_cancel=True), FakeSide(), PROMPTS, params(),
                heartbeat_timeout=None).start()
    assert race.join(timeout=10)
    snap = race.snapshot()
    assert snap.phase == "error" and snap.error == CHANGED
    assert not snap.sides["local"].started  # nothing more runs on a replaced engine


def test_an_engine_shut_down_before_the_race_began_reads_as_an_admin_change():
    race = Race(FakeSide(stopped="shut down"), FakeSide(), PROMPTS, params(),
                heartbeat_timeout=None).start()
    assert race.join(timeout=10)
    assert race.snapshot().error == CHANGED


def test_a_sweep_on_a_replaced_engine_says_so_in_plain_words():
    sweep = Sweep(FakeSide(self_cancel=True), FakeSide(), PROMPTS,
                  SweepPlan(levels=(1, 2), max_tokens=2)).start()
    assert sweep.join(timeout=10)
    snap = sweep.snapshot()
    assert snap.error == "The admin changed the engine settings; this sweep was stopped."
    assert "Error" not in snap.error


def test_a_stopped_sweep_does_not_spin_while_its_requests_end():
    dc = FakeSide(cancel_delay_s=0.5)
    sweep = Sweep(dc, FakeSide(), PROMPTS, SweepPlan(levels=(3,), max_tokens=2),
                  interval=0.1).start()
    wait_for(lambda: len(dc.handles) == 3, 5)
    calls = dc.stats_calls
    sweep.stop()
    assert sweep.join(timeout=5)
    assert sweep.snapshot().phase == "stopped"
    assert dc.stats_calls - calls < 30, dc.stats_calls - calls


def test_the_prompt_check_names_the_smaller_limit_of_both_sides():
    """A prompt too long for both sides is refused with the smaller limit, whichever side
    is checked first, so a prompt shortened to the range given fits both."""
    long = "x" * 3000
    for order in (("datacenter", "local"), ("local", "datacenter")):
        sides = {"datacenter": FakeSide(limit=8192), "local": FakeSide(limit=2048)}
        with pytest.raises(ValueError, match=r"local PC: .* of 2048 tokens"):
            prompts_for_sides({k: sides[k] for k in order}, [long], params())
    fits_one = "x" * 4000  # too long for the local PC only: that limit is named
    with pytest.raises(ValueError, match="2048"):
        prompts_for_sides({"datacenter": FakeSide(limit=8192), "local": FakeSide(limit=2048)},
                          [fits_one], params())
    out = prompts_for_sides({"datacenter": FakeSide(limit=8192),
                             "local": FakeSide(limit=2048)}, ["short"], params())
    assert out == {"datacenter": ["short"], "local": ["short"]}


@pytest.mark.parametrize("n, noun, text", [
    (0, "user", "0 users"), (1, "user", "1 user"), (2, "user", "2 users"),
    (1_000, "token", "1,000 tokens"), (1, "point", "1 point"),
])
def test_counts_carry_the_right_plural(n, noun, text):
    assert count(n, noun) == text
