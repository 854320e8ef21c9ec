"""A load sweep: the same requests at 1, 2, 4 ... 64 concurrent users (or at Poisson arrival
rates), on the datacenter engine and on the local PC, one side at a time::

    load 1:  datacenter |=|  local |=|
    load 2:                          datacenter |=|  local |==|
    ...
    load 64:                                          datacenter |===|  local |=========...|
             never both at once: on a small CPU they would share its cores

"users" mode: all of a point's users send one request each at its t=0 (a burst).
"rate" mode: requests arrive as a Poisson process at the point's rate (requests/s) for
`duration_s` seconds, the first at t=0; the same seeded arrivals on both sides.

A side may be a remote server (`server.remote.RemoteSide`, an endpoint the admin
configured). It takes a point's requests like any side, and sends, reads and measures each
one with `server.stream_client.stream`, the function `batchlens bench serve`'s load
generator (`measure.bench.serve.run_load`) streams with: the same request body for the same
prompt and settings, TTFT/ITL stamped on the same chunk arrivals, tokens counted from the
same usage chunk. So a remote point is measured as the load generator measures it, while
its arrivals, stop button and summaries stay the sweep's own.

A background thread runs the points; `snapshot()` is a copy, safe from any thread; `stop()`
cancels the requests in flight (their blocks are freed) and ends the sweep with the points
finished so far. Every figure comes from `engine.metrics` (the page draws the roofline of
`measure.roofline` beneath). `python -m workloads.sweep` runs the default sweep and prints
every point.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import SamplingParams
from engine.engine import Engine
from engine.local import LocalPC
from engine.metrics import RequestMetrics, RunSummary, goodput, summarize
from engine.models.loaded import Prompt
from engine.outputs import RequestHandle, RequestOutput
from engine.serving import ServingSide
from workloads.cpu_load import cpu_sample, others_busy
from workloads.job import CANCEL_GRACE_S, BackgroundJob, engine_changed
from workloads.prompts import chat, varied_prompts
from workloads.sides import LABELS, MAX_USERS, SIDES, check_order, prompts_for_sides

MODES = ("users", "rate")
DEFAULT_USERS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_RATES = (0.5, 1.0, 2.0, 4.0, 8.0)
DEFAULT_MAX_TOKENS = 16
DEFAULT_DURATION_S = 10.0
PROGRESS_S = 5.0  # a headless sweep prints its progress this often


@dataclass(frozen=True)
class SweepPlan:
    """What to sweep. `levels`: user counts ("users") or arrival rates in requests/s ("rate"),
    run in increasing order."""

    mode: str = "users"
    levels: tuple[float, ...] = DEFAULT_USERS
    max_tokens: int = DEFAULT_MAX_TOKENS
    duration_s: float = DEFAULT_DURATION_S  # "rate" mode only
    seed: int = 0
    order: tuple[str, ...] = SIDES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        if not self.levels:
            raise ValueError("levels: pick at least one load to sweep")
        for v in self.levels:
            if self.mode == "users" and not (isinstance(v, int) and 1 <= v <= MAX_USERS):
                raise ValueError(f"users: each must be an integer in [1, {MAX_USERS}], got {v!r}")
            if self.mode == "rate" and not (isinstance(v, int | float) and 0 < v < math.inf):
                raise ValueError(f"rate: each must be > 0 requests/s, got {v!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0 seconds, got {self.duration_s!r}")
        check_order(self.order)
        object.__setattr__(self, "levels", tuple(sorted(set(self.levels))))

    @property
    def load_column(self) -> str:
        """The CSV column that holds a point's load."""
        return "users" if self.mode == "users" else "rate_rps"

    def arrivals(self, level: float) -> list[float]:
        """Request arrival offsets (s) at one load: a burst, or seeded Poisson arrivals."""
        if self.mode == "users":
            return [0.0] * int(level)
        rng = random.Random(self.seed * 1_000_003 + round(level * 1000))
        times, t = [], 0.0
        while t < self.duration_s:
            times.append(t)
            t += rng.expovariate(level)
        return times

    @property
    def num_requests(self) -> int:
        """Requests of the whole sweep, per side."""
        return sum(len(self.arrivals(level)) for level in self.levels)


@dataclass(frozen=True)
class SweepPoint:
    """One side at one load: the run's summary plus what else the engine did meanwhile."""

    side: str
    level: float
    requests: int
    completed: int  # finished with "stop" or "length"
    summary: RunSummary
    mean_batch: float  # sequences per engine step while the point ran (local: 1)
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    other_requests: int  # most requests of other sessions seen in the engine meanwhile
    others_cpu: float  # share of all CPU time other processes used meanwhile
    metrics: tuple[RequestMetrics, ...]

    def goodput(self, ttft_slo: float | None, tpot_slo: float | None) -> float:
        """Requests per second that met every SLO given (None: no limit)."""
        return goodput(self.metrics, self.summary.wall_time, ttft_slo, tpot_slo)

    def row(self, load_column: str, ttft_slo: float | None = None,
            tpot_slo: float | None = None) -> dict[str, Any]:
        """One CSV row: the point's figures, goodput at the given SLOs."""
        s = self.summary
        level = int(self.level) if load_column == "users" else self.level
        return {
            "side": self.side, load_column: level, "requests": self.requests,
            "completed": self.completed, "output_tokens": s.output_tokens,
            "wall_s": s.wall_time, "throughput_tokens_per_s": s.throughput,
            "per_user_tokens_per_s_p50": s.per_user_tokens_per_s_p50,
            "ttft_p50_s": s.ttft_p50, "ttft_p99_s": s.ttft_p99,
            "tpot_p50_s": s.tpot_p50, "tpot_p99_s": s.tpot_p99,
            "e2e_p50_s": s.e2e_p50, "e2e_p99_s": s.e2e_p99,
            "goodput_rps": self.goodput(ttft_slo, tpot_slo),
            "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo,
            "mean_batch": self.mean_batch, "cached_prompt_tokens": self.cached_prompt_tokens,
            "other_requests": self.other_requests, "others_cpu": self.others_cpu,
        }


@dataclass(frozen=True)
class SweepSnapshot:
    """A copy of the sweep's state."""

    phase: str  # "waiting", "running", "done", "stopped", "abandoned" or "error"
    elapsed: float
    progress: float  # 0..1, by requests finished
    current: tuple[str, float] | None  # the side and load being measured
    points: tuple[SweepPoint, ...]
    finished: bool
    error: str | None


class Sweep(BackgroundJob):
    """Run `plan` on both sides. User i of a point sends `prompts[i % len(prompts)]`, greedy,
    EOS ignored, so each request makes exactly `max_tokens` tokens. Prompts are encoded and
    checked against both sides' limits here: a bad input raises `ValueError` before any run.

    `page_wait_s` (a page's sweep): the first point waits, at most this long, until the
    page has drawn the sweep once (`shown`). That first redraw after Run is the page's
    heaviest (every chart built again), it runs in this process, and the first point is a
    single short request on one side: measured under it, the datacenter at 1 user fell
    far below the local PC, measured after it."""

    def __init__(self, engine: ServingSide, local: ServingSide, prompts: Sequence[Prompt],
                 plan: SweepPlan | None = None, *, heartbeat_timeout: float | None = None,
                 interval: float = 0.1, close_local: bool = False, close_engine: bool = False,
                 connected: Callable[[], bool] | None = None, page_wait_s: float = 0.0) -> None:
        if not prompts:
            raise ValueError("prompts: at least one prompt is needed")
        owned = [side for side, close in ((local, close_local), (engine, close_engine)) if close]
        super().__init__("sweep", heartbeat_timeout, connected, owned)
        self.engine, self.local = engine, local
        self.plan, self.interval = plan or SweepPlan(), interval
        self.page_wait_s = page_wait_s
        self.params = SamplingParams(max_tokens=self.plan.max_tokens, ignore_eos=True)
        self.num_prompts = len(prompts)
        # what each side is sent: token ids where it tokenizes, else the prompt itself
        self.side_prompts = prompts_for_sides({"datacenter": engine, "local": local}, prompts,
                                              self.params)
        self.num_threads = torch.get_num_threads()
        self._total = 2 * self.plan.num_requests
        self._points: list[SweepPoint] = []
        self._handles: list[RequestHandle] = []
        self._current: tuple[str, float] | None = None
        self._done_requests = 0

    @property
    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt length in tokens, from a side that tokenizes (None if neither does)."""
        for sent in self.side_prompts.values():
            if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in sent):
                return sum(map(len, sent)) / len(sent)
        return None

    # ---- public API ------------------------------------------------------------------
    def _live_handles(self) -> list[RequestHandle]:
        return list(self._handles)  # the requests in flight; the finished points stay

    def snapshot(self) -> SweepSnapshot:
        now = time.monotonic()
        with self._lock:
            current = sum(h.done for h in self._handles)
            done = self._done_requests + current
            return SweepSnapshot(
                phase=self._phase, elapsed=(self._t_done or now) - (self._t_start or now),
                progress=1.0 if self._phase == "done" else min(done / self._total, 1.0),
                current=self._current, points=tuple(self._points),
                finished=self._t_done is not None, error=self._error)

    # ---- the sweep thread ------------------------------------------------------------
    def _work(self) -> None:
        if self.page_wait_s > 0:
            self._wait_shown(self.page_wait_s)
        with self._lock:
            self._phase = "running"
        for i, level in enumerate(self.plan.levels):
            for side in self.plan.order:
                if self._stop.is_set():
                    break
                point = self._run_point(side, i, level)
                with self._lock:
                    if point is not None:
                        self._points.append(point)
                    self._done_requests += len(self._handles)
                    self._handles, self._current = [], None

    def _on_finish(self) -> None:
        self._current = None

    def _run_point(self, side: str, index: int, level: float) -> SweepPoint | None:
        """Submit this load's requests as they arrive; wait for them; None if stopped."""
        server = self.engine if side == "datacenter" else self.local
        arrivals = self.plan.arrivals(level)
        with self._lock:
            self._current = (side, level)
        cpu0, t0 = cpu_sample(), time.monotonic()
        sent, others, deadline = 0, 0, None
        while True:
            now = time.monotonic()
            while sent < len(arrivals) and not self._stop.is_set() and now - t0 >= arrivals[sent]:
                prompts = self.side_prompts[side]
                ids = prompts[sent % len(prompts)]
                rid = f"{self.job_id}-{side[:2]}{index}-u{sent}"
                try:
                    handle = server.submit(ids, self.params, rid)
                except RuntimeError:
                    if server.stats(steps_after=None).stopped == "shut down":
                        raise engine_changed("sweep") from None  # replaced, then drained
                    raise
                with self._lock:
                    self._handles.append(handle)
                sent += 1
            for h in self._handles:
                h.poll()  # drain streamed text; only the final metrics are used
            if side == "datacenter":
                others = max(others, self._other_requests())
            if self._heartbeat_expired():
                self._abandoned = True
                self.stop()
            if self._stop.is_set():
                for h in self._handles:  # also any submitted while stop() was cancelling
                    h.cancel()
                deadline = deadline or now + CANCEL_GRACE_S
                if now > deadline:
                    raise RuntimeError(f"{side}: requests did not end after cancel")
            all_sent = sent == len(arrivals) or self._stop.is_set()
            if all_sent and all(h.done for h in self._handles):
                break
            wait = self.interval
            if self._stop.is_set():  # not _stop.wait: once set, it would spin
                time.sleep(wait)
                continue
            if sent < len(arrivals):
                wait = min(wait, max(t0 + arrivals[sent] - now, 0.0))
            self._stop.wait(wait)
        if self._stop.is_set():
            return None
        outputs = [h.result() for h in self._handles]
        self._check(side, outputs)
        summary = summarize([o.metrics for o in outputs])
        return SweepPoint(
            side=side, level=level, requests=len(outputs),
            completed=sum(o.finish_reason in ("stop", "length") for o in outputs),
            summary=summary, mean_batch=self._mean_batch(side, t0),
            cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
            other_requests=others, others_cpu=others_busy(cpu0, cpu_sample()),
            metrics=tuple(o.metrics for o in outputs))

    def _check(self, side: str, outputs: list[RequestOutput]) -> None:
        errors = [o.error for o in outputs if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{LABELS[side]}: {errors[0]}")
        if any(o.finish_reason == "cancelled" for o in outputs):  # a shut-down side:
            raise engine_changed("sweep")  # the shared engine, replaced by the admin

    def _other_requests(self) -> int:
        stats = self.engine.stats(steps_after=None)
        return sum(not rid.startswith(self.job_id)
                   for rid in stats.running_ids + stats.waiting_ids)

    def _mean_batch(self, side: str, t0: float) -> float:
        if side == "local":
            return 1.0
        steps = [s.num_seqs for s in self.engine.stats(steps_after=t0).recent_steps]
        return sum(steps) / len(steps) if steps else math.nan



def rows(points: Sequence[SweepPoint], plan: SweepPlan, ttft_slo: float | None = None,
         tpot_slo: float | None = None) -> list[dict[str, Any]]:
    """Every point as a CSV row, in the order measured."""
    return [p.row(plan.load_column, ttft_slo, tpot_slo) for p in points]


# ---- command line --------------------------------------------------------------------
def format_table(points: Sequence[SweepPoint], plan: SweepPlan) -> str:
    """One fixed-width line per point; latencies in ms."""
    load = "users" if plan.mode == "users" else "req/s"
    head = (f"{'side':<11}{load:>6}{'reqs':>6}{'tokens':>7}{'wall s':>8}{'tok/s':>8}"
            f"{'tok/s/user':>11}{'TTFT p50':>9}{'TTFT p99':>9}{'E2E p50':>9}{'E2E p99':>9}"
            f"{'batch':>6}{'others':>7}")
    lines = [head, "-" * len(head)]
    for p in points:
        s = p.summary
        lines.append(
            f"{p.side:<11}{p.level:>6g}{p.requests:>6}{s.output_tokens:>7}{s.wall_time:>8.1f}"
            f"{s.throughput:>8.1f}{s.per_user_tokens_per_s_p50:>11.2f}{s.ttft_p50 * 1e3:>9.0f}"
            f"{s.ttft_p99 * 1e3:>9.0f}{s.e2e_p50 * 1e3:>9.0f}{s.e2e_p99 * 1e3:>9.0f}"
            f"{p.mean_batch:>6.1f}{p.others_cpu:>7.0%}")
    return "\n".join(lines)


def progress_line(snap: SweepSnapshot) -> str:
    """One line of a headless sweep's progress: the share of requests done and the point
    being measured."""
    now = f", {LABELS[snap.current[0]]} at {snap.current[1]:g}" if snap.current else ""
    return f"{snap.elapsed:6.1f} s  {snap.progress:4.0%} of the requests done{now}"


def main(argv: list[str] | None = None, prog: str = "python -m workloads.sweep") -> int:
    """Run a sweep on a fresh engine and local PC, printing its progress every few
    seconds, then every point and the time. Ctrl-C stops it, freeing what it holds."""
    ap = argparse.ArgumentParser(prog=prog,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--users", default=",".join(map(str, DEFAULT_USERS)),
                    help="comma-separated user counts")
    ap.add_argument("--rate", help="comma-separated arrival rates (requests/s): rate mode")
    ap.add_argument("--duration", type=float, default=DEFAULT_DURATION_S,
                    help="seconds of arrivals per rate")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--prompt", help="one prompt for every user (default: varied prompts)")
    a = ap.parse_args(argv)
    try:
        plan = (SweepPlan("rate", tuple(float(x) for x in a.rate.split(",")), a.max_tokens,
                          a.duration) if a.rate else
                SweepPlan("users", tuple(int(x) for x in a.users.split(",")), a.max_tokens))
    except ValueError as exc:
        ap.error(str(exc))
    if a.prompt is not None and not a.prompt.strip():
        ap.error("--prompt must not be empty")
    prompts = [chat(a.prompt)] if a.prompt else varied_prompts()
    with Engine() as engine, LocalPC(engine.loaded) as local:
        dc = engine.stats(steps_after=None)
        print(f"model {dc.model} on {dc.device}, {dc.dtype} ({dc.dtype_reason}), "
              f"{torch.get_num_threads()} threads")
        sweep = Sweep(engine, local, prompts, plan)
        print(f"{plan.num_requests} requests per side, max_tokens {plan.max_tokens}, "
              f"{sweep.mean_prompt_tokens or 0:.0f} prompt tokens on average, EOS ignored",
              flush=True)
        sweep.start()
        sweep.follow(lambda: progress_line(sweep.snapshot()), PROGRESS_S)
        snap = sweep.snapshot()
    print(format_table(snap.points, plan))
    print("(latencies in ms; batch: mean sequences per step; others: CPU share other "
          "processes used)")
    print(f"sweep {snap.phase} in {snap.elapsed:.1f} s" + (f": {snap.error}" if snap.error else ""))
    return 0 if snap.phase == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())
