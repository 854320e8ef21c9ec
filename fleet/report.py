"""What a fleet run comes to: the summary (latency percentiles, throughput, GPU-hours,
cost per million tokens, energy per token, the prefix-cache hit rate, Little's law) and
the time series the page draws, as plain rows. Every latency is `engine.metrics`'
definition (TTFT includes queueing; TPOT = (E2E - TTFT) / (tokens - 1))."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from engine.metrics import percentile
from fleet.replica import Replica
from fleet.sim import FleetResult
from measure.units import fmt_seconds

BEHIND_SHARE = 0.1  # a drain longer than this share of the arrivals' span is falling behind


def alive_s(r: Replica, end: float) -> float:
    """Seconds a replica was paid for: from being added (its cold start included) to its
    removal or the end of the run."""
    stop = r.removed_at if r.removed_at is not None else end
    return max(stop - r.added_at, 0.0)


def little(result: FleetResult, warmup_s: float = 0.0) -> dict[str, float]:
    """Little's law on the samples after `warmup_s`: L, the mean requests in the system
    (queued or running) as sampled, against lambda x W, arrivals per second in that span
    times their mean time in the system."""
    t_end = result.trace.duration_s
    samples = [s for s in result.samples if warmup_s <= s.t <= t_end]
    reqs = [r for r in result.requests
            if warmup_s <= r.arrival < t_end and r.finish is not None]
    if not samples or not reqs:
        return {"L": math.nan, "lambda_W": math.nan}
    span = t_end - warmup_s
    mean_w = sum(r.e2e for r in reqs) / len(reqs)
    return {"L": sum(s.waiting + s.running for s in samples) / len(samples),
            "lambda_W": len(reqs) / span * mean_w}


def summary(result: FleetResult) -> dict[str, Any]:
    """The run's figures, as `batchlens fleet` prints and the page shows them."""
    reqs, lay, end = result.requests, result.config.layout, result.end_time
    done = result.finished
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    tokens = sum(r.stats.output_tokens for r in result.replicas)
    alive = sum(alive_s(r, end) for r in result.replicas)
    busy = sum(min(r.stats.busy_s, alive_s(r, end)) for r in result.replicas)
    joules = busy * lay.busy_watts + (alive - busy) * lay.idle_watts
    queries = sum(r.kv.prefix_queries for r in result.replicas)
    hits = sum(r.kv.prefix_hits for r in result.replicas)
    dollars = alive / 3600 * lay.dollars_per_hour
    return {
        "trace": result.trace.name, "layout": lay.name, "router": result.config.router,
        "simulated_s": end, "arrivals_s": result.trace.duration_s,
        "waiting_at_arrivals_end": next((s.waiting for s in reversed(result.samples)
                                         if s.t <= result.trace.duration_s), 0),
        "requests": len(reqs),
        "finished": len(done), "dropped": len(result.dropped), "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / end if end else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "preemptions": sum(r.stats.preemptions for r in result.replicas),
        "replicas_added": len(result.replicas), "peak_replicas": max(
            [s.ready + s.starting for s in result.samples] + [result.config.replicas]),
        "gpu_hours": alive / 3600 * lay.gpus, "cost_dollars": dollars,
        "dollars_per_million_tokens": dollars / tokens * 1e6 if tokens else math.nan,
        "energy_kwh": joules / 3.6e6, "joules_per_token": joules / tokens if tokens else math.nan,
        "scale_events": len(result.scale_events),
        "peak_in_system": max([s.waiting + s.running for s in result.samples], default=0),
        "steps": sum(r.stats.steps for r in result.replicas),
        "wall_s": result.wall_s, "cpu_s": result.cpu_s,
    }


def series(result: FleetResult) -> dict[str, list[dict[str, Any]]]:
    """Rows for the page's charts, one list per chart, times in hours of the run.

    tokens: demand and delivered output tokens/s and the ready replicas' capacity, per
    bucket; replicas: ready and starting per sample; queue: waiting and running per
    sample; latency: TTFT and TPOT p50/p99 of the requests that arrived in each bucket."""
    cfg, lay, trace = result.config, result.config.layout, result.trace
    w = cfg.bucket_s
    made: dict[int, float] = defaultdict(float)
    for r in result.replicas:
        for b, v in r.stats.tokens_by_bucket.items():
            made[b] += v
    reqs = result.finished
    context = round(sum(r.req.prompt_tokens + r.req.output_tokens / 2 for r in reqs)
                    / max(len(reqs), 1)) or 1
    per_replica = lay.capacity_tokens_per_s(context)
    buckets = int(math.ceil(result.end_time / w))
    ready_at = {}
    for s in result.samples:
        ready_at.setdefault(int(s.t // w), s.ready)
    tokens, last_ready = [], cfg.replicas
    for b in range(buckets):
        t = (b + 0.5) * w
        last_ready = ready_at.get(b, last_ready)
        tokens += [{"hour": t / 3600, "series": "demand",
                    "tokens_per_s": trace.demand_tokens_per_s(t) if t <= trace.duration_s
                    else 0.0},
                   {"hour": t / 3600, "series": "delivered", "tokens_per_s": made[b] / w},
                   {"hour": t / 3600, "series": "capacity",
                    "tokens_per_s": last_ready * per_replica}]
    replicas = [row for s in result.samples for row in (
        {"hour": s.t / 3600, "state": "ready", "replicas": s.ready},
        {"hour": s.t / 3600, "state": "starting", "replicas": s.starting})]
    queue = [row for s in result.samples for row in (
        {"hour": s.t / 3600, "state": "waiting", "requests": s.waiting},
        {"hour": s.t / 3600, "state": "running", "requests": s.running})]
    groups: dict[int, list] = defaultdict(list)
    for r in reqs:
        groups[int(r.arrival // w)].append(r)
    latency = []
    for b in sorted(groups):
        g = groups[b]
        ttft = [r.ttft for r in g]
        tpot = [r.tpot for r in g if r.tpot is not None]
        for metric, vals in (("TTFT", ttft), ("TPOT", tpot)):
            for q in (50, 99):
                v = percentile(vals, q)
                if not math.isnan(v):
                    latency.append({"hour": (b + 0.5) * w / 3600, "metric": metric,
                                    "percentile": f"p{q}", "seconds": v})
    return {"tokens": tokens, "replicas": replicas, "queue": queue, "latency": latency}


def behind(s: dict[str, Any]) -> str | None:
    """A sentence when the fleet fell behind its users: requests still queued when the
    arrivals stopped, and a drain after them longer than `BEHIND_SHARE` of their span (a
    fleet that keeps up drains in about one request's time); else None."""
    arrivals, end, waiting = s["arrivals_s"], s["simulated_s"], s["waiting_at_arrivals_end"]
    if not waiting or end - arrivals <= BEHIND_SHARE * arrivals:
        return None
    return (f"The fleet fell behind: {waiting:,} requests were still queued when arrivals "
            f"stopped, {fmt_seconds(arrivals)} into the run, and the last finished at "
            f"{fmt_seconds(end)}, so most of a TTFT of {fmt_seconds(s['ttft_p50_s'])} (p50) "
            f"is time in the queue. More replicas at the start, or an autoscaler, keep up "
            f"with this demand.")


def format_summary(s: dict[str, Any]) -> str:
    """The summary as `batchlens fleet` prints it."""
    lines = [
        f"{s['trace']} on {s['layout']}, router {s['router']}: "
        f"{s['simulated_s'] / 3600:.2f} simulated hours in {s['wall_s']:.1f} s "
        f"({s['cpu_s']:.1f} s of CPU; {s['steps']:,} engine steps)",
        f"requests {s['requests']:,}: {s['finished']:,} finished, {s['dropped']:,} dropped; "
        f"{s['output_tokens']:,} output tokens, {s['throughput_tokens_per_s']:,.0f} tokens/s",
        f"TTFT p50 {fmt_seconds(s['ttft_p50_s'])}, p99 {fmt_seconds(s['ttft_p99_s'])}; "
        f"TPOT p50 {fmt_seconds(s['tpot_p50_s'])}, p99 {fmt_seconds(s['tpot_p99_s'])}",
        f"replicas: peak {s['peak_replicas']}, {s['replicas_added']} used, "
        f"{s['scale_events']} scaling events; prefix-cache hit rate "
        f"{s['prefix_hit_rate']:.1%}; {s['preemptions']} preemptions",
        f"{s['gpu_hours']:,.1f} GPU-hours, ${s['cost_dollars']:,.2f}: "
        f"${s['dollars_per_million_tokens']:,.3f} per million tokens; "
        f"{s['energy_kwh']:,.2f} kWh, {s['joules_per_token']:.3f} J per token",
    ]
    if loc := s.get("local"):
        lines.append(
            f"the same users on their own PCs: {loc['pcs']:,} x {loc['device_name']}, "
            f"{loc['per_user_tokens_per_s']:.1f} tokens/s each (roofline, {loc['bound']}-bound),"
            f" {loc['joules_per_token']:.2f} J per token at {loc['watts']:g} W")
    if note := behind(s):
        lines.append(note)
    return "\n".join(lines)
