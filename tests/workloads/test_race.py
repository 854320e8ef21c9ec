"""The race: both sides one after the other, live snapshots, stop, heartbeat, summary."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from polling import wait_for

from engine import (
    Engine,
    RequestHandle,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    ServingStats,
    summarize,
)
from workloads.race import Race, RaceSnapshot, SideView, figures_table, progress_line

PROMPTS = [[{"role": "user", "content": c}] for c in
           ("What is the capital of France?", "Name a colour.", "Count to three.")]


def assert_engine_idle(engine: Engine) -> None:
    wait_for(lambda: engine.stats().num_running + engine.stats().num_waiting == 0, 10)
    stats = engine.stats()
    assert stats.kv.used_blocks == 0 and stats.kv.reserved_slots == 0


@pytest.mark.model
def test_both_sides_run_and_summary_ratio_is_the_throughput_ratio(engine, local):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    race = Race(engine, local, PROMPTS, params, heartbeat_timeout=None).start()
    assert race.join(timeout=120)
    snap = race.snapshot()
    assert snap.finished and snap.phase == "done" and snap.error is None
    dc, loc = race.outputs("datacenter"), race.outputs("local")
    # greedy float32: the same tokens on both sides
    assert [o.token_ids for o in dc] == [o.token_ids for o in loc]
    ratio = summarize(o.metrics for o in dc).throughput / summarize(
        o.metrics for o in loc).throughput
    assert snap.ratio == pytest.approx(ratio)
    for name, outs in (("datacenter", dc), ("local", loc)):
        view = snap.sides[name]
        assert view.finished and view.users_finished == 3 and view.total_tokens == 18
        assert view.your_text == outs[0].text
        assert view.your_ttft == outs[0].metrics.ttft
        assert view.total_tokens_per_s == summarize(o.metrics for o in outs).throughput
        curve = [p for p in snap.tokens if p["side"] == name]
        assert curve[0]["t"] == 0 and curve[-1]["tokens"] == 18
        assert {p["kind"] for p in snap.kv if p["side"] == name} == {"reserved", "used"}
    assert len(snap.rows) == 6 and {r["side"] for r in snap.rows} == {"datacenter", "local"}
    assert max(p["num_seqs"] for p in snap.batch) >= 2
    assert_engine_idle(engine)


@pytest.mark.model
def test_stop_cancels_every_request_and_frees_all_blocks(engine, local):
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    race = Race(engine, local, PROMPTS * 2, params, heartbeat_timeout=None).start()
    wait_for(lambda: race.snapshot().sides["datacenter"].total_tokens > 6)
    assert engine.stats().kv.used_blocks > 0
    race.stop()
    assert race.join(timeout=60)
    snap = race.snapshot()
    assert snap.phase == "stopped" and snap.ratio is None
    assert all(o.finish_reason == "cancelled" for o in race.outputs("datacenter"))
    assert not snap.sides["local"].started
    assert_engine_idle(engine)


@pytest.mark.model
def test_stop_while_queued_on_the_local_pc(engine, local):
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    race = Race(engine, local, PROMPTS, params, you=2, order=("local", "datacenter"),
                heartbeat_timeout=None).start()
    wait_for(lambda: race.snapshot().sides["local"].users_ahead_of_you == 2)
    race.stop()
    assert race.join(timeout=60)
    assert [o.finish_reason for o in race.outputs("local")] == ["cancelled"] * 3
    stats = local.stats()
    assert stats.running_ids == () and stats.num_waiting == 0
    assert not race.snapshot().sides["datacenter"].started


@pytest.mark.model
def test_heartbeat_timeout_cancels_an_abandoned_race(engine, local):
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    race = Race(engine, local, PROMPTS, params, heartbeat_timeout=0.5).start()
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # a page that keeps refreshing keeps the race alive
        race.touch()
        time.sleep(0.1)
    assert not race.finished
    assert race.join(timeout=60)  # then the tab closes: no more touches
    snap = race.snapshot()
    assert snap.phase == "abandoned"
    assert all(o.finish_reason == "cancelled" for o in race.outputs("datacenter"))
    assert_engine_idle(engine)


@pytest.mark.model
def test_a_connected_session_keeps_its_race_through_late_refreshes(engine, local):
    """A busy viewer's browser refreshes late; its race goes on while the session is
    connected, and is abandoned once the session is gone (a closed tab)."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    connected = threading.Event()
    connected.set()
    race = Race(engine, local, PROMPTS, params, heartbeat_timeout=0.2,
                connected=connected.is_set).start()
    time.sleep(1.5)  # no touches for 7 heartbeat timeouts
    assert not race.finished
    assert race.snapshot().phase in ("datacenter", "local")
    connected.clear()  # the tab closes
    assert race.join(timeout=60)
    assert race.snapshot().phase == "abandoned"
    assert_engine_idle(engine)


@pytest.mark.model
@pytest.mark.parametrize("prompt,max_tokens,field", [
    ("word " * 600, 8, "prompt: "),
    ("Hello", 600, "max_tokens: "),
    ("   ", 8, "prompt must not be empty"),
])
def test_bad_input_raises_a_readable_value_error(engine, local, prompt, max_tokens, field):
    with pytest.raises(ValueError, match=field):
        Race(engine, local, [prompt], SamplingParams(max_tokens=max_tokens))


def test_bad_arguments_need_no_model():
    with pytest.raises(ValueError, match="users"):
        Race(None, None, [], SamplingParams())  # type: ignore[arg-type]


def test_the_commands_progress_line_counts_each_started_side():
    running = dataclasses.replace(SideView.idle("datacenter", 16), started=True,
                                  users_finished=3, total_tokens=1234)
    snap = RaceSnapshot("datacenter", 4.25, {"datacenter": running,
                                             "local": SideView.idle("local", 16)},
                        [], [], [], [], False, None, None)
    assert progress_line(snap) == "   4.2 s  datacenter: 3/16 users done, 1,234 tokens"
    idle = dataclasses.replace(snap, sides={"local": SideView.idle("local", 16)})
    assert progress_line(idle).endswith("starting")


def test_the_commands_table_has_each_sides_latency_and_peak_kv():
    def row(side, ttft, tpot, e2e, rate):
        return {"side": side, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
                "tokens_per_s": rate}

    dc = dataclasses.replace(SideView.idle("datacenter", 2), started=True, finished=True,
                             total_tokens=64, total_tokens_per_s=160.0)
    rows = [row("datacenter", 0.1, 0.02, 0.4, 80.0), row("datacenter", 0.3, 0.03, 0.5, 60.0)]
    mib = 2**20
    kv = [{"side": "datacenter", "t": t, "kind": kind, "bytes": b * mib}
          for t, kind, b in ((0.1, "reserved", 2), (0.1, "used", 1), (0.2, "reserved", 4),
                             (0.2, "used", 3))]
    snap = RaceSnapshot("done", 1.0, {"datacenter": dc, "local": SideView.idle("local", 2)},
                        [], kv, [], rows, True, None, None)
    head, rule, line = figures_table(snap).splitlines()  # the local side had not started
    assert head.split() == ["side", "users", "tokens", "tok/s", "tok/s/user", "TTFT", "p50",
                            "TTFT", "max", "TPOT", "p50", "last", "done", "KV", "reserved",
                            "KV", "used"]
    assert set(rule) == {"-"}
    assert line.split() == ["datacenter", "2", "64", "160.0", "70.0", "0.20", "s", "0.30",
                            "s", "25", "ms", "0.50", "s", "4.0", "MiB", "3.0", "MiB"]


class FailingSide:
    """Stand-in serving side (tests only): an endpoint whose every request fails at once."""

    def check(self, prompt, params):
        return None  # like a remote server: it cannot tell before sending

    def submit_many(self, prompts, params, request_ids=None):
        handles = []
        for rid in request_ids:
            h = RequestHandle(rid, [], self.cancel)
            h._finish(RequestOutput(rid, [], [], "", "error", RequestMetrics(time.monotonic()),
                                    error="remote datacenter: unreachable"))
            handles.append(h)
        return handles

    def cancel(self, request_id):
        pass

    def stats(self, steps_after=None):
        return ServingStats("stand-in", "http://127.0.0.1:9/v1", "unknown", "", 0, 0, (), (),
                            0, 0, 0, 0, 0)

    def shutdown(self):
        pass


@pytest.mark.model
def test_a_failing_side_fails_only_its_own_requests(local):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    race = Race(FailingSide(), local, PROMPTS, params, heartbeat_timeout=None).start()
    assert race.join(timeout=120)
    snap = race.snapshot()
    assert snap.phase == "error" and "unreachable" in snap.error
    outs = race.outputs("local")  # the other side still ran to the end
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert snap.sides["local"].finished and not snap.sides["datacenter"].finished
