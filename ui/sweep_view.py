"""The sweep page's parts: controls, the live progress and charts, goodput under SLOs, the
connected-vs-active calculator, and the table with its CSV.

    controls()  -> Run: Sweep(shared engine, LocalPC on the same weights), in the job slot
    live()      -> a fragment that reruns while the sweep runs; reads sweep.snapshot() only

The sweep runs on its own thread (`workloads.sweep.Sweep`); every figure shown comes from its
points (engine.metrics) or from measure.hardware (the roofline of this machine, measured by
measure.calibrate). Chart dicts are built once per new point, not on every refresh, so the
page takes little CPU from the measurement.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import altair as alt
import pandas as pd
import streamlit as st

from engine.engine import Engine
from engine.local import LocalPC
from measure.hardware import aggregate_tokens_per_s
from measure.roofline import Roofline, model_profile_key, roofline, user_grid
from measure.units import fmt_number, fmt_seconds
from server.remote import RemoteSide
from ui import clicker, endpoints, hosting, inputs, method, presenter, server_charts, shared
from ui import sweep_charts as charts
from ui.hardware_view import this_machine
from ui.job_slot import HEARTBEAT_S, SLOW_REFRESH_S, JobSlot
from ui.palette import DATACENTER, LOCAL
from workloads.job import ENGINE_CHANGED
from workloads.prompts import Chat, chat, load_prompts
from workloads.sides import LABELS, count
from workloads.sweep import (
    DEFAULT_DURATION_S,
    DEFAULT_MAX_TOKENS,
    DEFAULT_RATES,
    DEFAULT_USERS,
    Sweep,
    SweepPlan,
    SweepSnapshot,
    rows,
)

# redrawn less often than the arena: the CPU is busy measuring the sweep's points
SLOT: JobSlot[Sweep] = JobSlot("sweep_run", refresh_s=SLOW_REFRESH_S,
                               heartbeat_s=2 * HEARTBEAT_S)
KEY_CHARTS = "sweep_chart_specs"
PAGE_WAIT_S = 10.0  # the most the first point waits for the page to draw the sweep once
USER_OPTIONS = [1, 2, 4, 8, 16, 32, 64, 128]
RATE_OPTIONS = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
MODES = {"users": "Concurrent users (all send at once)",
         "rate": "Poisson arrivals (requests/s)"}
PROMPTS = ("Varied short prompts", "One prompt for everyone")
UNITS = {"users": "users", "rate_rps": "requests/s"}
MAX_TOKENS = 256  # per request, the page's range (the admin's caps may be lower)
PRESENTER_CHART_PX = 240  # the four charts' height in presenter mode: a row on one screen


def intro() -> None:
    st.header("Sweep: add users, watch total speed")
    st.caption("The same short requests at more and more users. Batching turns extra users "
               "into extra total tokens/s; serving one user at a time cannot.")


# ---- controls ------------------------------------------------------------------------
def controls() -> None:
    """Load, max tokens, prompts, Run and Stop; disabled while a sweep runs. In presenter
    mode the settings fold into a closed expander, so the charts are on the first screen,
    and the clicker's next key runs the sweep."""
    running = SLOT.inputs_disabled()
    if presenter.is_on():
        with st.expander("Sweep settings"):
            _settings(running)
        st.caption("Clicker: PageDown or → runs the sweep as set.")
        if (clicker.pick(("sweep",), "sweep" if SLOT.job else None, clicker.step())
                and not running and _plan()[0] is not None):
            _on_run()
            st.rerun()
    else:
        _settings(running)
    plan, error = _plan()
    hint = SLOT.buttons("sweep_stop", on_run=_on_run, run_key="sweep_run_button",
                        run_label="Run sweep", run_disabled=plan is None)
    if plan is not None:
        hint.caption(f"{count(plan.num_requests, 'request')} per side, "
                     f"{count(plan.max_tokens, 'token')} each; at each load the datacenter "
                     "runs first, then the local PC: never both at once.")
    else:
        hint.caption(error)
    SLOT.show_error()


def _settings(running: bool) -> None:
    """The sweep's settings: load, max tokens, prompts, endpoints."""
    ss = st.session_state
    ss.setdefault("sweep_prompt", next(iter(load_prompts().presets.values())))
    left, right = st.columns([3, 2], gap="large")
    with left:
        mode = st.radio("Load", list(MODES), format_func=MODES.get, key="sweep_mode",
                        horizontal=True, disabled=running)
        if mode == "users":
            st.multiselect("Concurrent users", USER_OPTIONS, default=list(DEFAULT_USERS),
                           key="sweep_users", disabled=running)
        else:
            a, b = st.columns([3, 2])
            a.multiselect("Arrival rates (requests/s)", RATE_OPTIONS,
                          default=list(DEFAULT_RATES), key="sweep_rates", disabled=running)
            b.slider("Arrivals for (s)", 2, 60, int(DEFAULT_DURATION_S), key="sweep_duration",
                     disabled=running)
    with right:
        inputs.whole_number("Max tokens per request", 1, MAX_TOKENS, DEFAULT_MAX_TOKENS,
                            key="sweep_max_tokens", disabled=running,
                            help="Every request makes exactly this many tokens (EOS ignored).")
        one = st.radio("Prompts", PROMPTS, key="sweep_prompts", horizontal=True,
                       disabled=running) == PROMPTS[1]
        if one:
            st.text_area("Prompt", key="sweep_prompt", height=90, disabled=running)
        endpoints.pickers("sweep", running)


def _plan() -> tuple[SweepPlan | None, str]:
    """The sweep the controls describe, or None and why not."""
    ss = st.session_state
    bad = inputs.range_error("Max tokens per request",
                             ss.get("sweep_max_tokens", DEFAULT_MAX_TOKENS), 1, MAX_TOKENS)
    if bad:
        return None, "Fix the number above to enable Run sweep."
    try:
        if ss.get("sweep_mode", "users") == "users":
            levels = tuple(int(u) for u in ss.get("sweep_users", DEFAULT_USERS))
            plan = SweepPlan("users", levels, int(ss.get("sweep_max_tokens",
                                                           DEFAULT_MAX_TOKENS)))
        else:
            levels = tuple(float(r) for r in ss.get("sweep_rates", DEFAULT_RATES))
            plan = SweepPlan("rate", levels, int(ss.get("sweep_max_tokens", DEFAULT_MAX_TOKENS)),
                             float(ss.get("sweep_duration", DEFAULT_DURATION_S)))
    except ValueError as exc:
        return None, f"Not ready: {exc}"
    if ss.get("sweep_prompts") == PROMPTS[1] and not ss.get("sweep_prompt", "").strip():
        return None, "Type a prompt (or choose varied prompts) to enable Run."
    return plan, ""


def _on_run() -> None:
    ss = st.session_state
    plan, _ = _plan()
    if plan is None:
        return
    one = ss.get("sweep_prompts") == PROMPTS[1]
    prompts = [chat(ss["sweep_prompt"])] if one else [chat(t) for t in load_prompts().others]
    engine = shared.shared_engine().engine
    if model_profile_key(engine.loaded.model.arch) is not None:
        this_machine(engine.loaded.model.device.type)  # measured now, not during the sweep
    if SLOT.start(lambda: _sweep(engine, prompts, plan)) is not None:
        ss.pop(KEY_CHARTS, None)


def _sweep(engine: Engine, prompts: list[Chat], plan: SweepPlan) -> Sweep:
    """A sweep on the shared engine (or a configured remote datacenter) and a local PC of
    its own (or a configured remote one), the sides it built shut down with the sweep.
    Raises `ValueError` (nothing left running) on an impossible setting, an endpoint that
    does not answer, a point over the admin's caps, or a shared engine whose queue is full."""
    caps = hosting.caps()
    caps.check(max(len(plan.arrivals(level)) for level in plan.levels), plan.max_tokens,
               "sweep point")
    with endpoints.sides("sweep", engine, lambda: LocalPC(engine.loaded)) as (dc, local,
                                                                               remote_dc):
        if not remote_dc:
            caps.check_queue(dc)
        return Sweep(dc, local, prompts, plan, heartbeat_timeout=SLOT.heartbeat_s,
                     close_local=True, close_engine=remote_dc,
                     connected=shared.session_connected(), page_wait_s=PAGE_WAIT_S)


# ---- the live view -------------------------------------------------------------------
def live() -> None:
    """Progress, charts, goodput, the calculator and the table; refreshed while running."""
    SLOT.live(_live_view)


def _live_view(sweep: Sweep | None) -> None:
    snap = None
    if sweep is None:
        st.info("Pick the loads and press Run sweep. The charts fill in point by point.")
    else:
        snap = sweep.snapshot()
        progress(snap, sweep)
    x = sweep.plan.load_column if sweep else "users"
    points = charts.points_frame(rows(snap.points, sweep.plan) if snap else [])
    headline(points, x)
    main_charts(sweep, snap, points, x)
    remote_servers(sweep)
    slo = goodput_section(sweep, snap, x)
    calculator(points, x)
    table(sweep, snap, slo)


def progress(snap: SweepSnapshot, sweep: Sweep) -> None:
    """The progress bar and, at the end, how the sweep ended. In presenter mode a finished
    sweep's sentence takes the bar's place, one line long, so the charts below it stay on
    a 1280x720 screen."""
    total = 2 * len(sweep.plan.levels)
    if not snap.finished:
        text = (f"Point {len(snap.points) + 1} of {total}: {_current(snap, sweep)} · "
                f"{fmt_seconds(snap.elapsed)}")
        st.progress(snap.progress, text=text)
        return
    done = snap.phase == "done" and not snap.error
    if not (done and presenter.is_on()):
        st.progress(snap.progress, text=f"{len(snap.points)} of {total} points in "
                                        f"{fmt_seconds(snap.elapsed)}")
    if snap.error and snap.error.startswith(ENGINE_CHANGED):
        st.warning(f"{snap.error} The points measured before are below.")
    elif snap.error:
        st.error(f"The sweep ended with an error: {snap.error}")
    elif snap.phase == "abandoned":
        st.warning("Abandoned: the page stopped refreshing, so the sweep cancelled its "
                   "requests. The points measured so far are below.")
    elif snap.phase == "stopped":
        st.warning(f"Stopped after {len(snap.points)} of {count(total, 'point')}: the "
                   "requests in flight were cancelled and their KV blocks freed.")
    else:
        with st.container(key="sweep-summary"):
            st.success(summary_sentence(charts.points_frame(rows(snap.points, sweep.plan)),
                                        sweep.plan.load_column, short=presenter.is_on()))


def _current(snap: SweepSnapshot, sweep: Sweep) -> str:
    """The side and load being measured, in words."""
    if snap.current is None:
        return "starting"
    side, level = snap.current
    if sweep.plan.load_column == "users":
        return f"{LABELS[side]}, {count(int(level), 'user')}"
    return f"{LABELS[side]}, {level:g} {UNITS[sweep.plan.load_column]}"


def _side(points: pd.DataFrame, name: str) -> pd.DataFrame:
    return points[points["side"] == name] if not points.empty else points


def summary_sentence(points: pd.DataFrame, x: str, short: bool = False) -> str:
    """One sentence from the measured points: how each side's total moved with load
    (`short`: without the clause on why the local PC stays flat, for one line)."""
    dc, loc = _side(points, DATACENTER), _side(points, LOCAL)
    if dc.empty or loc.empty:
        return "Done."
    y, unit = "throughput_tokens_per_s", UNITS[x]
    first, last = dc.iloc[0], dc.iloc[-1]
    verb = "rose" if last[y] > first[y] else "went"
    local = "the local PC's" if short else "the local PC, serving one user at a time,"
    return (f"From {first[x]:g} to {last[x]:g} {unit}, the datacenter's total {verb} from "
            f"{fmt_number(first[y])} to {fmt_number(last[y])} tokens/s "
            f"({last[y] / first[y]:.1f}x); {local} stayed "
            f"between {fmt_number(loc[y].min())} and {fmt_number(loc[y].max())} tokens/s.")


def headline(points: pd.DataFrame, x: str) -> None:
    """Best datacenter total, the local range, and the ratio at the largest shared load."""
    a, b, c = st.columns(3)
    dc, loc = _side(points, DATACENTER), _side(points, LOCAL)
    y, unit = "throughput_tokens_per_s", UNITS[x]
    if dc.empty:
        a.metric("Best datacenter tokens/s", "—")
    else:
        best = dc.loc[dc[y].idxmax()]
        a.metric(f"Best datacenter tokens/s ({best[x]:g} {unit})",
                 fmt_number(best[y]))
    b.metric("Local PC, total tokens/s",
             "—" if loc.empty else f"{fmt_number(loc[y].min())}–{fmt_number(loc[y].max())}")
    both = pd.merge(dc[[x, y]], loc[[x, y]], on=x, suffixes=("_dc", "_loc")) if not (
        dc.empty or loc.empty) else pd.DataFrame()
    if both.empty:
        c.metric("Datacenter ÷ local PC", "—")
    else:
        top = both.iloc[-1]
        c.metric(f"Datacenter ÷ local PC at {top[x]:g} {unit}",
                 f"{top[y + '_dc'] / top[y + '_loc']:.1f}x")


def _vega_cached(key: tuple, build: Callable[[], alt.TopLevelMixin]) -> dict:
    """A chart's Vega-Lite dict, built once per key (per new point), copied for each use."""
    cache = st.session_state.setdefault(KEY_CHARTS, {})
    if key not in cache:
        if len(cache) > 40:
            cache.clear()
        cache[key] = build().to_dict()
    return copy.deepcopy(cache[key])


def _roofline(sweep: Sweep | None) -> Roofline | None:
    """This machine's roofline over the sweep's user counts (users mode, known model)."""
    if (sweep is None or sweep.plan.mode != "users" or not isinstance(sweep.engine, Engine)
            or sweep.mean_prompt_tokens is None):
        return None  # a remote datacenter: its hardware is not this machine
    model = sweep.engine.loaded.model
    key = model_profile_key(model.arch)
    if key is None:
        return None
    profile_and_cal = this_machine(model.device.type)
    context = round(sweep.mean_prompt_tokens + sweep.plan.max_tokens / 2)
    return roofline(profile_and_cal[1], key, model.dtype, user_grid(sweep.plan.levels), context)


def main_charts(sweep: Sweep | None, snap: SweepSnapshot | None, points: pd.DataFrame,
                x: str) -> None:
    """Total and per-user tokens/s (roofline beneath), TTFT and end-to-end p50/p99."""
    roof = _roofline(sweep)
    roof_df = charts.roofline_frame(roof.rows) if roof else None
    key = (sweep.job_id if sweep else None, len(snap.points) if snap else 0)
    builders = [
        lambda: charts.throughput_chart(points, roof_df, x),
        lambda: charts.per_user_chart(points, roof_df, x),
        lambda: charts.latency_chart(charts.latency_frame(points, x, "ttft"), x,
                                     "Time to first token (TTFT)"),
        lambda: charts.latency_chart(charts.latency_frame(points, x, "e2e"), x,
                                     "End-to-end latency"),
    ]
    cells = [cell for _ in range(2) for cell in st.columns(2, gap="large")]
    for i, (cell, build) in enumerate(zip(cells, builders, strict=True)):
        cell.vega_lite_chart(spec=_vega_cached((*key, i), build), width="stretch",
                             height=presenter.figure_height(PRESENTER_CHART_PX))
    if roof is not None:
        st.caption(f"Dashed grey: the roofline ceiling of this machine from measure/hardware.py "
                   f"(decode only, SmolLM2-135M profile): {roof.note} Per user, the measured "
                   "figure includes time spent queueing; the roofline does not.")
    elif sweep is not None and sweep.plan.mode == "rate":
        st.caption("No roofline in rate mode: the batch is whatever the arrivals make it "
                   "(the mean_batch column of the table), not a setting.")
    elif sweep is not None:
        st.caption("No roofline: measure/hardware.py has no profile for this model's shape.")


def remote_servers(sweep: Sweep | None) -> None:
    """Each remote side's own server state over the sweep, from its /metrics (nothing when
    both sides run in this process)."""
    remote = [(LABELS[name], side) for name, side in
              (("datacenter", sweep.engine), ("local", sweep.local))
              if isinstance(side, RemoteSide)] if sweep is not None else []
    if not remote:
        return
    st.subheader("The remote servers' own state")
    for cell, (label, side) in zip(st.columns(len(remote), gap="large"), remote, strict=True):
        with cell:
            st.caption(f"{label[:1].upper()}{label[1:]}: {side.name or 'remote endpoint'}")
            server_charts.panel(side)


def goodput_section(sweep: Sweep | None, snap: SweepSnapshot | None,
                    x: str) -> tuple[float, float]:
    """SLO sliders and goodput per point and side; returns (TTFT SLO s, TPOT SLO s)."""
    st.subheader("Goodput: requests/s that meet your SLOs")
    left, right = st.columns([1, 2], gap="large")
    with left:
        ttft = st.slider("TTFT SLO (s)", 0.1, 30.0, 2.0, 0.1, key="sweep_ttft_slo")
        tpot_ms = st.slider("TPOT SLO (ms per token)", 10, 2000, 250, 10, key="sweep_tpot_slo")
        st.caption("A request counts when its TTFT and its TPOT are both within the SLOs; "
                   "goodput = such requests / the point's wall time (engine/metrics.py).")
    slo = (float(ttft), tpot_ms / 1e3)
    points = charts.points_frame(rows(snap.points, sweep.plan, *slo) if snap else [])
    key = (sweep.job_id if sweep else None, len(snap.points) if snap else 0, slo)
    right.vega_lite_chart(spec=_vega_cached(("goodput", *key),
                                            lambda: charts.goodput_chart(points, x)),
                          width="stretch")
    return slo


def calculator(points: pd.DataFrame, x: str) -> None:
    """Connected users × active share × tokens/s each, against the measured capacity."""
    st.subheader("Connected users are not active users")
    a, b, c = st.columns(3)
    connected = inputs.whole_number("Connected users", 1, 100_000_000, 1000,
                                    key="sweep_connected", where=a)
    share = b.slider("Active at any moment (%)", 1, 100, 10, key="sweep_active_pct")
    each = inputs.number("Tokens/s each active user needs", 0.5, 1000.0, 10.0, step=0.5,
                         key="sweep_each", where=c)
    if connected is None or each is None:
        return  # the box says what is allowed
    active = max(1, math.ceil(connected * share / 100))
    needed = aggregate_tokens_per_s(active, each)
    dc, loc = _side(points, DATACENTER), _side(points, LOCAL)
    y = "throughput_tokens_per_s"
    if dc.empty:
        st.info(f"{count(connected, 'connected user')}, {share}% active: "
                f"{count(active, 'request')} in flight needing {fmt_number(needed)} tokens/s. "
                "Run the sweep to measure "
                "what this machine can serve.")
        return
    best = dc.loc[dc[y].idxmax()]
    capacity = float(best[y])
    d, e, f, g = st.columns(4)
    d.metric("Active users", f"{active:,}")
    e.metric("Needed tokens/s", fmt_number(needed))
    f.metric("Measured tokens/s", fmt_number(capacity),
             help=f"The best datacenter total of the sweep, at {best[x]:g} {UNITS[x]}")
    g.metric("Machines like this one", f"{math.ceil(needed / capacity):,}")
    text = (f"{count(connected, 'connected user')} with {share}% active "
            f"{'is' if active == 1 else 'are'} {count(active, 'request')} in "
            f"flight: {active:,} × {fmt_number(each)} = {fmt_number(needed)} tokens/s. Only "
            f"active users draw on the machine, so the sizing is active users × tokens/s each, "
            f"not 1/{connected:,} of the machine per connected user: this machine's measured "
            f"{fmt_number(capacity)} tokens/s covers {capacity / needed:.0%} of it.")
    if not loc.empty:
        local_best = float(loc[y].max())
        text += (f" One user at a time, as the local PC serves ({fmt_number(local_best)} "
                 f"tokens/s), it would take "
                 f"{count(math.ceil(needed / local_best), 'machine')}.")
    st.write(text)
    if x == "users" and active > dc[x].max():
        st.caption(f"Measured up to {count(int(dc[x].max()), 'user')} at once; "
                   f"{count(active, 'active user')} is "
                   "beyond what this sweep measured, so the capacity is a measured figure, not "
                   "a projection for that batch.")


def table(sweep: Sweep | None, snap: SweepSnapshot | None, slo: tuple[float, float]) -> None:
    """Every point, goodput at the current SLOs, and its CSV."""
    if sweep is None or snap is None or not snap.points:
        return
    df = pd.DataFrame.from_records(rows(snap.points, sweep.plan, *slo))
    st.subheader("Every point")
    st.dataframe(df, hide_index=True, width="stretch")
    st.download_button("Download every point (CSV)", df.to_csv(index=False),
                       file_name="batchlens-sweep.csv", mime="text/csv", key="sweep_csv")


def how_measured() -> None:
    """The method, and this sweep's exact set-up once there is one."""
    sweep = SLOT.job
    method.panel("At each load the datacenter engine runs the requests first, then the local "
                 "PC runs the same requests, each with every CPU thread, never both at once. "
                 "TTFT, TPOT, end-to-end latency, tokens/s and goodput come from the same "
                 "code for both sides (engine/metrics.py), from monotonic timestamps. Total "
                 "tokens/s = output tokens / (first arrival → last token); tokens/s each user "
                 "gets = a request's tokens / its end-to-end latency, queueing included.",
                 method.sweep_setup(sweep) if sweep is not None else None)
