"""The sweep: one point per side and load, every point in the rows, stop, heartbeat and
Poisson arrivals."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from polling import wait_for

from engine import Engine
from engine.local import LocalPC
from workloads.prompts import varied_prompts
from workloads.sweep import Sweep, SweepPlan, SweepSnapshot, format_table, progress_line, rows

PROMPTS = varied_prompts()[:3]


def assert_idle(engine: Engine, local: LocalPC) -> None:
    """Nothing running or queued on either side, and no KV block leaked."""
    wait_for(lambda: engine.stats().num_running + engine.stats().num_waiting == 0, 10)
    wait_for(lambda: local.stats().num_running + local.stats().num_waiting == 0, 30)
    kv = engine.stats().kv
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == kv.num_blocks


# ---- pure helpers ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="sweep"), "mode"),
    (dict(levels=()), "levels"),
    (dict(levels=(0, 2)), "users"),
    (dict(levels=(1.5,)), "users"),
    (dict(mode="rate", levels=(-1.0,)), "rate"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(duration_s=0), "duration_s"),
    (dict(order=("local", "local")), "order"),
])
def test_a_bad_plan_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SweepPlan(**kwargs)


def test_levels_run_in_increasing_order_once_each():
    assert SweepPlan(levels=(8, 1, 4, 1)).levels == (1, 4, 8)


def test_users_mode_is_a_burst_and_rate_mode_seeded_poisson():
    assert SweepPlan().arrivals(4) == [0.0] * 4
    plan = SweepPlan("rate", (10.0,), duration_s=100.0)
    times = plan.arrivals(10.0)
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 100.0
    assert times == SweepPlan("rate", (10.0,), duration_s=100.0).arrivals(10.0)
    assert times != SweepPlan("rate", (10.0,), duration_s=100.0, seed=1).arrivals(10.0)
    assert 800 < len(times) < 1200  # 10 requests/s for 100 s
    assert plan.num_requests == len(times)


# ---- with the real model -----------------------------------------------------------------
@pytest.mark.model
def test_a_tiny_sweep_has_one_point_per_side_and_load(engine, local):
    plan = SweepPlan(levels=(1, 3), max_tokens=3)
    sweep = Sweep(engine, local, PROMPTS, plan).start()
    assert sweep.join(timeout=120)
    snap = sweep.snapshot()
    assert snap.phase == "done" and snap.error is None and snap.progress == 1.0
    assert [(p.level, p.side) for p in snap.points] == [
        (1, "datacenter"), (1, "local"), (3, "datacenter"), (3, "local")]
    for p in snap.points:
        assert p.requests == p.completed == p.level
        assert p.summary.output_tokens == 3 * p.level
        assert p.summary.throughput > 0 and p.summary.ttft_p50 > 0
    assert {p.mean_batch for p in snap.points if p.side == "local"} == {1.0}
    table = rows(snap.points, plan, ttft_slo=1e9, tpot_slo=1e9)
    csv = pd.read_csv(io.StringIO(pd.DataFrame(table).to_csv(index=False)))
    assert len(csv) == 4 and list(csv["users"]) == [1, 1, 3, 3]
    # with SLOs nobody can miss, goodput is every request over the wall time
    assert list(csv["goodput_rps"]) == pytest.approx(
        [p.requests / p.summary.wall_time for p in snap.points])
    assert all(f"{p.side:<11}{p.level:>6g}" in format_table(snap.points, plan)
               for p in snap.points)
    assert_idle(engine, local)


@pytest.mark.model
def test_rate_mode_sends_the_same_seeded_arrivals_to_both_sides(engine, local):
    plan = SweepPlan("rate", (4.0,), max_tokens=2, duration_s=0.5)
    sweep = Sweep(engine, local, PROMPTS, plan).start()
    assert sweep.join(timeout=120)
    points = sweep.snapshot().points
    assert [p.side for p in points] == ["datacenter", "local"]
    assert {p.requests for p in points} == {len(plan.arrivals(4.0))}
    assert list(pd.DataFrame(rows(points, plan))["rate_rps"]) == [4.0, 4.0]
    assert_idle(engine, local)


@pytest.mark.model
def test_stop_keeps_the_finished_points_and_frees_everything(engine, local):
    plan = SweepPlan(levels=(1, 4), max_tokens=16)
    sweep = Sweep(engine, local, PROMPTS, plan, interval=0.02).start()
    wait_for(lambda: len(sweep.snapshot().points) >= 1)
    sweep.stop()
    assert sweep.join(timeout=60)
    snap = sweep.snapshot()
    assert snap.phase == "stopped" and snap.finished
    assert 1 <= len(snap.points) < 4
    assert all(p.completed == p.requests for p in snap.points)  # no partial point kept
    assert_idle(engine, local)


@pytest.mark.model
def test_an_untouched_sweep_cancels_itself(engine, local):
    sweep = Sweep(engine, local, PROMPTS, SweepPlan(levels=(2,), max_tokens=400),
                  heartbeat_timeout=0.3).start()
    assert sweep.join(timeout=60)
    assert sweep.snapshot().phase == "abandoned" and not sweep.snapshot().points
    assert_idle(engine, local)


@pytest.mark.model
def test_a_request_that_does_not_fit_is_refused_before_anything_runs(engine, local):
    before = engine.stats().num_finished
    with pytest.raises(ValueError, match="max_tokens: 500 plus a"):
        Sweep(engine, local, PROMPTS, SweepPlan(levels=(1,), max_tokens=500))
    assert engine.stats().num_finished == before


@pytest.mark.model
def test_a_page_sweep_starts_once_the_page_has_drawn_it(engine, local):
    before = engine.stats().num_finished
    plan = SweepPlan(levels=(1,), max_tokens=2)
    sweep = Sweep(engine, local, PROMPTS, plan, page_wait_s=60.0, interval=0.02).start()
    try:
        # not drawn yet: nothing is sent (checked over a few of the sweep's intervals)
        for _ in range(10):
            assert sweep.snapshot().phase == "waiting" and not sweep.snapshot().points
            assert engine.stats().num_finished == before and sweep.join(timeout=0.02) is False
        sweep.shown()
        assert sweep.join(timeout=120)
        assert [p.side for p in sweep.snapshot().points] == ["datacenter", "local"]
    finally:
        sweep.stop()
    assert_idle(engine, local)


@pytest.mark.model
def test_a_page_that_never_draws_the_sweep_only_delays_it(engine, local):
    sweep = Sweep(engine, local, PROMPTS, SweepPlan(levels=(1,), max_tokens=2),
                  page_wait_s=0.2).start()
    assert sweep.join(timeout=120)
    assert sweep.snapshot().phase == "done" and len(sweep.snapshot().points) == 2
    assert_idle(engine, local)


def test_the_commands_progress_line_names_the_point_being_measured():
    snap = SweepSnapshot("running", 12.0, 0.25, ("local", 16), (), False, None)
    assert progress_line(snap) == "  12.0 s   25% of the requests done, local PC at 16"
