"""The autoscaler: how many replicas the fleet should have, looked at every `interval_s`.

It scales up when its metric is above target (by more than `tolerance`): to
ceil(ready x metric / target) replicas, as Kubernetes' HPA computes it, at least one more
and at most HPA's default step (double, or four more, whichever is larger).
A replica added is ready only after its cold start, its weights' size / `storage_gbs` plus
`start_s` (process start, CUDA context, graph capture), and counts as provisioned
meanwhile, so a slow start is not answered by adding again and again.

It scales down by one replica when, for a whole `cooldown_s` with no scaling in it, the
load would still fit one replica fewer: the requests in the fleet would fill at most
`down_utilization` of the remaining replicas' slots, and (metric "kv") their KV usage
would stay below target, (metric "ttft_p99") TTFT p99 stayed below half the target. The
replica removed drains: it takes no new requests and goes once its last one finishes.

Metrics: "queue", requests waiting per ready replica; "kv", mean KV usage of the ready
replicas (0-1); "ttft_p99", the TTFT p99 (s) of first tokens in the last `window_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.metrics import percentile
from fleet.layouts import Layout
from fleet.replica import Replica

METRICS = ("queue", "kv", "ttft_p99")


@dataclass(frozen=True)
class AutoscalerConfig:
    metric: str = "queue"
    target: float = 4.0
    min_replicas: int = 1
    max_replicas: int = 16
    interval_s: float = 15.0
    cooldown_s: float = 300.0
    storage_gbs: float = 2.0
    start_s: float = 60.0
    tolerance: float = 0.1
    window_s: float = 60.0
    down_utilization: float = 0.6

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric: one of {METRICS}, got {self.metric!r}")
        if not self.target > 0:
            raise ValueError(f"target: must be > 0, got {self.target!r}")
        if self.metric == "kv" and self.target > 1:
            raise ValueError(f"target: KV usage is a share in (0, 1], got {self.target}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas, max_replicas: need 1 <= min <= max, got "
                             f"{self.min_replicas}, {self.max_replicas}")
        for name in ("interval_s", "storage_gbs", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("cooldown_s", "start_s", "tolerance"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.down_utilization <= 1:
            raise ValueError(f"down_utilization: in (0, 1], got {self.down_utilization!r}")

    def cold_start_s(self, layout: Layout) -> float:
        """Seconds from adding a replica to its first request."""
        return layout.weights_bytes / (self.storage_gbs * 1e9) + self.start_s


class Autoscaler:
    """Decides, tick by tick, how many replicas to add (> 0) or remove (< 0)."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self.last_change = -math.inf
        self._calm_since: float | None = None  # since when scaling down looked safe

    def metric(self, ready: list[Replica], t: float) -> float:
        c = self.config
        if c.metric == "queue":
            return sum(len(r.waiting) for r in ready) / len(ready)
        if c.metric == "kv":
            return sum(r.kv_usage for r in ready) / len(ready)
        recent = []
        for r in ready:
            log = r.first_tokens
            while log and log[0][0] < t - c.window_s:
                log.popleft()
            recent += [ttft for _, ttft in log]
        return percentile(recent, 99) if recent else 0.0

    def decide(self, ready: list[Replica], starting: int, t: float) -> int:
        """Replicas to add (positive) or remove (negative) now."""
        c = self.config
        n = len(ready)
        value = self.metric(ready, t)
        ratio = value / c.target
        provisioned = n + starting
        if ratio > 1 + c.tolerance:
            self._calm_since = None
            desired = min(max(math.ceil(n * ratio), n + 1), max(2 * n, n + 4), c.max_replicas)
            add = desired - provisioned
            if add > 0:
                self.last_change = t
                return add
            return 0
        if starting or n <= c.min_replicas or not self._fits_fewer(ready, value):
            self._calm_since = None
            return 0
        if self._calm_since is None:
            self._calm_since = t
        if t - max(self._calm_since, self.last_change) >= c.cooldown_s:
            self.last_change, self._calm_since = t, None
            return -1
        return 0

    def _fits_fewer(self, ready: list[Replica], value: float) -> bool:
        c, n = self.config, len(ready)
        load = sum(r.outstanding for r in ready)
        slots = sum(r.layout.max_num_seqs for r in ready[: n - 1])
        if load > c.down_utilization * slots:
            return False
        if c.metric == "kv":
            return value * n / (n - 1) < c.target * (1 - c.tolerance)
        if c.metric == "ttft_p99":
            return value < c.target / 2
        return value <= c.target * (1 - c.tolerance)
