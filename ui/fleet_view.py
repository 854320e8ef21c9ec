"""The Fleet page's parts: a day of a service on a simulated clock, replicas behind a
router, an autoscaler adding them with a cold start, and the same users each on a PC.

    scenario()  -> FleetParams | None   the presenter's "a day of a 1,000-user service"
    controls()  -> FleetParams | None   trace, layout, router, autoscaler; None until Run
    results(p)                          runs it (progress bar), then the figures and charts

The simulation is pure CPU and deterministic (seeded), so a finished run is kept for the
whole process by its parameters: the same choices give the same figures at once, in every
session. Every figure comes from `fleet.report`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pandas as pd
import streamlit as st

from fleet import store
from fleet.autoscaler import METRICS
from fleet.local_pcs import LOCAL_POWER
from fleet.report import behind
from fleet.router import ROUTERS
from fleet.scenarios import (
    AUTOSCALE_OFF,
    TRACES,
    FleetParams,
    Scenario,
    day_of_1000_users,
    layout_choices,
    run_scenario,
)
from measure.hardware import HARDWARE
from measure.units import fmt_seconds
from ui import fleet_charts as charts
from ui import presenter

K = "fleet_"
KEY_RUN, KEY_SCENARIO = K + "params", K + "scenario"
ROUTER_NAMES = {"round_robin": "round robin", "least_outstanding": "least outstanding",
                "prefix_aware": "prefix aware"}
METRIC_NAMES = {AUTOSCALE_OFF: "off (fixed replicas)", "queue": "queue length per replica",
                "kv": "KV usage", "ttft_p99": "TTFT p99 (s)"}
_RESULTS: dict[Any, tuple[dict[str, Any], dict[str, list]]] = {}
_LOCK = threading.Lock()
DAY_KEY = "presenter day"
# the presenter's day; BATCHLENS_FLEET_DAY_HOURS shortens it for a page's layout tests,
# which need its charts, not the whole day's minutes of simulation
DAY_HOURS = float(os.environ.get("BATCHLENS_FLEET_DAY_HOURS", "24"))


PRESENTER_CHART_PX = 280  # the first row of charts' height in presenter mode: on one screen


def intro() -> None:
    st.header("A day of a service")
    if presenter.is_on():  # the scenario's line under its button says what it shows
        return
    st.markdown(
        "Requests arrive through a simulated day; a router spreads them over replicas, "
        "each batching continuously over a paged KV cache; an autoscaler adds replicas, "
        "which serve only after their **cold start** (loading the weights). Step times "
        "come from the live engine's measured steps (*this machine*), the datacenter "
        "projection's measured kernels, or the roofline. Beside it: the same users, "
        "each on a PC of their own.")


LATENCY_FIGURES = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "tpot_p50_s": "TPOT p50",
                   "tpot_p99_s": "TPOT p99"}  # the summary's keys and their labels
DAY_LABEL = "A day of a 1,000-user service"  # the presenter's button
IDLE = "Pick a trace, a layout, a router and an autoscaler, then **Run**."
# presenter mode: the form and its Run sit in the Settings popover, beside the day's button
IDLE_PRESENTER = (f"Press **{DAY_LABEL}**, or pick your own trace, replicas and autoscaler "
                  "under **Settings**, then **Run**.")
DAY_HELP = ("Scripted: 1,000 connected, 200 active, 20 tokens/s each, through a day with a "
            "launch burst; Llama-3.1-70B on 8×H100 replicas")


def scenario() -> tuple[bool, Any]:
    """The presenter's button; True once it was pressed in this session. In presenter
    mode it sits in a row with a Settings popover, returned for `controls()` (else None)."""
    on = presenter.is_on()
    settings = None
    if on:
        st.caption("1,000 connected users, 200 active, 20 tokens/s each, through a day with "
                   "a launch burst; Llama-3.1-70B on 8×H100 replicas.")
        button, cell = st.columns([1, 1], vertical_alignment="center")
        settings = cell.popover("Settings: trace, replicas, autoscaler", width="stretch")
    else:
        button = st
    if button.button(DAY_LABEL, key=K + "day_button",
                     type="primary" if on else "secondary", help=DAY_HELP,
                     width="stretch" if on else "content"):
        st.session_state[KEY_SCENARIO] = True
        st.session_state.pop(KEY_RUN, None)
    return bool(st.session_state.get(KEY_SCENARIO)), settings


def controls(where: Any = None) -> FleetParams | None:
    """The choices, and Run; the parameters of the last Run (None before one). `where`:
    the container the form goes in (presenter mode: the scenario's Settings popover)."""
    d = FleetParams()
    with where if where is not None else st.container(), st.form(K + "form", border=True):
        a, b, c = st.columns(3, gap="large")
        with a:
            st.markdown("**Trace**")
            trace = st.selectbox("Demand", list(TRACES), format_func=TRACES.get,
                                 index=list(TRACES).index(d.trace), key=K + "trace")
            tps = st.number_input("Output tokens/s (peak)", 10.0, 1e6, d.tokens_per_s,
                                  step=500.0, key=K + "tokens_per_s")
            hours = st.number_input("Simulated hours", 0.05, 24.0, d.hours, step=0.25,
                                    key=K + "hours")
            shared = st.checkbox("Shared system prompts (4 × 600 tokens)", key=K + "shared")
            upload = st.file_uploader("CSV", type=["csv"], key=K + "csv")
        with b:
            st.markdown("**Replicas**")
            names = list(layout_choices())
            layout = st.selectbox("Layout", names, index=names.index(d.layout),
                                  key=K + "layout")
            router = st.radio("Router", ROUTERS, format_func=ROUTER_NAMES.get,
                              index=ROUTERS.index(d.router), key=K + "router")
            replicas = st.number_input("Replicas at the start", 1, 64, d.replicas,
                                       key=K + "replicas")
            local = st.selectbox("Local PC beside it", list(LOCAL_POWER), key=K + "local",
                                 format_func=lambda k: HARDWARE[k].name)
        with c:
            st.markdown("**Autoscaler**")
            metric = st.selectbox("Scale on", [AUTOSCALE_OFF, *METRICS],
                                  format_func=METRIC_NAMES.get, key=K + "metric")
            target = st.number_input("Target", 0.01, 1e4, d.target, key=K + "target")
            top = st.number_input("Max replicas", 1, 64, d.max_replicas, key=K + "max")
            storage = st.number_input("Storage bandwidth (GB/s)", 0.1, 100.0, d.storage_gbs,
                                      key=K + "storage")
            start = st.number_input("Fixed start time (s)", 0.0, 3600.0, d.start_s,
                                    key=K + "start")
        run = st.form_submit_button("Run", type="primary")
    if run:
        try:
            params = FleetParams(
                trace=trace, tokens_per_s=float(tps), hours=float(hours),
                shared_prompt=bool(shared),
                csv_text=upload.getvalue().decode() if upload is not None else None,
                layout=layout, router=router, replicas=int(replicas), autoscale=metric,
                target=float(target), max_replicas=int(top), storage_gbs=float(storage),
                start_s=float(start), local_device=local)
            params.scenario()  # checks every choice now: a readable message, not a trace
        except ValueError as exc:
            st.error(f"Not started: {exc}")
            return None
        st.session_state[KEY_RUN] = params
        st.session_state[KEY_SCENARIO] = False
    return st.session_state.get(KEY_RUN)


def _run(key: Any, make: Any, local_device: str) -> tuple[dict[str, Any], dict[str, list]]:
    """The run of `key`, from the process-wide cache (the presenter's day also from disk,
    fleet/store.py) or simulated now with a progress bar."""
    with _LOCK:
        if key in _RESULTS:
            return _RESULTS[key]
    bar = st.progress(0.0, text="Simulating ...")
    scenario: Scenario = make()

    def show(share: float) -> None:
        bar.progress(min(share, 1.0), text=f"Simulating ... {share:.0%} of the output tokens")

    # the day is seeded and on measured kernels: the same run on every machine, kept on disk
    if isinstance(key, tuple) and key[0] == DAY_KEY:
        out = store.stored_run(repr((key, local_device)),
                               lambda: run_scenario(scenario, local_device, show))
    else:  # "this machine" layouts depend on this machine's measured steps
        out = run_scenario(scenario, local_device, show)
    bar.empty()
    with _LOCK:
        _RESULTS[key] = out
    return out


def results(params: FleetParams | None, day: bool) -> None:
    """The run's figures and charts (the presenter's day when `day`)."""
    if day:
        hours = DAY_HOURS
        s, series = _run((DAY_KEY, hours), lambda: day_of_1000_users(hours * 3600),
                         "laptop_cpu")
    elif params is not None:
        s, series = _run(params, params.scenario, params.local_device)
    else:
        st.info(IDLE_PRESENTER if presenter.is_on() else IDLE)
        return
    if presenter.is_on():  # the headline figures and the first charts on one screen
        summary(s, costs=False)
        charts_block(series)
        cost_row(s)
    else:
        summary(s)
        charts_block(series)
    local_block(s)


def summary(s: dict[str, Any], costs: bool = True) -> None:
    """The run in one line, its latency and throughput figures, then (`costs`) its cost
    figures."""
    st.markdown(f"**{s['trace']}** on **{s['layout']}**, router "
                f"{ROUTER_NAMES.get(s['router'], s['router'])}: {s['requests']:,} requests "
                f"over {s['simulated_s'] / 3600:.2f} simulated hours "
                f"(simulated in {s['wall_s']:.1f} s).")
    head = st.container(key="fleet-headline")
    if presenter.is_on():  # one row across the projector's screen, above the charts
        cols = head.columns(4)
        cols[0].metric("TTFT p50 / p99",
                       f"{fmt_seconds(s['ttft_p50_s'])} / {fmt_seconds(s['ttft_p99_s'])}")
        cols[1].metric("TPOT p50 / p99",
                       f"{fmt_seconds(s['tpot_p50_s'])} / {fmt_seconds(s['tpot_p99_s'])}")
        cols[2].metric("Throughput", f"{s['throughput_tokens_per_s']:,.0f} tokens/s")
        cols[3].metric("Finished / dropped", f"{s['finished']:,} / {s['dropped']:,}")
    else:  # beside the sidebar a quarter of a laptop screen holds one figure, not two
        with head:
            cols = presenter.metric_columns(7, 4)
        for col, (key, label) in zip(cols[:4], LATENCY_FIGURES.items(), strict=True):
            col.metric(label, fmt_seconds(s[key]))
        cols[4].metric("Throughput (tokens/s)", f"{s['throughput_tokens_per_s']:,.0f}")
        cols[5].metric("Finished", f"{s['finished']:,}")
        cols[6].metric("Dropped", f"{s['dropped']:,}")
    if note := behind(s):
        st.warning(note, icon=":material/hourglass_bottom:")
    if costs:
        cost_row(s)


def cost_row(s: dict[str, Any]) -> None:
    cols = st.columns(4)
    cols[0].metric("GPU-hours", f"{s['gpu_hours']:,.1f}")
    cols[1].metric("Cost per million tokens", f"${s['dollars_per_million_tokens']:,.3f}")
    cols[2].metric("Energy per token", f"{s['joules_per_token']:.3f} J")
    cols[3].metric("Prefix-cache hit rate", f"{s['prefix_hit_rate']:.0%}")


def charts_block(series: dict[str, list]) -> None:
    """Demand vs capacity and the replicas (sized with presenter.figure_height: the first
    screen), then latency and the queue."""
    left, right = st.columns(2, gap="large")
    height = presenter.figure_height(PRESENTER_CHART_PX)
    left.container(key="fleet-tokens-chart").altair_chart(charts.tokens_chart(charts.frame(
        series["tokens"], ["hour", "series", "tokens_per_s"])), width="stretch",
        height=height)
    right.container(key="fleet-replicas-chart").altair_chart(
        charts.replicas_chart(charts.frame(series["replicas"], ["hour", "state", "replicas"])),
        width="stretch", height=height)
    left, right = st.columns(2, gap="large")
    left.altair_chart(charts.latency_chart(charts.frame(
        series["latency"], ["hour", "metric", "percentile", "seconds"])),
        width="stretch")
    right.altair_chart(charts.queue_chart(charts.frame(
        series["queue"], ["hour", "state", "requests"])), width="stretch")


def local_block(s: dict[str, Any]) -> None:
    loc = s["local"]
    st.subheader("The same users, each on a PC of their own")
    cols = st.columns(3)
    cols[0].metric("PCs", f"{loc['pcs']:,}", help="one per connected user (for a trace "
                   "without users: one per request answering at the busiest moment, each "
                   "on its own PC at its speed)")
    cols[1].metric("Speed per user (tokens/s)", f"{loc['per_user_tokens_per_s']:,.1f}",
                   help=f"{loc['device_name']}: roofline ceiling, {loc['bound']}-bound")
    cols[2].metric("Energy per token", f"{loc['joules_per_token']:.2f} J",
                   help=f"{loc['watts']:g} W: {loc['power_source']}")
    per_user = 1 / s["tpot_p50_s"] if s["tpot_p50_s"] else 0.0
    df = pd.DataFrame([
        {"side": "fleet", "measure": "tokens/s per user", "value": per_user},
        {"side": loc["device_name"], "measure": "tokens/s per user",
         "value": loc["per_user_tokens_per_s"]},
        {"side": "fleet", "measure": "joules per token", "value": s["joules_per_token"]},
        {"side": loc["device_name"], "measure": "joules per token",
         "value": loc["joules_per_token"]}])
    st.altair_chart(charts.local_chart(df), width="stretch")


def how_simulated() -> None:
    with st.expander("How it is simulated"):
        st.markdown(
            "Each replica runs the engine's scheduling policy (continuous batching, "
            "chunked prefill, FCFS admission, preemption of the newest request when blocks "
            "run out) over the engine's own KV manager (`engine/kv_cache.py`: paged "
            "blocks, prefix caching with LRU eviction). Identical decode steps between "
            "events are advanced together. `batchlens fleet check` replays `batchlens "
            "bench`'s request mix and a Sweep on one simulated replica of this machine "
            "beside the live engine; `docs/fleet.md` has the details.")
