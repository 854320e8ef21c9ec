"""Conservation and queueing sanity of the whole fleet on a fake step cost."""

from __future__ import annotations

import pytest
from fleet_fakes import fake_layout

from fleet import sim
from fleet.report import behind, format_summary, little, summary
from fleet.sim import FleetConfig, simulate
from fleet.trace import LengthMix, Trace, TraceRequest, steady

MIX = LengthMix(prompt=(50, 300), output=(20, 200))


def test_every_request_finishes_or_is_counted_as_dropped() -> None:
    lay = fake_layout(num_blocks=64)  # 1,024 slots: the longest requests cannot fit
    trace = steady(1500.0, 120.0, LengthMix(prompt=(50, 900), output=(20, 400)), seed=1)
    res = simulate(trace, FleetConfig(lay, replicas=2, max_queue=30))
    done = [r for r in res.requests if r.finish is not None]
    dropped = [r for r in res.requests if r.dropped is not None]
    assert dropped and done, "this trace is meant to have both"
    assert len(done) + len(dropped) == len(trace.requests)
    assert not set(map(id, done)) & set(map(id, dropped))
    s = summary(res)
    assert s["output_tokens"] == sum(r.req.output_tokens for r in done)
    assert {d.dropped for d in dropped} <= {"larger than the KV pool", "queue full"}


def test_littles_law_holds_on_a_steady_trace() -> None:
    """L (requests in the system, sampled every second) = lambda x W within 5%."""
    lay = fake_layout()
    trace = steady(1800.0, 400.0, MIX, seed=2)  # ~75% of two replicas' capacity
    res = simulate(trace, FleetConfig(lay, replicas=2, sample_s=1.0))
    law = little(res, warmup_s=30.0)
    assert law["L"] > 5, "a busy enough system to mean something"
    assert law["L"] == pytest.approx(law["lambda_W"], rel=0.05)


def test_with_demand_below_capacity_the_queue_stays_bounded() -> None:
    lay = fake_layout()
    trace = steady(700.0, 600.0, MIX, seed=4)  # ~60% of one replica's capacity
    res = simulate(trace, FleetConfig(lay, sample_s=5.0))
    halves = [s.waiting for s in res.samples if s.t < 300], [
        s.waiting for s in res.samples if 300 <= s.t <= 600]
    assert max(halves[0]) <= lay.max_num_seqs and max(halves[1]) <= lay.max_num_seqs
    assert sum(halves[1]) / len(halves[1]) <= 2 * sum(halves[0]) / len(halves[0]) + 1
    assert len(res.finished) == len(trace.requests)
    assert behind(summary(res)) is None


def test_above_capacity_the_queue_grows() -> None:
    """The bound above can fail: at twice the capacity the queue keeps growing."""
    lay = fake_layout()
    trace = steady(2400.0, 150.0, MIX, seed=4)
    res = simulate(trace, FleetConfig(lay, sample_s=5.0))
    early = [s.waiting for s in res.samples if 20 <= s.t < 50]
    late = [s.waiting for s in res.samples if 120 <= s.t < 150]
    assert min(late) > 2 * max(early)
    s = summary(res)
    assert s["arrivals_s"] == 150.0 and s["simulated_s"] > 1.1 * 150.0
    at_end = next(x for x in res.samples if x.t == 150.0)
    assert s["waiting_at_arrivals_end"] == at_end.waiting > 0
    note = behind(s)
    assert note is not None and "queued when arrivals stopped, 2.50 min into the run" in note
    assert note in format_summary(s).splitlines()


def test_a_burst_of_requests_at_once_all_finish_in_arrival_order_of_admission() -> None:
    lay = fake_layout(max_num_seqs=4)
    trace = Trace(tuple(TraceRequest(0.0, 40, 10) for _ in range(12)), 1.0)
    res = simulate(trace, FleetConfig(lay))
    starts = [r.first_scheduled for r in res.requests]
    assert starts == sorted(starts), "FCFS"
    assert len({round(s, 9) for s in starts}) == 3  # three waves of four


def test_progress_counts_output_tokens_through_the_drain(monkeypatch) -> None:
    """On a trace the fleet falls behind, most tokens come after the last arrival: the
    progress keeps moving through the drain, in steps of at least a percent."""
    routed, calls = [], []
    real_route = sim.Fleet.route
    monkeypatch.setattr(sim.Fleet, "route",
                        lambda self, req, t: routed.append(t) or real_route(self, req, t))
    trace = steady(2400.0, 150.0, MIX, seed=4)
    simulate(trace, FleetConfig(fake_layout(), sample_s=5.0),
             lambda share: calls.append((share, len(routed))))
    shares = [share for share, _ in calls]
    assert shares[-1] == 1.0 and shares == sorted(shares)
    assert all(b - a >= 0.01 for a, b in zip(shares[:-2], shares[1:-1], strict=True))
    in_drain = [share for share, n in calls if n == len(trace.requests) and share < 1.0]
    assert len(in_drain) >= 10 and in_drain[0] < 0.6
