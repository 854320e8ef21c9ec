"""The arena page's parts: controls, the two live columns, the charts and the results.

The race runs on its own thread (`workloads.race.Race`); the page only reads
`race.snapshot()` from a fragment that reruns a few times a second, never waiting on the
engine. Model output is shown with `st.code` (plain text), never as markdown or HTML.
"""

from __future__ import annotations

import copy
import os

import pandas as pd
import streamlit as st

from engine import SamplingParams
from engine.local import LocalPC
from measure.hardware import Emulation
from ui import charts, frames, shared
from ui.presets import load_presets, user_prompts
from workloads import scenarios
from workloads.race import Race, RaceSnapshot, SideView

KEY_RACE = shared.RACE_KEY
KEY_ERROR = "arena_error"
KEY_SHOWN_RUNNING = "arena_shown_running"
REFRESH_S = float(os.environ.get("BATCHLENS_REFRESH_S", "0.5"))  # live view, seconds
HEARTBEAT_S = 5.0
LOCAL_N_CTX = 2048
TITLES = {"local": "Local PC — one user at a time", "datacenter": "Datacenter — batched"}
OTHERS = ("varied prompts", "the same prompt")
KEY_SCENARIO = "arena_scenario"  # the scripted scenario last started, if any
NO_PACE = "this machine's real speed"
# Projections the local side can be paced to: (hardware, model, precision) in engine/hardware.py
EMULATIONS: dict[str, tuple[str, str, str] | None] = {
    NO_PACE: None,
    "Llama-2-7B fp16 on a laptop CPU (projected)": ("laptop_cpu", "llama-2-7b", "fp16"),
    "Llama-2-13B fp16 on an RTX 4090 (projected)": ("rtx4090", "llama-2-13b", "fp16"),
    "Llama-2-70B int4 on an M2 Max (projected)": ("m2_max", "llama-2-70b", "int4"),
    "Llama-2-70B int4 on a laptop CPU (projected)": ("laptop_cpu", "llama-2-70b", "int4"),
}


def current_race() -> Race | None:
    return st.session_state.get(KEY_RACE)


def is_running() -> bool:
    race = current_race()
    return race is not None and not race.finished


LIVE_CHARTS = (  # (builder, columns) per chart, in page order: 2 x 2
    (charts.tokens_chart, frames.tokens_columns),
    (charts.latency_chart, frames.latency_columns),
    (charts.kv_chart, frames.kv_columns),
    (charts.batch_chart, frames.batch_columns),
)
EMPTY = RaceSnapshot("waiting", 0.0, {s: SideView.idle(s) for s in ("local", "datacenter")},
                     [], [], [], [], False, None, None, None)


@st.cache_resource(show_spinner=False)
def chart_templates() -> list[dict]:
    """Every live chart's spec, built and validated once per process, so a refresh only
    sends new rows (and the first race is not timed while Altair loads its schema)."""
    return [charts.template(build(frames.as_frame(cols)(EMPTY))) for build, cols in LIVE_CHARTS]


def intro() -> None:
    chart_templates()
    st.header("Arena: the same prompt, many users, both sides")
    st.caption("Everyone sends at the same moment. The local PC answers one user at a time; "
               "the datacenter engine batches all of them into each step.")


# ---- controls ----------------------------------------------------------------------
def controls() -> None:
    """Prompt, users, max tokens, temperature, Run and Stop; disabled while a race runs."""
    ss, presets = st.session_state, load_presets()
    running = is_running()
    ss[KEY_SHOWN_RUNNING] = running
    ss.setdefault("arena_prompt", next(iter(presets.presets.values())))
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.selectbox("Preset prompts", list(presets.presets), index=None, key="arena_preset",
                     placeholder="Pick a preset...", on_change=_use_preset, disabled=running)
        st.text_area("Your prompt", key="arena_prompt", height=150, disabled=running)
    with right:
        a, b = st.columns(2)
        a.number_input("Users", 1, 64, 8, key="arena_users", disabled=running,
                       help="You plus others who press Enter at the same moment.")
        b.number_input("Max tokens", 1, 1024, 64, key="arena_max_tokens", disabled=running)
        st.slider("Temperature", 0.0, 1.5, 0.0, 0.1, key="arena_temperature", disabled=running)
        st.radio("The other users send", OTHERS, key="arena_others", horizontal=True,
                 disabled=running)
        st.checkbox("Put me last in line", key="arena_you_last", disabled=running)
        _local_device_choice(running)
        st.selectbox("Pace the local PC to", list(EMULATIONS), key="arena_pace",
                     disabled=running, help="Slow the local side down to the roofline "
                     "projection of a bigger model on consumer hardware (engine/hardware.py); "
                     "the label says so wherever its figures appear.")
    empty = not ss["arena_prompt"].strip()
    run, stop, hint = st.columns([1, 1, 5], vertical_alignment="center")
    run.button("Run", type="primary", key="arena_run", on_click=_on_run,
               disabled=running or empty, width="stretch")
    stop.button("Stop", key="arena_stop", on_click=_on_stop, disabled=not running,
                width="stretch")
    if empty:
        hint.caption("Type a prompt (or pick a preset) to enable Run.")
    error = ss.pop(KEY_ERROR, None)
    if error:
        st.error(error)


def _local_device_choice(running: bool) -> None:
    if shared.has_gpu():
        st.radio("Local PC runs on", ("cpu", "gpu"), key="arena_local_device", horizontal=True,
                 disabled=running, format_func=lambda d: {
                     "cpu": "CPU (a laptop's reality)", "gpu": "GPU, batch 1"}[d])
    else:
        st.caption("Local PC: this machine's CPU. Datacenter: the same CPU, batching.")


def _use_preset() -> None:
    name = st.session_state.get("arena_preset")
    if name:
        st.session_state["arena_prompt"] = load_presets().presets[name]


def _on_run() -> None:
    ss = st.session_state
    prompts, you = user_prompts(
        ss["arena_prompt"], int(ss["arena_users"]), ss["arena_others"] == OTHERS[0],
        bool(ss["arena_you_last"]), load_presets().others)
    try:
        params = SamplingParams(max_tokens=int(ss["arena_max_tokens"]),
                                temperature=float(ss["arena_temperature"]))
    except ValueError as exc:
        ss[KEY_ERROR] = f"Not started: {exc}"
        return
    start_race(prompts, params, you, EMULATIONS.get(ss.get("arena_pace", NO_PACE)))


def start_race(prompts: list, params: SamplingParams, you: int = 0,
               emulation: tuple[str, str, str] | None = None) -> None:
    """Start this session's race; a bad setting leaves a message instead."""
    ss, local = st.session_state, None
    try:
        loaded = shared.local_model(ss.get("arena_local_device", "cpu"))
        pacing = Emulation(*emulation) if emulation else None
        local = LocalPC(loaded, n_ctx=LOCAL_N_CTX, pacing=pacing)
        race = Race(shared.shared_engine().engine, local, prompts, params, you=you,
                    heartbeat_timeout=HEARTBEAT_S, close_local=True,
                    connected=shared.session_connected())
    except ValueError as exc:
        if local is not None:
            local.shutdown()
        ss[KEY_ERROR] = f"Not started: {exc}"
        return
    ss[KEY_RACE] = race.start()


def start_scenario(key: str) -> None:
    """Play a scripted scenario (engine/scenarios.py) in the arena: fixed prompts, greedy."""
    sc = scenarios.get(key)
    ss = st.session_state
    ss["arena_prompt"] = sc.prompts[0][-1]["content"]
    ss["arena_users"], ss["arena_max_tokens"] = sc.num_users, sc.max_tokens
    ss["arena_temperature"] = 0.0
    ss["arena_pace"] = next((k for k, v in EMULATIONS.items() if v == sc.emulation), NO_PACE)
    ss[KEY_SCENARIO] = key
    start_race([list(p) for p in sc.prompts], sc.params(0), 0, sc.emulation)


def _on_stop() -> None:
    race = current_race()
    if race is not None:
        race.stop()


# ---- the live view -----------------------------------------------------------------
def live() -> None:
    """Both columns, the charts and, at the end, the results; refreshed while running."""
    st.fragment(_live_view, run_every=REFRESH_S if is_running() else None)()


def _live_view() -> None:
    race = current_race()
    if race is None:  # the same layout, empty: pressing Run then only updates it
        st.info("Pick a prompt, set the number of users and press Run.")
        snap = EMPTY
    else:
        race.touch()
        snap = race.snapshot()
    local_col, dc_col = st.columns(2, gap="large")
    emulation = race.local.pacing if race is not None else None
    with local_col:
        side_panel(snap.sides["local"], snap, emulation.label if emulation else None)
    with dc_col:
        side_panel(snap.sides["datacenter"], snap)
    live_charts(snap)
    if snap.finished:
        results(snap)
        if st.session_state.get(KEY_SHOWN_RUNNING):
            st.session_state[KEY_SHOWN_RUNNING] = False
            st.rerun()  # a full rerun re-enables the inputs


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _side_state(view: SideView, snap: RaceSnapshot) -> str:
    if view.finished:
        return "Done."
    if snap.phase == "waiting":
        return "Ready."
    if not view.started:
        return ("Waiting: the two sides never run at once, so neither steals the other's "
                "cores." if not snap.finished else "Not run.")
    return "Running..." if not snap.finished else "Ended early."


def _place(view: SideView) -> str:
    return "—" if view.users_ahead_of_you is None else str(view.users_ahead_of_you)


def side_panel(view: SideView, snap: RaceSnapshot, note: str | None = None) -> None:
    """One side: live metrics and your answer as plain text; `note` labels an emulation."""
    with st.container(key=f"side-{view.side}", border=True):
        st.subheader(TITLES[view.side])
        if note:
            st.markdown(f":orange-badge[{note}]")
        st.caption(_side_state(view, snap))
        a, b, c = st.columns(3)
        a.metric("Your TTFT", f"{_num(view.your_ttft, '.2f')} s")
        b.metric("Your tokens/s", _num(view.your_tokens_per_s, ".1f"))
        c.metric("Total tokens/s", _num(view.total_tokens_per_s, ".1f"))
        d, e, f = st.columns(3)
        d.metric("Users finished", f"{view.users_finished}/{view.num_users}")
        e.metric("Elapsed", f"{view.elapsed:.1f} s")
        f.metric("Users ahead of you", _place(view))
        st.code(view.your_text or " ", language=None, wrap_lines=True, height=180)


def live_charts(snap: RaceSnapshot) -> None:
    """The four charts, two per row, redrawn from the templates with the snapshot's rows."""
    cells = [cell for _ in range(2) for cell in st.columns(2)]
    for cell, spec, (_, cols) in zip(cells, chart_templates(), LIVE_CHARTS, strict=True):
        cell.vega_lite_chart(frames.as_table(cols)(snap), copy.deepcopy(spec), width="stretch")


def results(snap: RaceSnapshot) -> None:
    """The one-sentence summary and the per-request table with its CSV."""
    if snap.error:
        st.error(f"The race ended with an error: {snap.error}")
    elif snap.phase == "abandoned":
        st.warning("Abandoned: the page stopped refreshing, so the race cancelled its requests.")
    elif snap.phase == "stopped":
        st.warning("Stopped: every request of this race was cancelled and its KV blocks freed.")
    elif snap.summary:
        with st.container(key="summary"):
            st.success(snap.summary)
    df = frames.rows_frame(snap)
    if not df.empty:
        st.dataframe(df, hide_index=True)
        st.download_button("Download per-request metrics (CSV)", df.to_csv(index=False),
                           file_name="batchlens-arena.csv", mime="text/csv")


def how_measured() -> None:
    """The fairness method, and this race's exact set-up once there is one."""
    race = current_race()
    with st.expander("How this was measured"):
        st.write("The two sides run one after the other, each with every CPU thread, and "
                 "are drawn on one shared timeline where each side's t=0 is its own start. "
                 "TTFT, TPOT, end-to-end latency and tokens/s come from the same code for "
                 "both sides (engine/metrics.py), from monotonic timestamps.")
        if race is not None:
            rows = pd.DataFrame(list(race.describe().items()), columns=["what", "how"])
            st.dataframe(rows, hide_index=True, width="stretch")
