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

from fleet.autoscaler import METRICS
from fleet.local_pcs import LOCAL_POWER
from fleet.report import format_summary
from fleet.router import ROUTERS
from fleet.scenarios import (
    AUTOSCALE_OFF,
    SCENARIOS,
    TRACES,
    FleetParams,
    Scenario,
    layout_choices,
    run_scenario,
)


def build_parser(prog: str) -> argparse.ArgumentParser:
    d = FleetParams()
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=list(SCENARIOS),
                    help="a named scenario, which sets the whole run (default: day, unless "
                    "other flags describe one)")
    ap.add_argument("--trace", choices=[t for t in TRACES if t != "csv"],
                    help="; ".join(f"{k}: {v}" for k, v in TRACES.items() if k != "csv"))
    ap.add_argument("--csv", metavar="FILE", help="a trace CSV, or an Arena / Sweep export")
    ap.add_argument("--tokens-per-s", type=float, default=d.tokens_per_s, help="demand (peak)")
    ap.add_argument("--hours", type=float, default=d.hours, help="simulated hours (not --csv)")
    ap.add_argument("--shared-prompt", action="store_true",
                    help="every request starts with one of 4 shared 600-token system prompts")
    ap.add_argument("--layout", default=d.layout,
                    help="this machine, a roofline replica or a projected layout (as listed "
                    "by --list-layouts)")
    ap.add_argument("--list-layouts", action="store_true", help="print the layouts and exit")
    ap.add_argument("--router", choices=ROUTERS, default=d.router)
    ap.add_argument("--replicas", type=int, default=d.replicas, help="replicas at the start")
    ap.add_argument("--autoscale", choices=METRICS, help="scale on this metric")
    ap.add_argument("--target", type=float, default=d.target, help="the metric's target")
    ap.add_argument("--max-replicas", type=int, default=d.max_replicas)
    ap.add_argument("--storage-gbs", type=float, default=d.storage_gbs,
                    help="weights load speed (GB/s) of a cold start")
    ap.add_argument("--start-s", type=float, default=d.start_s,
                    help="fixed seconds of a cold start")
    ap.add_argument("--local-device", choices=list(LOCAL_POWER), default=d.local_device)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


# flags a named scenario leaves as they are (the others are the scenario's own)
SCENARIO_FLAGS = frozenset({"scenario", "json", "list_layouts", "local_device"})


def scenario_from_args(a: argparse.Namespace, ap: argparse.ArgumentParser) -> Scenario:
    """A named scenario (`--scenario`, or "day" when no other flag is given), else the
    scenario the flags describe. A named scenario is a whole run: a flag it would ignore
    is a ValueError."""
    given = [f"--{k.replace('_', '-')}" for k, v in vars(a).items()
             if k not in SCENARIO_FLAGS and v != ap.get_default(k)]
    if a.scenario and given:
        raise ValueError(f"--scenario {a.scenario} sets the whole run: drop "
                         f"{', '.join(given)}, or drop --scenario")
    if a.scenario or not given:
        return SCENARIOS[a.scenario or "day"]()
    params = FleetParams(
        trace="csv" if a.csv else a.trace or FleetParams().trace,
        tokens_per_s=a.tokens_per_s, hours=a.hours, shared_prompt=a.shared_prompt, seed=a.seed,
        csv_text=Path(a.csv).read_text() if a.csv else None, layout=a.layout,
        router=a.router, replicas=a.replicas, autoscale=a.autoscale or AUTOSCALE_OFF,
        target=a.target, max_replicas=a.max_replicas, storage_gbs=a.storage_gbs,
        start_s=a.start_s, local_device=a.local_device)
    return params.scenario()


def main(argv: list[str] | None = None, prog: str = "batchlens fleet") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        from fleet import check

        return check.main(argv[1:], prog=f"{prog} check")
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    if a.list_layouts:
        print("\n".join(layout_choices()))
        return 0
    try:
        scenario = scenario_from_args(a, ap)
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    t0 = time.perf_counter()
    def show(share: float) -> None:
        print(f"\r  simulated {share:.0%} of the output tokens", end="", file=sys.stderr,
              flush=True)

    s, _ = run_scenario(scenario, a.local_device, None if a.json else show)
    if not a.json:
        print(file=sys.stderr)
    s["wall_s"] = time.perf_counter() - t0
    print(json.dumps(s, indent=2) if a.json else format_summary(s))
    return 0
