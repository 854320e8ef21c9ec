"""Named set-ups: the presenter's scenario, the speed benchmark's service, and the layout
choices the page and the command offer. A scenario is seeded, so it gives the same
figures every run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.autoscaler import AutoscalerConfig
from fleet.layouts import Layout, builtin_layouts
from fleet.local_pcs import busy_at_peak, local_fleet
from fleet.projection import offered_layouts, projected_layout
from fleet.report import series, summary
from fleet.sim import FleetConfig, Progress, simulate
from fleet.trace import (
    DAY_S,
    PRESET_1000,
    DayCurve,
    LengthMix,
    Trace,
    connected_users,
    poisson_day,
    read_csv,
    steady,
)

SPEED_LAYOUT = "Llama-3-8B on 1×H100 (roofline)"
DAY_LAYOUT = ("llama-3.1-70b", "h100_sxm", 8)  # measured kernels (measure.projection)
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
    tokens/s each" on replicas of Llama-3.1-70B on 8×H100 (TP=8, its step times from the
    projection's measured kernels), prefix-aware routing, scaling on queue length with a
    cold start of the weights over a 2 GB/s store."""
    if layout is None:
        from measure import projection

        layout = projected_layout(projection.Layout(DAY_LAYOUT[0], DAY_LAYOUT[1], "trtllm",
                                                    tp=DAY_LAYOUT[2]))
    trace = connected_users(PRESET_1000, duration_s, CHAT_MIX, DAY_CURVE, seed)
    scaler = AutoscalerConfig(metric="queue", target=2.0, min_replicas=1, max_replicas=12,
                              interval_s=30.0, cooldown_s=900.0, storage_gbs=2.0,
                              start_s=60.0)
    config = FleetConfig(layout, replicas=1, router="prefix_aware", autoscaler=scaler,
                         sample_s=60.0, bucket_s=600.0)
    return Scenario("day", "A day of a 1,000-user service", trace, config)


def speed_hour(layout: Layout | None = None, seed: int = 0) -> Scenario:
    """The speed benchmark: an hour of a 4,000 tokens/s service on 8 fixed replicas of
    Llama-3-8B, one H100 each (roofline step times, ~10 ms a step: 3 million steps)."""
    layout = layout or builtin_layouts()[SPEED_LAYOUT]
    trace = steady(4000.0, 3600.0, LengthMix(), seed)
    config = FleetConfig(layout, replicas=8, router="least_outstanding")
    return Scenario("speed", "An hour of 4,000 tokens/s on 8 replicas", trace, config)


SCENARIOS = {"day": day_of_1000_users, "speed": speed_hour}


def layout_choices() -> dict[str, Callable[[], Layout]]:
    """Every layout offered, by name: this machine, the roofline replicas, the projected
    ones (built when picked: a projected layout compiles its handle, about a second)."""
    out: dict[str, Callable[[], Layout]] = {
        name: functools.partial(lambda lay: lay, lay) for name, lay in builtin_layouts().items()}
    for name, lay in offered_layouts().items():
        out[name] = functools.partial(projected_layout, lay)
    return out


TRACES = {"preset": "1,000 connected, 200 active, 20 tokens/s each (a day's curve)",
          "day": "Poisson with a daily curve and a burst", "steady": "steady Poisson",
          "csv": "a CSV (a trace, or the Arena's or the Sweep's export)"}
AUTOSCALE_OFF = "off"


@dataclass(frozen=True)
class FleetParams:
    """Every choice of the page and of `batchlens fleet`, hashable (a cache key)."""

    trace: str = "steady"
    tokens_per_s: float = 4000.0
    hours: float = 1.0
    shared_prompt: bool = False
    seed: int = 0
    csv_text: str | None = None
    layout: str = "this machine"
    router: str = "least_outstanding"
    replicas: int = 1
    autoscale: str = AUTOSCALE_OFF
    target: float = 4.0
    max_replicas: int = 16
    storage_gbs: float = 2.0
    start_s: float = 60.0
    cooldown_s: float = 300.0
    local_device: str = "laptop_cpu"

    def scenario(self) -> Scenario:
        if self.trace not in TRACES:
            raise ValueError(f"trace: one of {list(TRACES)}, got {self.trace!r}")
        if not 0 < self.hours <= 24:
            raise ValueError(f"hours: in (0, 24], got {self.hours!r}")
        choices = layout_choices()
        if self.layout not in choices:
            raise ValueError(f"layout: unknown {self.layout!r} (known: {', '.join(choices)})")
        layout = choices[self.layout]()
        mix = CHAT_MIX if self.shared_prompt else LengthMix()
        duration = self.hours * 3600
        if self.trace == "csv":
            if not self.csv_text:
                raise ValueError("trace: a CSV file is needed for the CSV trace")
            trace = read_csv(self.csv_text)
        elif self.trace == "preset":
            trace = connected_users(PRESET_1000, duration, mix, DAY_CURVE, self.seed)
        elif self.trace == "day":
            trace = poisson_day(self.tokens_per_s, mix, DAY_CURVE, duration, self.seed)
        else:
            trace = steady(self.tokens_per_s, duration, mix, self.seed)
        scaler = None
        if self.autoscale != AUTOSCALE_OFF:
            scaler = AutoscalerConfig(metric=self.autoscale, target=self.target,
                                      min_replicas=1,
                                      max_replicas=max(self.max_replicas, self.replicas),
                                      storage_gbs=self.storage_gbs, start_s=self.start_s,
                                      cooldown_s=self.cooldown_s)
        config = FleetConfig(layout, replicas=self.replicas, router=self.router,
                             autoscaler=scaler, sample_s=max(10.0, duration / 1000),
                             bucket_s=max(60.0, duration / 100))
        return Scenario("custom", trace.name, trace, config)


def run_scenario(scenario: Scenario, local_device: str = "laptop_cpu",
                 progress: Progress | None = None
                 ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Simulate a scenario: its summary (with the same users on their own PCs beside it)
    and its time series."""
    result = simulate(scenario.trace, scenario.config, progress)
    s = summary(result)
    reqs = result.trace.requests
    context = round(sum(r.prompt_tokens + r.output_tokens / 2 for r in reqs)
                    / max(len(reqs), 1)) or 1
    model = scenario.config.layout.model
    if "connected" in scenario.trace.name:
        users = PRESET_1000.connected
    else:
        speed = local_fleet(model, local_device, 1, context).per_user_tokens_per_s
        users = max(busy_at_peak(reqs, speed), 1)
    s["local"] = local_fleet(model, local_device, users, context).as_dict()
    return s, series(result)
