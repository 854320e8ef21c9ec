"""The fleet on one simulated clock: the trace's arrivals go through the router to the
replicas; the autoscaler looks every `interval_s`; the fleet is sampled every `sample_s`.

Replicas step lazily (`fleet.replica`): before each event every replica applies the steps
that end by then, so what the router and autoscaler see is the fleet's state at that
moment. Every request ends finished or counted as dropped (larger than a replica's KV
pool, or turned away by a full queue: `max_queue`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet.autoscaler import Autoscaler, AutoscalerConfig
from fleet.layouts import Layout
from fleet.replica import Replica, SimRequest
from fleet.router import Router
from fleet.trace import Trace, TraceRequest

Progress = Callable[[float], None]


@dataclass(frozen=True)
class FleetConfig:
    """What runs: `replicas` of `layout` at the start, a router, an autoscaler (None: the
    replica count stays fixed), the sampling and bucket widths of the time series."""

    layout: Layout
    replicas: int = 1
    router: str = "least_outstanding"
    autoscaler: AutoscalerConfig | None = None
    sample_s: float = 10.0
    bucket_s: float = 60.0
    max_queue: int | None = None  # per replica; None: no limit

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        a = self.autoscaler
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas: must be within the autoscaler's [{a.min_replicas}, "
                             f"{a.max_replicas}], got {self.replicas}")
        if not (self.sample_s > 0 and self.bucket_s > 0):
            raise ValueError("sample_s, bucket_s: must be > 0 s")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0 or None, got {self.max_queue}")
        Router(self.router)  # validates the policy


@dataclass
class Sample:
    t: float
    ready: int
    starting: int
    waiting: int
    running: int
    kv_usage: float


@dataclass
class FleetResult:
    """Everything a run produced: the requests, the samples, the replicas, the events."""

    trace: Trace
    config: FleetConfig
    requests: list[SimRequest]
    samples: list[Sample]
    replicas: list[Replica]
    scale_events: list[tuple[float, int]]  # (time, +added / -removed)
    end_time: float
    wall_s: float
    cpu_s: float  # this process's CPU time: steadier than wall time on a shared machine
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> list[SimRequest]:
        return [r for r in self.requests if r.finish is not None]

    @property
    def dropped(self) -> list[SimRequest]:
        return [r for r in self.requests if r.dropped is not None]


def synthetic_tokens(req: TraceRequest, rid: int) -> list[int]:
    """Prompt token ids that share exactly `prefix_tokens` with the requests of the same
    `prefix_id` and nothing with any other request (ids below zero name prefixes)."""
    if req.token_ids is not None:
        return list(req.token_ids)
    shared = [-(req.prefix_id + 1)] * req.prefix_tokens if req.prefix_id is not None else []
    return shared + [rid + 1] * (req.prompt_tokens - len(shared))


class Fleet:
    """The replicas and what is added and removed, with the router and the autoscaler."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.router = Router(config.router)
        self.autoscaler = Autoscaler(config.autoscaler) if config.autoscaler else None
        self.replicas: list[Replica] = []
        self.scale_events: list[tuple[float, int]] = []
        for _ in range(config.replicas):
            self._add(0.0, 0.0)

    def _add(self, t: float, ready_at: float) -> None:
        self.replicas.append(Replica(len(self.replicas), self.config.layout, ready_at, t,
                                     self.config.bucket_s))

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.removed_at is None]

    def ready(self, t: float) -> list[Replica]:
        return [r for r in self.replicas if r.is_ready(t)]

    def advance(self, t: float, inclusive: bool = False) -> None:
        for r in self.replicas:
            if r.removed_at is None:
                r.run_until(t, inclusive)
                if r.draining and r.idle:
                    r.removed_at = max(r.clock, r.ready_at)

    def route(self, sreq: SimRequest, t: float) -> None:
        lay, cfg = self.config.layout, self.config
        if sreq.req.prompt_tokens + sreq.req.output_tokens > lay.pool_tokens:
            sreq.dropped = "larger than the KV pool"
            return
        r = self.router.pick(self.ready(t), sreq)
        if cfg.max_queue is not None and len(r.waiting) >= cfg.max_queue:
            sreq.dropped = "queue full"
            return
        r.add(sreq, t)

    def scale(self, t: float) -> None:
        if self.autoscaler is None:
            return
        ready = self.ready(t)
        starting = sum(1 for r in self.replicas if r.removed_at is None and t < r.ready_at)
        delta = self.autoscaler.decide(ready, starting, t)
        if delta > 0:
            cold = self.autoscaler.config.cold_start_s(self.config.layout)
            for _ in range(delta):
                self._add(t, t + cold)
            self.scale_events.append((t, delta))
        elif delta < 0:
            victim = min(ready, key=lambda r: (r.outstanding, -r.index))
            victim.draining = True
            self.scale_events.append((t, -1))

    def sample(self, t: float) -> Sample:
        ready = self.ready(t)
        live = self.live()
        return Sample(t, len(ready), sum(1 for r in live if t < r.ready_at),
                      sum(len(r.waiting) for r in live), sum(len(r.running) for r in live),
                      sum(r.kv_usage for r in ready) / len(ready) if ready else 0.0)


def simulate(trace: Trace, config: FleetConfig, progress: Progress | None = None) -> FleetResult:
    """Run the whole trace and drain the fleet; `progress(share)` is called as it goes,
    with the share of the trace's output tokens made (so a long drain after the last
    arrival still moves it), at most once per percent."""
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    fleet = Fleet(config)
    reqs = [SimRequest(i, r, f"r{i}", synthetic_tokens(r, i))
            for i, r in enumerate(trace.requests)]
    samples: list[Sample] = []
    tick = config.autoscaler.interval_s if config.autoscaler else math.inf
    next_tick, next_sample = tick, 0.0
    i, n = 0, len(reqs)
    total, shown = max(trace.output_tokens, 1), 0.0
    while True:
        busy = any(not r.idle for r in fleet.live())
        t_arr = reqs[i].arrival if i < n else math.inf
        if i >= n and not busy and next_sample > trace.duration_s:
            break
        # after the last arrival nothing interrupts a replica: step to the next end
        t_step = min(r.next_event() for r in fleet.live()) if i >= n and busy else math.inf
        t = min(t_arr, next_tick, next_sample, t_step)
        fleet.advance(t, inclusive=i >= n)
        if t == t_arr:
            fleet.route(reqs[i], t)
            i += 1
        elif t == next_sample:
            samples.append(fleet.sample(t))
            next_sample += config.sample_s
            if progress is not None:
                made = sum(r.stats.output_tokens for r in fleet.replicas) / total
                if made >= shown + 0.01:
                    shown = made
                    progress(min(made, 1.0))
        elif t == next_tick:
            fleet.scale(t)
            next_tick += tick
    end = max([trace.duration_s] + [r.finish for r in reqs if r.finish is not None])
    fleet.advance(end, inclusive=True)
    if progress is not None:
        progress(1.0)
    return FleetResult(trace, config, reqs, samples, fleet.replicas, fleet.scale_events, end,
                       time.perf_counter() - t_wall, time.process_time() - t_cpu)
