"""The autoscaler on a demand step and on steady demand (fake step cost: one replica
makes ~1,200 tokens/s at full batch)."""

from __future__ import annotations

import pytest
from fleet_fakes import fake_layout

from engine.metrics import percentile
from fleet.autoscaler import AutoscalerConfig
from fleet.sim import FleetConfig, simulate
from fleet.trace import LengthMix, steady, step_up

MIX = LengthMix(prompt=(50, 300), output=(20, 200))
STEP_AT = 300.0


def scaler(**kw: float) -> AutoscalerConfig:
    args = dict(metric="queue", target=2.0, min_replicas=1, max_replicas=8, interval_s=5.0,
                cooldown_s=120.0, storage_gbs=2.0, start_s=30.0)
    args.update(kw)
    return AutoscalerConfig(**args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def stepped():
    lay = fake_layout()
    trace = step_up(700.0, 3.0, STEP_AT, 900.0, MIX, seed=8)
    cfg = FleetConfig(lay, replicas=1, autoscaler=scaler(), sample_s=1.0)
    return simulate(trace, cfg), cfg.autoscaler.cold_start_s(lay)


def test_a_demand_step_adds_replicas_after_the_cold_start_and_not_before(stepped) -> None:
    res, cold = stepped
    assert cold == pytest.approx(4e9 / 2e9 + 30.0)
    adds = [(t, d) for t, d in res.scale_events if d > 0]
    assert adds and adds[0][0] >= STEP_AT, "nothing is added before demand rises"
    first_ready = adds[0][0] + cold
    assert all(s.ready == 1 for s in res.samples if s.t < first_ready)
    assert any(s.starting > 0 for s in res.samples if adds[0][0] <= s.t < first_ready)
    assert max(s.ready for s in res.samples if s.t >= first_ready) >= 2
    for r in res.replicas[1:]:
        assert all(q.first_scheduled >= r.ready_at for q in r.finished)


def test_ttft_p99_recovers_once_the_replicas_are_ready(stepped) -> None:
    res, cold = stepped
    first_ready = min(t for t, d in res.scale_events if d > 0) + cold

    def p99(lo: float, hi: float) -> float:
        return percentile([r.ttft for r in res.finished if lo <= r.arrival < hi], 99)

    before, during, after = p99(60, STEP_AT), p99(STEP_AT, first_ready), p99(
        first_ready + 120, 900)
    assert during > 3 * before, "the step hurts while the new replicas start"
    assert after < during / 3
    assert after < 3 * before + 0.5


def test_no_flapping_on_a_steady_trace() -> None:
    """Steady demand one replica can serve, from three replicas: only removals, each
    after the cool-down, and never an add once removals began."""
    lay = fake_layout()
    trace = steady(600.0, 1200.0, MIX, seed=9)
    res = simulate(trace, FleetConfig(lay, replicas=3, autoscaler=scaler(), sample_s=5.0))
    signs = [d > 0 for _, d in res.scale_events]
    assert signs and not any(signs), f"removals only, got {res.scale_events}"
    times = [t for t, _ in res.scale_events]
    assert times[0] >= 120.0 and all(b - a >= 120.0 for a, b in zip(times, times[1:],
                                                                      strict=False))
    assert len(res.finished) == len(trace.requests)


def test_a_bad_setting_names_the_field() -> None:
    with pytest.raises(ValueError, match="metric"):
        AutoscalerConfig(metric="cpu")
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="KV usage"):
        AutoscalerConfig(metric="kv", target=80)
