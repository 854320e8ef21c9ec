"""Where requests come from: arrival times with prompt and output token counts.

Three sources, one shape (`Trace`, requests sorted by arrival):

- `poisson_day`: a Poisson process whose rate follows a daily demand curve (a trough at
  night, a peak in the afternoon) with bursts on top, thinned from the peak rate (Lewis
  and Shedler), so every arrival is independent and the same seed gives the same trace;
- `connected_users`: the preset "N connected, M active, R tokens/s each": M users of N
  are in a conversation at any time, each reading R tokens/s, so the service must produce
  M x R tokens/s; requests arrive at M x R / mean output tokens per second;
- `from_csv`: a file of arrival times and token counts, or the Arena's or the Sweep's CSV
  export (`read_csv` says which columns each takes).

A request may carry a shared prefix (a system prompt): `prefix_id` names it and
`prefix_tokens` says how long it is; requests with the same `prefix_id` begin with the
same tokens, which the replicas' prefix cache and the prefix-aware router see.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DAY_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: when it arrives, its prompt and output lengths, its shared prefix.

    `token_ids`, where given, are the prompt's own tokens (a replay of a real mix); else
    the simulation makes tokens that share exactly the `prefix_tokens` of `prefix_id`."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: int | None = None
    prefix_tokens: int = 0
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"arrival: must be a time >= 0 s, got {self.arrival!r}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens: must be >= 1, got {self.output_tokens}")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"prefix_tokens: must be in [0, prompt_tokens={self.prompt_tokens}]"
                             f", got {self.prefix_tokens}")


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, and the span they cover (`duration_s`)."""

    requests: tuple[TraceRequest, ...]
    duration_s: float
    name: str = "trace"
    demand: Callable[[float], float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests",
                           tuple(sorted(self.requests, key=lambda r: r.arrival)))
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s!r}")

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace."""
        return len(self.requests) / self.duration_s

    def demand_tokens_per_s(self, t: float) -> float:
        """Output tokens per second the users ask for at time t (the curve, where one was
        given; else the trace's mean)."""
        if self.demand is not None:
            return self.demand(t)
        return self.output_tokens / self.duration_s


# ---- the daily curve -------------------------------------------------------------------
@dataclass(frozen=True)
class DayCurve:
    """Demand over a day as a share of the peak: a cosine from `trough` (at `trough_h`
    o'clock) up to 1 twelve hours later; `bursts` are (start s, length s, factor) on top."""

    trough: float = 0.2
    trough_h: float = 4.0
    bursts: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.trough <= 1:
            raise ValueError(f"trough: must be in [0, 1], got {self.trough}")
        for start, length, factor in self.bursts:
            if length <= 0 or factor < 1 or start < 0:
                raise ValueError("bursts: each is (start s >= 0, length s > 0, factor >= 1), "
                                 f"got {(start, length, factor)}")

    def share(self, t: float) -> float:
        phase = 2 * math.pi * ((t / 3600.0 - self.trough_h) % 24) / 24
        base = self.trough + (1 - self.trough) * (1 - math.cos(phase)) / 2
        for start, length, factor in self.bursts:
            if start <= t < start + length:
                base *= factor
        return base

    @property
    def max_share(self) -> float:
        return max([1.0] + [f for _, _, f in self.bursts]) if self.bursts else 1.0


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths, uniform in inclusive ranges, and a shared system prompt:
    `shared_prefix_tokens` long, one of `num_prefixes` per request (0: none)."""

    prompt: tuple[int, int] = (100, 400)
    output: tuple[int, int] = (50, 350)
    shared_prefix_tokens: int = 0
    num_prefixes: int = 0

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("prompt", self.prompt), ("output", self.output)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: a range 1 <= low <= high, got {(lo, hi)}")
        if self.shared_prefix_tokens < 0 or self.num_prefixes < 0:
            raise ValueError("shared_prefix_tokens and num_prefixes: must be >= 0")
        if self.shared_prefix_tokens and not self.num_prefixes:
            raise ValueError("num_prefixes: must be >= 1 when shared_prefix_tokens is set")

    @property
    def mean_output(self) -> float:
        return sum(self.output) / 2

    def draw(self, rng: random.Random, arrival: float) -> TraceRequest:
        own = rng.randint(*self.prompt)
        out = rng.randint(*self.output)
        if self.shared_prefix_tokens and self.num_prefixes:
            pid = rng.randrange(self.num_prefixes)
            return TraceRequest(arrival, own + self.shared_prefix_tokens, out, pid,
                                self.shared_prefix_tokens)
        return TraceRequest(arrival, own, out)


def poisson(rate: Callable[[float], float], peak_rate: float, duration_s: float,
            mix: LengthMix, seed: int = 0, start_s: float = 0.0) -> list[TraceRequest]:
    """Arrivals of a Poisson process with time-varying `rate` (requests/s, never above
    `peak_rate`) over [start_s, start_s + duration_s), by thinning."""
    if not peak_rate > 0:
        raise ValueError(f"rate: the peak must be > 0 requests/s, got {peak_rate!r}")
    rng = random.Random(seed)
    out, t, end = [], start_s, start_s + duration_s
    while True:
        t += rng.expovariate(peak_rate)
        if t >= end:
            return out
        keep = rng.random() * peak_rate <= rate(t)
        req = mix.draw(rng, t)  # drawn either way: lengths do not depend on thinning
        if keep:
            out.append(req)


def poisson_day(peak_tokens_per_s: float, mix: LengthMix | None = None,
                curve: DayCurve | None = None, duration_s: float = DAY_S, seed: int = 0,
                start_s: float = 0.0) -> Trace:
    """A day (or part of one, from `start_s`) of requests whose output tokens/s follow
    `curve` x `peak_tokens_per_s`."""
    if not peak_tokens_per_s > 0:
        raise ValueError(f"peak_tokens_per_s: must be > 0, got {peak_tokens_per_s!r}")
    mix, curve = mix or LengthMix(), curve or DayCurve()
    peak_rate = peak_tokens_per_s / mix.mean_output

    def rate(t: float) -> float:
        return peak_rate * curve.share(t)

    reqs = poisson(rate, peak_rate * curve.max_share, duration_s, mix, seed, start_s)
    shifted = [_shift(r, -start_s) for r in reqs]
    return Trace(tuple(shifted), duration_s, "poisson day",
                 lambda t: peak_tokens_per_s * curve.share(t + start_s))


def steady(tokens_per_s: float, duration_s: float, mix: LengthMix | None = None,
           seed: int = 0) -> Trace:
    """A constant-rate Poisson trace."""
    mix = mix or LengthMix()
    rate = tokens_per_s / mix.mean_output
    reqs = poisson(lambda _t: rate, rate, duration_s, mix, seed)
    return Trace(tuple(reqs), duration_s, "steady", lambda _t: tokens_per_s)


def step_up(tokens_per_s: float, factor: float, at_s: float, duration_s: float,
            mix: LengthMix | None = None, seed: int = 0) -> Trace:
    """Steady demand that multiplies by `factor` at `at_s` and stays there."""
    mix = mix or LengthMix()

    def demand(t: float) -> float:
        return tokens_per_s * (factor if t >= at_s else 1.0)

    peak = tokens_per_s * max(factor, 1.0) / mix.mean_output
    reqs = poisson(lambda t: demand(t) / mix.mean_output, peak, duration_s, mix, seed)
    return Trace(tuple(reqs), duration_s, f"step x{factor:g}", demand)


@dataclass(frozen=True)
class ConnectedUsers:
    """The preset: `connected` users hold a session, `active` of them are in a conversation
    at any moment, each reading `tokens_per_s` tokens/s."""

    connected: int = 1000
    active: int = 200
    tokens_per_s: float = 20.0

    def __post_init__(self) -> None:
        if not 1 <= self.active <= self.connected:
            raise ValueError(f"active: must be in [1, connected={self.connected}], "
                             f"got {self.active}")
        if not self.tokens_per_s > 0:
            raise ValueError(f"tokens_per_s: must be > 0, got {self.tokens_per_s!r}")

    @property
    def demand_tokens_per_s(self) -> float:
        return self.active * self.tokens_per_s


PRESET_1000 = ConnectedUsers(1000, 200, 20.0)


def connected_users(users: ConnectedUsers = PRESET_1000, duration_s: float = DAY_S,
                    mix: LengthMix | None = None, curve: DayCurve | None = None,
                    seed: int = 0) -> Trace:
    """The preset as a day: the active users' demand is the peak of the daily curve."""
    trace = poisson_day(users.demand_tokens_per_s, mix, curve, duration_s, seed)
    name = (f"{users.connected:,} connected, {users.active:,} active, "
            f"{users.tokens_per_s:g} tokens/s each")
    return Trace(trace.requests, trace.duration_s, name, trace.demand)


def _shift(r: TraceRequest, dt: float) -> TraceRequest:
    return TraceRequest(r.arrival + dt, r.prompt_tokens, r.output_tokens, r.prefix_id,
                        r.prefix_tokens, r.token_ids)


# ---- CSV -------------------------------------------------------------------------------
TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


def read_csv(text: str, prompt_tokens: int = 200, rate_gap_s: float = 1.0) -> Trace:
    """A trace from CSV text. Three layouts are read, by their columns:

    - a trace: `arrival_s`, `prompt_tokens`, `output_tokens` (and optionally `prefix_id`,
      `prefix_tokens`);
    - the Arena's per-request export (`side`, `user`, `tokens`, ...): every user's request
      arrives at t = 0, as in the race; datacenter rows only (the local PC's are the same
      users again); its prompts are not in the file, so each is `prompt_tokens` long;
    - the Sweep's per-point export (`side`, `users` or `rate_rps`, `requests`,
      `output_tokens`, `wall_s`, ...): datacenter points one after another, `rate_gap_s`
      apart; a "users" point is a burst of its users at its start, a "rate" point evenly
      spaced arrivals at its rate; each request gets the point's mean output tokens.
    """
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("CSV: no rows (a header and at least one request are needed)")
    cols = set(rows[0])
    if set(TRACE_COLUMNS) <= cols:
        return _trace_rows(rows)
    if {"side", "user", "tokens"} <= cols:
        return _arena_rows(rows, prompt_tokens)
    if {"side", "requests", "output_tokens", "wall_s"} <= cols and (
            "users" in cols or "rate_rps" in cols):
        return _sweep_rows(rows, prompt_tokens, rate_gap_s)
    raise ValueError(f"CSV: columns {sorted(cols)} are none of a trace "
                     f"({', '.join(TRACE_COLUMNS)}), the Arena's export (side, user, tokens) "
                     "or the Sweep's (side, users or rate_rps, requests, output_tokens, wall_s)")


def _num(row: dict[str, str], key: str, line: int, kind: type = float) -> float:
    try:
        return kind(float(row[key])) if kind is int else kind(row[key])
    except (TypeError, ValueError):
        raise ValueError(f"CSV line {line}: {key} must be a number, got {row[key]!r}") from None


def _trace_rows(rows: Sequence[dict[str, str]]) -> Trace:
    reqs = []
    for i, row in enumerate(rows, start=2):
        pid = row.get("prefix_id") or None
        try:
            reqs.append(TraceRequest(
                _num(row, "arrival_s", i), int(_num(row, "prompt_tokens", i, int)),
                int(_num(row, "output_tokens", i, int)), int(pid) if pid is not None else None,
                int(_num(row, "prefix_tokens", i, int)) if row.get("prefix_tokens") else 0))
        except ValueError as exc:
            raise ValueError(f"CSV line {i}: {exc}") from None
    end = max(r.arrival for r in reqs)
    return Trace(tuple(reqs), max(end, 1.0), "CSV trace")


def _arena_rows(rows: Sequence[dict[str, str]], prompt_tokens: int) -> Trace:
    dc = [r for r in rows if r["side"] == "datacenter"] or list(rows)
    reqs = [TraceRequest(0.0, prompt_tokens, max(int(_num(r, "tokens", i, int)), 1))
            for i, r in enumerate(dc, start=2)]
    return Trace(tuple(reqs), 1.0, "Arena CSV")


def _sweep_rows(rows: Sequence[dict[str, str]], prompt_tokens: int, gap_s: float) -> Trace:
    dc = [r for r in rows if r["side"] == "datacenter"] or list(rows)
    reqs: list[TraceRequest] = []
    t = 0.0
    for i, r in enumerate(dc, start=2):
        n = int(_num(r, "requests", i, int))
        if n < 1:
            raise ValueError(f"CSV line {i}: requests must be >= 1, got {n}")
        out = max(round(_num(r, "output_tokens", i) / n), 1)
        if r.get("users"):
            arrivals = [t] * n
            span = _num(r, "wall_s", i)
        else:
            rate = _num(r, "rate_rps", i)
            if not rate > 0:
                raise ValueError(f"CSV line {i}: rate_rps must be > 0, got {rate}")
            arrivals = [t + k / rate for k in range(n)]
            span = max(n / rate, _num(r, "wall_s", i))
        reqs += [TraceRequest(a, prompt_tokens, out) for a in arrivals]
        t += span + gap_s
    return Trace(tuple(reqs), t, "Sweep CSV")


def to_csv(trace: Trace) -> str:
    """The trace in the CSV layout `read_csv` reads first."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*TRACE_COLUMNS, "prefix_id", "prefix_tokens"])
    for r in trace.requests:
        w.writerow([f"{r.arrival:.6f}", r.prompt_tokens, r.output_tokens,
                    "" if r.prefix_id is None else r.prefix_id, r.prefix_tokens])
    return buf.getvalue()
