"""The simulation of "this machine" checked against the live engine, in one run.

`batchlens fleet check` runs the bench's request mix (`measure.bench.requests`, the same
64 requests `batchlens bench` makes) on the live engine at 8 and 64 concurrent sequences,
as the bench's engine@8 and engine@64 do, then a Sweep (`workloads.sweep`) of concurrency
points; it fits the step costs (`fleet.costs.fit_step_cost`) to this run's own measured
steps (each run's own, and one fit to them all: the first is what a machine whose speed
drifts from run to run can be held to), so a slow or busy machine moves both sides alike;
and it replays every run on one
simulated replica of "this machine" with the very same prompt token ids. It prints both
side by side with the ratios and whether each is within the tolerances.

A step's cost is its period, start to the next step's start, while the engine ran steps
back to back: that holds the scheduling and bookkeeping between two steps, which the
simulated clock must also pay. An idle engine's first step comes a moment after its
latest arrival (its wake-up, `wake_seconds`, measured on the Sweep), and the replica
waits as long.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, SamplingParams
from engine.core import StepStats
from engine.engine import Engine
from engine.local import LocalPC
from engine.metrics import RequestMetrics, percentile
from engine.models.loaded import LoadedModel
from fleet.costs import LinearStepCost, fit_step_cost
from fleet.layouts import this_machine
from fleet.replica import SimRequest
from fleet.sim import FleetConfig, simulate
from fleet.trace import Trace, TraceRequest
from measure.bench.requests import make_requests, tokenize_corpus
from workloads.cpu_load import cpu_sample, others_busy
from workloads.prompts import varied_prompts
from workloads.sweep import Sweep, SweepPlan

TOLERANCE = {"throughput": 0.15, "ttft_p50": 0.25, "ttft_p90": 0.25}
SWEEP_TOLERANCE = 0.20
BACK_TO_BACK_S = 0.05  # a gap above this between steps is idle time, not overhead


@dataclass(frozen=True)
class Figures:
    throughput: float
    ttft_p50: float
    ttft_p90: float
    requests: int


def live_figures(metrics: Sequence[RequestMetrics], t0: float, end: float) -> Figures:
    ttfts = [m.ttft for m in metrics if m.ttft is not None]
    tokens = sum(len(m.token_times) for m in metrics)
    return Figures(tokens / (end - t0), percentile(ttfts, 50), percentile(ttfts, 90),
                   len(metrics))


def sim_figures(reqs: Sequence[SimRequest]) -> Figures:
    t0 = min(r.arrival for r in reqs)
    end = max(r.finish for r in reqs if r.finish is not None)
    ttfts = [r.ttft for r in reqs if r.ttft is not None]
    return Figures(sum(r.req.output_tokens for r in reqs) / (end - t0), percentile(ttfts, 50),
                   percentile(ttfts, 90), len(reqs))


def step_periods(steps: Sequence[StepStats]) -> list[StepStats]:
    """Each step with its duration replaced by its period (start to the next start) where
    the next followed at once; else its duration plus the median overhead."""
    out, gaps = [], []
    for a, b in zip(steps, steps[1:], strict=False):
        gap = b.start - a.start - a.duration
        if 0 <= gap < BACK_TO_BACK_S:
            gaps.append(gap)
    overhead = statistics.median(gaps) if gaps else 0.0
    for i, a in enumerate(steps):
        period = a.duration + overhead
        if i + 1 < len(steps):
            gap = steps[i + 1].start - a.start - a.duration
            if 0 <= gap < BACK_TO_BACK_S:
                period = steps[i + 1].start - a.start
        out.append(dataclasses.replace(a, duration=period))
    return out


def run_engine(loaded: LoadedModel, prompts: list[list[int]], max_tokens: list[int],
               concurrency: int) -> tuple[Figures, list[StepStats], int]:
    """The bench's engine run (`measure.bench.runs.run_engine`): a fresh engine, a warm-up,
    every request submitted at once, greedy, EOS ignored."""
    with Engine(EngineConfig(max_num_seqs=concurrency), loaded=loaded) as eng:
        eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
        t0 = time.monotonic()
        outs = eng.generate(prompts, params)
        end = time.monotonic()
        steps = list(eng.stats(steps_after=t0).recent_steps)
        blocks = eng.kv.num_blocks
    return live_figures([o.metrics for o in outs], t0, end), steps, blocks


def run_sweep(loaded: LoadedModel, levels: tuple[int, ...], max_tokens: int
              ) -> tuple[list[tuple[int, list[RequestMetrics]]], list[list[int]],
                         list[StepStats], int]:
    """A Sweep in "users" mode on a fresh engine (warmed up) and local PC: its datacenter
    points (level, each user's metrics in user order), the token ids it sent, the engine's
    steps."""
    with Engine(EngineConfig(), loaded=loaded) as eng, LocalPC(loaded) as local:
        # warmed up as run_engine's engine is: an engine's first step runs cold, slower
        # than a step cost fitted to the rest of its steps can say
        eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
        sweep = Sweep(eng, local, varied_prompts(), SweepPlan("users", levels, max_tokens))
        t0 = time.monotonic()
        sweep.start().join()
        snap = sweep.snapshot()
        if snap.phase != "done":
            raise RuntimeError(f"sweep {snap.phase}: {snap.error}")
        steps = list(eng.stats(steps_after=t0).recent_steps)
        sent = [list(p) for p in sweep.side_prompts["datacenter"]]
        blocks = eng.kv.num_blocks
    points = [(int(p.level), list(p.metrics)) for p in snap.points if p.side == "datacenter"]
    return points, sent, steps, blocks


def wake_seconds(points: list[tuple[int, list[RequestMetrics]]]) -> float:
    """The live engine's wake-up: from the latest arrival before each sweep point's first
    step to that step, the median over the points (the point's users arrive a fraction
    of a millisecond apart, and those within it share the step)."""
    waits = []
    for _, ms in points:
        start = min(m.first_scheduled_time for m in ms if m.first_scheduled_time is not None)
        waits.append(start - max(m.arrival_time for m in ms if m.arrival_time <= start))
    return statistics.median(waits)


def simulate_burst(cost: LinearStepCost, blocks: int, concurrency: int,
                   prompts: list[list[int]], max_tokens: list[int], wake_s: float) -> Figures:
    reqs = [TraceRequest(0.0, len(p), m, token_ids=tuple(p))
            for p, m in zip(prompts, max_tokens, strict=True)]
    res = simulate(Trace(tuple(reqs), 1.0, "bench mix"),
                   FleetConfig(this_machine(cost, blocks, concurrency, wake_s)))
    assert not res.dropped
    return sim_figures(res.requests)


def simulate_sweep(cost: LinearStepCost, blocks: int,
                   points: list[tuple[int, list[RequestMetrics]]], sent: list[list[int]],
                   wake_s: float) -> list[Figures]:
    """The sweep's datacenter points as one trace on one replica (its prefix cache carries
    over from point to point, as the live engine's does), at their measured arrivals."""
    base = min(m.arrival_time for _, ms in points for m in ms)
    reqs, groups = [], []
    for _, ms in points:
        groups.append(len(ms))
        for user, m in enumerate(ms):
            ids = sent[user % len(sent)]
            reqs.append(TraceRequest(m.arrival_time - base, len(ids), len(m.token_times),
                                     token_ids=tuple(ids)))
    res = simulate(Trace(tuple(reqs), max(r.arrival for r in reqs) + 1, "sweep"),
                   FleetConfig(this_machine(cost, blocks, 64, wake_s)))
    by_arrival = sorted(res.requests, key=lambda r: r.rid)
    out, i = [], 0
    for n in groups:
        out.append(sim_figures(by_arrival[i:i + n]))
        i += n
    return out


def compare(live: Figures, sim: Figures, tolerance: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, tol in tolerance.items():
        a, b = getattr(live, key), getattr(sim, key)
        ratio = b / a if a else float("nan")
        row[key] = {"live": a, "sim": b, "ratio": ratio, "ok": abs(ratio - 1) <= tol}
    return row


def format_rows(rows: dict[str, dict[str, Any]]) -> str:
    head = (f"{'run':<14}{'tok/s live':>11}{'sim':>8}{'ratio':>7}{'TTFT p50 live':>15}"
            f"{'sim':>8}{'ratio':>7}{'TTFT p90 live':>15}{'sim':>8}{'ratio':>7}  within")
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        cells = f"{name:<14}"
        for key, scale, width in (("throughput", 1, 11), ("ttft_p50", 1e3, 15),
                                  ("ttft_p90", 1e3, 15)):
            c = row.get(key)
            if c is None:
                cells += f"{'':>{width}}{'':>8}{'':>7}"
                continue
            cells += (f"{c['live'] * scale:>{width}.1f}{c['sim'] * scale:>8.1f}"
                      f"{c['ratio']:>7.2f}")
        ok = all(c["ok"] for c in row.values())
        lines.append(cells + ("  yes" if ok else "  NO"))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "batchlens fleet check") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64, help="bench mix size (default 64)")
    ap.add_argument("--concurrency", default="8,64", help="engine runs (default 8,64)")
    ap.add_argument("--sweep-users", default="1,4,16,64", help="the Sweep's user counts")
    ap.add_argument("--sweep-max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    a = ap.parse_args(argv)
    try:
        conc = [int(c) for c in a.concurrency.split(",")]
        levels = tuple(int(u) for u in a.sweep_users.split(","))
    except ValueError:
        ap.error("--concurrency and --sweep-users: comma-separated integers")
    print("loading model ...", file=sys.stderr, flush=True)
    loaded = LoadedModel.load()
    reqs = make_requests(tokenize_corpus(loaded.tokenizer), a.requests, a.seed, (10, 300),
                         (16, 256))
    prompts, max_tokens = [list(r.prompt_ids) for r in reqs], [r.max_tokens for r in reqs]
    cpu0 = cpu_sample()
    live, own, blocks = {}, {}, 0
    for c in conc:
        print(f"  live engine@{c} ...", file=sys.stderr, flush=True)
        live[c], st, blocks = run_engine(loaded, prompts, max_tokens, c)
        own[c] = step_periods(st)
    print(f"  live sweep {levels} ...", file=sys.stderr, flush=True)
    points, sent, sweep_steps, sweep_blocks = run_sweep(loaded, levels, a.sweep_max_tokens)
    own["sweep"] = step_periods(sweep_steps)
    wake = wake_seconds(points)
    others = others_busy(cpu0, cpu_sample())
    pooled = fit_step_cost([s for steps in own.values() for s in steps],
                           "every run's engine steps")
    fits = {"each run's own steps": {k: fit_step_cost(v, f"{k} steps") for k, v in own.items()},
            "one fit to every run's steps": dict.fromkeys(own, pooled)}
    print(f"model {loaded.name}; bench mix: {a.requests} requests (seed {a.seed}), all at "
          f"t=0; sweep: users {','.join(map(str, levels))}, {a.sweep_max_tokens} tokens each;"
          f" other processes used {others:.0%} of the CPUs meanwhile; an idle engine's"
          f" first step {wake * 1e3:.2f} ms after its latest arrival (the sweep's median)")
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for title, cost in fits.items():
        rows: dict[str, dict[str, Any]] = {}
        for c in conc:
            sim = simulate_burst(cost[c], blocks, c, prompts, max_tokens, wake)
            rows[f"engine@{c}"] = compare(live[c], sim, TOLERANCE)
        sims = simulate_sweep(cost["sweep"], sweep_blocks, points, sent, wake)
        for (level, ms), sim in zip(points, sims, strict=True):
            fig = live_figures(ms, min(m.arrival_time for m in ms),
                               max(m.token_times[-1] for m in ms))
            rows[f"sweep@{level}"] = compare(fig, sim, {"throughput": SWEEP_TOLERANCE,
                                                        "ttft_p50": SWEEP_TOLERANCE})
        tables[title] = rows
        print(f"\nstep costs from {title}:")
        for k in dict.fromkeys(cost.values()):
            print(f"  {k.describe()}")
        print(format_rows(rows))
    print("(TTFT in ms; within: engine@ runs ±15% tok/s, ±25% TTFT p50 and p90; "
          "sweep points ±20% tok/s and TTFT p50)")
    rows = tables["each run's own steps"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"others_cpu": others, "wake_s": wake, "tables": tables,
                       "costs": {t: {k: dataclasses.asdict(c) for k, c in cost.items()}
                                 for t, cost in fits.items()}}, f, indent=2)
    return 0 if all(c["ok"] for row in rows.values() for c in row.values()) else 1
