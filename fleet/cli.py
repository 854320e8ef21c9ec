"""`batchlens fleet`: the fleet simulation headless, its summary printed (or `--json`).

    batchlens fleet                      the presenter's day of a 1,000-user service
    batchlens fleet --scenario speed     an hour of 4,000 tokens/s on 8 replicas (timed)
    batchlens fleet --trace steady --tokens-per-s 3000 --hours 1 --replicas 4
    batchlens fleet --csv FILE           a trace, or the Arena's / the Sweep's CSV export
    batchlens fleet check                the simulation against the live engine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fleet.autoscaler import METRICS, AutoscalerConfig
from fleet.layouts import builtin_layouts
from fleet.local_pcs import LOCAL_POWER, local_fleet
from fleet.report import format_summary, summary
from fleet.router import ROUTERS
from fleet.scenarios import SCENARIOS, Scenario
from fleet.sim import FleetConfig, simulate
from fleet.trace import PRESET_1000, LengthMix, connected_users, poisson_day, read_csv, steady

TRACES = ("preset", "day", "steady")


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=list(SCENARIOS),
                    help="a named scenario (default: day, unless --trace or --csv is given)")
    ap.add_argument("--trace", choices=TRACES, help="preset: 1,000 connected, 200 active, "
                    "20 tokens/s each; day: a daily curve peaking at --tokens-per-s; steady")
    ap.add_argument("--csv", metavar="FILE", help="a trace CSV, or an Arena / Sweep export")
    ap.add_argument("--tokens-per-s", type=float, default=4000.0, help="demand (peak)")
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours (not --csv)")
    ap.add_argument("--layout", choices=list(builtin_layouts()), default="this machine")
    ap.add_argument("--router", choices=ROUTERS, default="least_outstanding")
    ap.add_argument("--replicas", type=int, default=1, help="replicas at the start")
    ap.add_argument("--autoscale", choices=METRICS, help="scale on this metric")
    ap.add_argument("--target", type=float, default=4.0, help="the metric's target")
    ap.add_argument("--max-replicas", type=int, default=16)
    ap.add_argument("--storage-gbs", type=float, default=2.0, help="weights load speed")
    ap.add_argument("--local-device", choices=list(LOCAL_POWER), default="laptop_cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def scenario_from_args(a: argparse.Namespace) -> Scenario:
    if a.scenario or not (a.trace or a.csv):
        return SCENARIOS[a.scenario or "day"]()
    layout = builtin_layouts()[a.layout]
    duration = a.hours * 3600
    if a.csv:
        trace = read_csv(Path(a.csv).read_text())
    elif a.trace == "preset":
        trace = connected_users(PRESET_1000, duration, seed=a.seed)
    elif a.trace == "day":
        trace = poisson_day(a.tokens_per_s, LengthMix(), duration_s=duration, seed=a.seed)
    else:
        trace = steady(a.tokens_per_s, duration, seed=a.seed)
    scaler = None
    if a.autoscale:
        scaler = AutoscalerConfig(metric=a.autoscale, target=a.target,
                                  max_replicas=max(a.max_replicas, a.replicas),
                                  storage_gbs=a.storage_gbs)
    config = FleetConfig(layout, replicas=a.replicas, router=a.router, autoscaler=scaler)
    return Scenario("custom", trace.name, trace, config)


def run(scenario: Scenario, local_device: str = "laptop_cpu",
        progress: bool = False) -> dict[str, Any]:
    """Simulate a scenario; its summary with the local-PC comparison beside it."""
    def show(share: float) -> None:
        print(f"\r  simulated {share:.0%}", end="", file=sys.stderr, flush=True)

    result = simulate(scenario.trace, scenario.config, show if progress else None)
    if progress:
        print(file=sys.stderr)
    s = summary(result)
    reqs = result.trace.requests
    context = round(sum(r.prompt_tokens + r.output_tokens / 2 for r in reqs) / len(reqs))
    users = (PRESET_1000.connected if "connected" in scenario.trace.name
             else max(s["peak_in_system"], 1))
    s["local"] = local_fleet(scenario.config.layout.model, local_device, users,
                             context).as_dict()
    return s


def main(argv: list[str] | None = None, prog: str = "batchlens fleet") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        from fleet import check

        return check.main(argv[1:], prog=f"{prog} check")
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    try:
        scenario = scenario_from_args(a)
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    t0 = time.perf_counter()
    s = run(scenario, a.local_device, progress=not a.json)
    s["wall_s"] = time.perf_counter() - t0
    print(json.dumps(s, indent=2) if a.json else format_summary(s))
    return 0
