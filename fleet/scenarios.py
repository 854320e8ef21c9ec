"""Named set-ups: the presenter's scenario, the speed benchmark's service, and the layout
choices the page and the command offer. A scenario is seeded, so it gives the same
figures every run."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.autoscaler import AutoscalerConfig
from fleet.layouts import Layout, builtin_layouts
from fleet.sim import FleetConfig
from fleet.trace import DAY_S, PRESET_1000, DayCurve, LengthMix, Trace, connected_users, steady

DAY_LAYOUT = "Llama-3-70B on 8×H100 TP8 (roofline)"
# a chat mix: a shared 600-token system prompt (one of 4 products) before each question
CHAT_MIX = LengthMix(prompt=(50, 450), output=(100, 700), shared_prefix_tokens=600,
                     num_prefixes=4)
# the afternoon peak gets a burst: a launch announced at 15:00 doubles demand for 20 min
DAY_CURVE = DayCurve(trough=0.15, trough_h=4.0, bursts=((15 * 3600.0, 1200.0, 2.0),))


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    trace: Trace
    config: FleetConfig


def day_of_1000_users(duration_s: float = DAY_S, layout: Layout | None = None,
                      seed: int = 7) -> Scenario:
    """The presenter's scenario: a day of the preset "1,000 connected, 200 active, 20
    tokens/s each" on replicas of Llama-3-70B on an 8×H100 node, prefix-aware routing,
    scaling on queue length with a cold start of the weights over a 2 GB/s store."""
    layout = layout or builtin_layouts()[DAY_LAYOUT]
    trace = connected_users(PRESET_1000, duration_s, CHAT_MIX, DAY_CURVE, seed)
    scaler = AutoscalerConfig(metric="queue", target=2.0, min_replicas=1, max_replicas=12,
                              interval_s=30.0, cooldown_s=900.0, storage_gbs=2.0,
                              start_s=60.0)
    config = FleetConfig(layout, replicas=1, router="prefix_aware", autoscaler=scaler,
                         sample_s=60.0, bucket_s=600.0)
    return Scenario("day", "A day of a 1,000-user service", trace, config)


def speed_hour(layout: Layout | None = None, seed: int = 0) -> Scenario:
    """The speed benchmark: an hour of a 4,000 tokens/s service on 8 fixed replicas of
    this machine."""
    layout = layout or builtin_layouts()["this machine"]
    trace = steady(4000.0, 3600.0, LengthMix(), seed)
    config = FleetConfig(layout, replicas=8, router="least_outstanding")
    return Scenario("speed", "An hour of 4,000 tokens/s on 8 replicas", trace, config)


SCENARIOS = {"day": day_of_1000_users, "speed": speed_hour}
