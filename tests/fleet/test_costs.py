"""Step costs: the fit to measured steps, step periods, the roofline and the projection
adapter, and the local PCs beside the fleet."""

from __future__ import annotations

import random

import pytest

from engine.core import StepStats
from engine.metrics import RequestMetrics
from fleet.check import step_periods, wake_seconds
from fleet.costs import LinearStepCost, RooflineStepCost, fit_step_cost
from fleet.local_pcs import busy_at_peak, local_fleet
from fleet.scenarios import FleetParams, run_scenario
from fleet.trace import TraceRequest
from measure import hardware
from measure import projection as P


def step(start: float, seqs: int, prompt: int, ctx: int, duration: float) -> StepStats:
    return StepStats(start, duration, seqs, prompt, seqs, 0, 0.5, ctx, ctx)


def test_the_fit_recovers_the_costs_that_made_the_steps() -> None:
    true = LinearStepCost(0.010, 0.0009, 0.0005, 1.5e-6)
    rng = random.Random(0)
    steps = []
    for i in range(300):
        n, p, c = rng.randint(1, 64), rng.choice([0, 0, 0, rng.randint(10, 500)]), \
            rng.randint(100, 20000)
        t = true.step_seconds(n, p, n, c) * rng.uniform(0.97, 1.03)
        steps.append(step(i, n, p, c, t))
    fit = fit_step_cost(steps)
    for name in ("fixed_s", "per_seq_s", "per_prompt_token_s", "per_context_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=0.15), name


def test_a_term_fitted_below_zero_is_dropped() -> None:
    steps = [step(i, n, 0, 1000 * (n % 3), 0.01 + 0.001 * n) for i, n in
             enumerate(range(1, 40))]
    fit = fit_step_cost(steps)
    assert fit.per_context_token_s >= 0 and fit.per_prompt_token_s == 0
    assert fit.per_seq_s == pytest.approx(0.001, rel=0.05)
    with pytest.raises(ValueError, match="at least 4"):
        fit_step_cost(steps[:2])


def test_a_steps_period_holds_the_gap_to_the_next_step() -> None:
    steps = [step(0.0, 1, 0, 10, 0.010), step(0.012, 1, 0, 10, 0.010),
             step(5.0, 1, 0, 10, 0.010)]  # an idle gap before the last
    periods = [s.duration for s in step_periods(steps)]
    assert periods[0] == pytest.approx(0.012)
    assert periods[1] == pytest.approx(0.012)  # idle gap: its duration + the median gap
    assert periods[2] == pytest.approx(0.012)


def test_the_wake_up_runs_from_a_points_last_arrival_before_its_first_step() -> None:
    burst = [RequestMetrics(a, 0.5) for a in (0.0, 0.1, 0.2)]  # all in the step at 0.5
    late = [RequestMetrics(1.0, 1.4), RequestMetrics(1.6, 1.9)]  # the second after the step
    alone = [RequestMetrics(3.0, 3.2)]
    assert wake_seconds([(3, burst), (2, late), (1, alone)]) == pytest.approx(0.3)


def test_the_roofline_cost_is_measure_hardwares() -> None:
    cost = RooflineStepCost("llama-3-8b", "h100", efficiency=0.5, overhead_s=0.001)
    want = hardware.step_cost("llama-3-8b", "fp16", "h100", 32, 32, 512 * 32).seconds
    assert cost.step_seconds(32, 0, 32, 512 * 32) == pytest.approx(want / 0.5 + 0.001)
    with pytest.raises(ValueError, match="efficiency"):
        RooflineStepCost("llama-3-8b", "h100", efficiency=0)


def test_a_projected_layout_takes_the_projections_figures() -> None:
    from fleet.projection import projected_layout

    lay = P.Layout("llama-3.1-8b", "h100_sxm", "trtllm", tp=1)
    fl = projected_layout(lay)
    assert fl.num_blocks == P.kv_capacity_blocks(lay, 16)
    assert fl.weights_bytes == P.weights_bytes(lay)
    assert fl.cost.step_seconds(64, 0, 64, 64 * 512) == pytest.approx(
        P.decode_step_seconds(lay, 64, 512))
    assert fl.cost.step_seconds(1, 1024, 0, 1024) == pytest.approx(
        P.prefill_seconds(lay, 1024, 1))
    with pytest.raises(ValueError, match="layout: "):
        projected_layout(P.Layout("llama-3.1-70b", "h100_sxm", "trtllm", tp=1))


def test_local_pcs_run_at_the_rooflines_batch_one_speed() -> None:
    loc = local_fleet("llama-3-8b", "rtx4090", 1000, 1024)
    want = hardware.decode_tokens_per_s("llama-3-8b", "fp16", "rtx4090", 1, 1024).per_user
    assert loc.pcs == 1000 and loc.per_user_tokens_per_s == pytest.approx(want)
    assert loc.joules_per_token == pytest.approx(450.0 / want)
    with pytest.raises(ValueError, match="device"):
        local_fleet("llama-3-8b", "h100", 10, 100)


def test_pcs_for_a_trace_without_users_are_the_answers_at_once_at_the_peak() -> None:
    """Each request on a PC of its own from its arrival, 10 tokens/s: [0, 2], [1, 2],
    [2, 3] (back to back with the first two: no overlap) and [2.5, 4.5]."""
    reqs = [TraceRequest(0.0, 5, 20), TraceRequest(1.0, 5, 10), TraceRequest(2.0, 5, 10),
            TraceRequest(2.5, 5, 20)]
    assert busy_at_peak(reqs, 10.0) == 2
    assert busy_at_peak(reqs, 1.0) == 4  # slow PCs: every answer still going at 2.5 s
    assert busy_at_peak([], 10.0) == 0
    with pytest.raises(ValueError, match="tokens_per_s"):
        busy_at_peak(reqs, 0.0)


def test_a_fleet_that_falls_behind_needs_no_more_pcs_beside_it() -> None:
    """The PCs beside a run are the users', so a fleet that falls behind (its queue in the
    tens of thousands) leaves them as they were."""
    s, _ = run_scenario(FleetParams(trace="steady", tokens_per_s=20000.0, hours=0.02)
                        .scenario())
    assert s["peak_in_system"] > 20 * s["local"]["pcs"]
    speed = s["local"]["per_user_tokens_per_s"]
    trace = FleetParams(trace="steady", tokens_per_s=20000.0, hours=0.02).scenario().trace
    assert s["local"]["pcs"] == busy_at_peak(trace.requests, speed)
