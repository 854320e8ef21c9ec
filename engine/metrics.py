"""One definition of every latency and throughput metric, used by both sides.

All times are raw `time.monotonic()` seconds.

- TTFT: arrival (submit) -> first output token; includes queueing.
- TPOT: (E2E - TTFT) / (output tokens - 1), one value per request.
- ITL: every gap between consecutive output tokens, pooled over requests.
- E2E: arrival -> last token.
- Throughput: output tokens / wall time of the whole run.
- Goodput: requests per second meeting every SLO given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Raw timestamps of one request and the per-request metrics derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Arrival -> first output token, in seconds."""
        if not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival -> last output token, in seconds."""
        if not self.token_times:
            return None
        return self.token_times[-1] - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tokens_per_s(self) -> float | None:
        """This user's output tokens / E2E."""
        e2e = self.e2e
        if not e2e:
            return None
        return len(self.token_times) / e2e


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return math.nan
    if len(vals) == 1:
        return vals[0]
    k = (len(vals) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


@dataclass
class RunSummary:
    """Aggregate figures over one run of many requests."""

    num_requests: int
    output_tokens: int
    wall_time: float
    throughput: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p50: float
    e2e_p50: float
    e2e_p99: float
    per_user_tokens_per_s_p50: float
    goodput: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return dict(self.__dict__)


def summarize(
    metrics: Iterable[RequestMetrics],
    wall_time: float | None = None,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
) -> RunSummary:
    """Aggregate request metrics. Wall time defaults to first arrival -> last token."""
    ms = list(metrics)
    out_tokens = sum(len(m.token_times) for m in ms)
    if wall_time is None:
        starts = [m.arrival_time for m in ms]
        ends = [m.token_times[-1] for m in ms if m.token_times]
        wall_time = (max(ends) - min(starts)) if ends else 0.0
    itls = [g for m in ms for g in m.itls]
    good = None
    if ttft_slo is not None or tpot_slo is not None:
        good = goodput(ms, wall_time, ttft_slo, tpot_slo)
    return RunSummary(
        num_requests=len(ms),
        output_tokens=out_tokens,
        wall_time=wall_time,
        throughput=out_tokens / wall_time if wall_time > 0 else math.nan,
        ttft_p50=percentile([m.ttft for m in ms], 50),
        ttft_p99=percentile([m.ttft for m in ms], 99),
        tpot_p50=percentile([m.tpot for m in ms], 50),
        tpot_p99=percentile([m.tpot for m in ms], 99),
        itl_p50=percentile(itls, 50),
        e2e_p50=percentile([m.e2e for m in ms], 50),
        e2e_p99=percentile([m.e2e for m in ms], 99),
        per_user_tokens_per_s_p50=percentile([m.tokens_per_s for m in ms], 50),
        goodput=good,
    )


def meets_slo(m: RequestMetrics, ttft_slo: float | None, tpot_slo: float | None) -> bool:
    """Whether one request met every SLO given (None means no limit)."""
    if m.ttft is None:
        return False
    if ttft_slo is not None and m.ttft > ttft_slo:
        return False
    return not (tpot_slo is not None and m.tpot is not None and m.tpot > tpot_slo)


def goodput(
    metrics: Iterable[RequestMetrics],
    wall_time: float,
    ttft_slo: float | None,
    tpot_slo: float | None,
) -> float:
    """Requests per second that met every SLO."""
    n = sum(1 for m in metrics if meets_slo(m, ttft_slo, tpot_slo))
    return n / wall_time if wall_time > 0 else math.nan
