"""The arena page's parts: controls, the two live columns, the charts and the results.

The race runs on its own thread (`workloads.race.Race`), held in this session's job slot;
the page only reads `race.snapshot()` from a fragment that reruns a few times a second,
never waiting on the engine. Model output is shown with `st.code` (plain text), never as
markdown or HTML.
"""

from __future__ import annotations

import copy

import streamlit as st

from engine import SamplingParams
from engine.local import LocalPC
from measure.hardware import Emulation
from server.remote import RemoteSide
from ui import charts, endpoints, frames, hosting, inputs, method, presenter, server_charts, shared
from ui.job_slot import JobSlot
from ui.palette import SIDE_NAMES
from workloads import scenarios, speculative
from workloads.job import ENGINE_CHANGED
from workloads.prompts import Chat, load_prompts, user_prompts
from workloads.race import Race, RaceSnapshot, SideView
from workloads.sides import LABELS, SIDES, count

SLOT: JobSlot[Race] = JobSlot("arena_race")
TITLES = {"local": f"{SIDE_NAMES['local']} — one user at a time",
          "datacenter": f"{SIDE_NAMES['datacenter']} — batched"}
OTHERS = ("varied prompts", "the same prompt")
KEY_SCENARIO = "arena_scenario"  # the scripted scenario last started, if any
MAX_USERS, MAX_TOKENS = 64, 1024  # the page's ranges (the admin's caps may be lower)
MAX_ANSWERS = 8  # answers per user (SamplingParams.n); the engine takes up to 16
ENDED = ("stopped", "abandoned")
PRESENTER_ANSWER_PX = 110  # the answer's box in presenter mode: both panels on one screen
IDLE = "Pick a prompt, set the number of users and press Run."  # before the first race
IDLE_PRESENTER = "Press a scenario above to start a race."  # presenter mode has no Run
NO_PACE = "this machine's real speed"
# Beside the sidebar each side's panel is under a third of a 1280 px screen and holds three
# figures a row: at Streamlit's 2.25rem a finished race's "0.16 s" and "432.0" overflow
PANEL_CSS = """<style>
[class*="st-key-side-"] [data-testid="stMetricValue"],
[class*="st-key-side-"] [data-testid="stMetricValue"] * { font-size: 1.75rem !important; }
</style>"""
# Projections the local side can be paced to: (hardware, model, precision) in measure/hardware.py
EMULATIONS: dict[str, tuple[str, str, str] | None] = {
    NO_PACE: None,
    "Llama-2-7B fp16 on a laptop CPU (projected)": ("laptop_cpu", "llama-2-7b", "fp16"),
    "Llama-2-13B fp16 on an RTX 4090 (projected)": ("rtx4090", "llama-2-13b", "fp16"),
    "Llama-2-70B int4 on an M2 Max (projected)": ("m2_max", "llama-2-70b", "int4"),
    "Llama-2-70B int4 on a laptop CPU (projected)": ("laptop_cpu", "llama-2-70b", "int4"),
}


LIVE_CHARTS = (  # (builder, columns) per chart, in page order: 2 x 2
    (charts.tokens_chart, frames.tokens_columns),
    (charts.latency_chart, frames.latency_columns),
    (charts.kv_chart, frames.kv_columns),
    (charts.batch_chart, frames.batch_columns),
)
EMPTY = RaceSnapshot("waiting", 0.0, {s: SideView.idle(s) for s in SIDES},
                     [], [], [], [], False, None, None)


@st.cache_resource(show_spinner=False)
def chart_templates() -> list[dict]:
    """Every live chart's Vega-Lite dict, built and validated once per process, so a refresh
    only sends new rows (and the first race is not timed while Altair loads its schema)."""
    return [charts.template(build(frames.as_frame(cols)(EMPTY))) for build, cols in LIVE_CHARTS]


def intro() -> None:
    chart_templates()
    st.header("Arena: the same prompt, many users, both sides")
    st.caption("Everyone sends at the same moment. The local PC answers one user at a time; "
               "the datacenter engine batches all of them into each step.")


# ---- controls ----------------------------------------------------------------------
def controls() -> None:
    """Prompt, users, max tokens, temperature, Run and Stop; disabled while a race runs.
    Hidden in presenter mode: the scenario bar starts and stops its races."""
    ss, presets = st.session_state, load_prompts()
    running = SLOT.inputs_disabled()
    if presenter.is_on():
        SLOT.show_error()
        return
    ss.setdefault("arena_prompt", next(iter(presets.presets.values())))
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.selectbox("Preset prompts", list(presets.presets), index=None, key="arena_preset",
                     placeholder="Pick a preset...", on_change=_use_preset, disabled=running)
        st.text_area("Your prompt", key="arena_prompt", height=150, disabled=running)
    with right:
        a, b = st.columns(2)
        users = inputs.whole_number("Users", 1, MAX_USERS, 8, key="arena_users",
                                    disabled=running, where=a,
                                    help="You plus others who press Enter at the same moment.")
        max_tokens = inputs.whole_number("Max tokens", 1, MAX_TOKENS, 64,
                                         key="arena_max_tokens", disabled=running, where=b)
        answers = inputs.whole_number(
            "Answers per user", 1, MAX_ANSWERS, 1, key="arena_n", disabled=running,
            help="Candidates per request (n). The datacenter computes the prompt once and "
                 "its answers share the prompt's KV blocks; the local PC writes them one "
                 "after another, each with the prompt again in an n_ctx window of its own.")
        st.slider("Temperature", 0.0, 1.5, 0.0, 0.1, key="arena_temperature", disabled=running)
        st.radio("The other users send", OTHERS, key="arena_others", horizontal=True,
                 disabled=running)
        st.checkbox("Put me last in line", key="arena_you_last", disabled=running)
        _speculation_switches(running)
        _local_device_choice(running)
        endpoints.pickers("arena", running)
        st.selectbox("Pace the local PC to", list(EMULATIONS), key="arena_pace",
                     disabled=running, help="Slow the local side down to the roofline "
                     "projection of a bigger model on consumer hardware (measure/hardware.py); "
                     "the label says so wherever its figures appear.")
    empty = not ss["arena_prompt"].strip()
    bad = users is None or max_tokens is None or answers is None
    hint = SLOT.buttons("arena_stop", on_run=_on_run, run_key="arena_run",
                        run_disabled=empty or bad)
    if empty:
        hint.caption("Type a prompt (or pick a preset) to enable Run.")
    elif bad:
        hint.caption("Fix the number above to enable Run.")
    SLOT.show_error()


def _speculation_switches(running: bool) -> None:
    """Speculative decoding on or off for each side (in-process sides only): one heading,
    then a short switch per side, whose labels fit half a column's width."""
    tip = ("Speculative decoding by n-gram prompt lookup: up to 4 tokens guessed from "
           "earlier text are checked in one step; it pays when the answer copies the "
           "prompt. The same tokens come out (greedy), only faster or slower.")
    st.caption("Speculative decoding", help=tip)
    a, b = st.columns(2)
    a.toggle("Local PC", key="arena_spec_local", disabled=running)
    b.toggle("Datacenter", key="arena_spec_dc", disabled=running,
             help="The datacenter side then runs on an engine of its own, built on the "
             "shared weights, unless the shared engine already speculates so.")


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
        st.session_state["arena_prompt"] = load_prompts().presets[name]


def _on_run() -> None:
    ss = st.session_state
    if (inputs.range_error("Users", ss["arena_users"], 1, MAX_USERS)
            or inputs.range_error("Max tokens", ss["arena_max_tokens"], 1, MAX_TOKENS)
            or inputs.range_error("Answers per user", ss.get("arena_n", 1), 1, MAX_ANSWERS)):
        return  # Run is disabled then; a stale click does nothing
    prompts, you = user_prompts(
        ss["arena_prompt"], int(ss["arena_users"]), ss["arena_others"] == OTHERS[0],
        bool(ss["arena_you_last"]), load_prompts().others)
    SLOT.start(lambda: _race(
        prompts, SamplingParams(max_tokens=int(ss["arena_max_tokens"]),
                                temperature=float(ss["arena_temperature"]),
                                n=int(ss.get("arena_n", 1))),
        you, EMULATIONS.get(ss.get("arena_pace", NO_PACE)),
        spec_local=bool(ss.get("arena_spec_local")), spec_dc=bool(ss.get("arena_spec_dc"))))


def _race(prompts: list[Chat], params: SamplingParams, you: int,
          emulation: tuple[str, str, str] | None, *, spec_local: bool = False,
          spec_dc: bool = False) -> Race:
    """A race on the shared engine (or a configured remote datacenter) and a local PC of
    its own (or a configured remote one), the sides it built shut down with the race;
    `spec_local` / `spec_dc`: speculative decoding on that side (in-process sides; the
    datacenter then gets an engine of its own unless the shared one already matches).
    Raises `ValueError` (nothing left running) on an impossible setting, an endpoint that
    does not answer, a run over the admin's caps, or a shared engine whose queue is full."""
    caps = hosting.caps()
    caps.check(len(prompts), params.max_tokens, "race")
    device = st.session_state.get("arena_local_device", "cpu")

    def local_pc() -> LocalPC:
        pacing = Emulation(*emulation) if emulation else None
        return LocalPC(shared.local_model(device), pacing=pacing,
                       speculative="ngram" if spec_local else None)

    with endpoints.sides("arena", shared.shared_engine().engine, local_pc) as (dc, local,
                                                                                remote_dc):
        own = None
        if not remote_dc:
            caps.check_queue(dc)
            own = speculative.engine_with_speculation(dc, spec_dc, prompts, params.max_tokens)
        try:
            return Race(own or dc, local, prompts, params, you=you,
                        heartbeat_timeout=SLOT.heartbeat_s, close_local=True,
                        close_engine=remote_dc or own is not None,
                        connected=shared.session_connected())
        except BaseException:
            if own is not None:
                own.shutdown()
            raise


def start_scenario(key: str) -> None:
    """Play a scripted scenario (workloads/scenarios.py) in the arena: fixed prompts, greedy."""
    sc = scenarios.get(key)
    ss = st.session_state
    ss["arena_prompt"] = sc.prompts[0][-1]["content"]
    ss["arena_users"], ss["arena_max_tokens"] = sc.num_users, sc.max_tokens
    ss["arena_temperature"], ss["arena_n"] = 0.0, 1
    ss["arena_spec_local"] = ss["arena_spec_dc"] = False  # the scenarios run without it
    ss["arena_pace"] = next((k for k, v in EMULATIONS.items() if v == sc.emulation), NO_PACE)
    ss[KEY_SCENARIO] = key
    SLOT.start(lambda: _race(list(sc.prompts), sc.params(0), 0, sc.emulation))


# ---- the live view -----------------------------------------------------------------
def live() -> None:
    """Both columns, the charts and, at the end, the results; refreshed while running."""
    if not presenter.is_on():  # presenter mode sizes every figure itself
        st.html(PANEL_CSS)
    SLOT.live(_live_view)


def _live_view(race: Race | None) -> None:
    if race is None:  # the same layout, empty: pressing Run then only updates it
        st.info(IDLE_PRESENTER if presenter.is_on() else IDLE)
        snap = EMPTY
    else:
        snap = race.snapshot()
    note = race.local.stats(steps_after=None).emulated if race is not None else None
    if snap.finished and presenter.is_on():
        ratio_line(snap, note)  # above both panels: the race's outcome in one sentence
    local_col, dc_col = st.columns(2, gap="large")
    with local_col:
        side_panel(snap.sides["local"], snap, note)
        server_panel(race.local if race is not None else None)
    with dc_col:
        side_panel(snap.sides["datacenter"], snap)
        server_panel(race.engine if race is not None else None)
    live_charts(snap)
    if snap.finished:
        results(snap, note)


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _side_state(view: SideView, snap: RaceSnapshot) -> str:
    if snap.phase in ENDED and view.started:
        return f"Stopped: {view.users_finished} of {count(view.num_users, 'user')} finished."
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
        if presenter.is_on():
            presenter_figures(view, snap)
        else:
            st.caption(_side_state(view, snap))
            a, b, c = st.columns(3)
            a.metric("Your TTFT", f"{_num(view.your_ttft, '.2f')} s")
            b.metric("Your tokens/s", _num(view.your_tokens_per_s, ".1f"))
            c.metric("Total tokens/s", _num(view.total_tokens_per_s, ".1f"))
            d, e, f = st.columns(3)
            d.metric("Users finished", f"{view.users_finished}/{view.num_users}")
            e.metric("Elapsed", f"{view.elapsed:.1f} s")
            f.metric("Ahead of you", _place(view))
        if view.acceptance_rate is not None:
            st.caption(speculation_line(view))
        your_answers(view)


def your_answers(view: SideView) -> None:
    """Your answer as plain text; with several answers per user, one tab per answer and a
    line on how this side holds their KV cache."""
    if len(view.your_answers) < 2:
        st.code(view.your_text or " ", language=None, wrap_lines=True, height=_answer_px())
        return
    st.caption(answers_line(view.side, len(view.your_answers)))
    tabs = st.tabs([f"Answer {i}" for i in range(1, len(view.your_answers) + 1)])
    for tab, text in zip(tabs, view.your_answers, strict=True):
        tab.code(text or " ", language=None, wrap_lines=True, height=_answer_px())


def answers_line(side: str, n: int) -> str:
    """How a side holds the KV cache of one user's `n` answers, in words."""
    if side == "local":
        return (f"{n} answers, one after another: each processes the prompt again into an "
                f"n_ctx window of its own, so {n} × n_ctx is reserved and the prompt is "
                f"held {n} times.")
    return (f"{n} answers at once: the prompt is computed once and its KV blocks are "
            f"shared by all {n} (reference counts), each answer adding only its own blocks.")


def _answer_px() -> int:
    return PRESENTER_ANSWER_PX if presenter.is_on() else 180


def presenter_figures(view: SideView, snap: RaceSnapshot) -> None:
    """Presenter mode: the headline (total tokens/s, and when the last user had an answer)
    large, the other figures smaller beneath, with short labels that fit at 1280 px."""
    with st.container(key=f"headline-{view.side}"):
        big, words = st.columns([2, 3], vertical_alignment="center")
        big.metric("Total tokens/s", "—" if view.total_tokens_per_s is None
                   else _rate(view.total_tokens_per_s))
        words.markdown(headline_sentence(view, snap))
    a, b, c, d, e = st.columns(5, gap="small")
    a.metric("Your TTFT", f"{_num(view.your_ttft, '.2f')} s")
    b.metric("Your tok/s", _num(view.your_tokens_per_s, ".1f"))
    c.metric("Finished", f"{view.users_finished}/{view.num_users}")
    d.metric("Elapsed", f"{view.elapsed:.1f} s")
    e.metric("Ahead of you", _place(view))


def headline_sentence(view: SideView, snap: RaceSnapshot) -> str:
    """When this side's users had their answers, in words: "The last of 32 users had an
    answer after 9.0 s." once done, how many have one so far while running."""
    n = view.num_users
    if view.finished and view.users_finished == n and snap.phase not in ENDED:
        who = "The one user" if n == 1 else f"The last of {count(n, 'user')}"
        return f"{who} had an answer after **{view.elapsed:.1f} s**."
    if view.started and not view.finished and snap.phase not in ENDED:
        return (f"{view.users_finished} of {count(n, 'user')} had an answer after "
                f"**{view.elapsed:.1f} s**...")
    return _side_state(view, snap)


def speculation_line(view: SideView) -> str:
    """A side's speculative decoding in words: drafts accepted, tokens per step."""
    return (f"Speculative decoding: {view.acceptance_rate:.0%} of drafted tokens accepted, "
            f"{view.mean_accepted_length or 1:.1f} tokens per request per step.")


def server_panel(side: object) -> None:
    """A remote side's own state, as its /metrics reports it (vLLM, SGLang, llama.cpp or
    batchlens names), refreshed with the page; nothing for an in-process side."""
    if not isinstance(side, RemoteSide):
        return
    state = side.server_state()
    if state is None:
        st.caption("Live server state (running, waiting, KV usage): not exported by this "
                   "server.")
        return
    a, b, c = st.columns(3)
    a.metric("Server: running", f"{state.running:.0f}")
    b.metric("Server: waiting", f"{state.waiting:.0f}")
    c.metric("Server: KV usage", "n/a" if state.kv_usage is None else f"{state.kv_usage:.0%}")
    st.caption(f"From the server's own /metrics ({state.source} names).")
    server_charts.chart(side)  # the same state over time


def live_charts(snap: RaceSnapshot) -> None:
    """The four charts, two per row, redrawn from the templates with the snapshot's rows."""
    cells = [cell for _ in range(2) for cell in st.columns(2)]
    for cell, vega, (_, cols) in zip(cells, chart_templates(), LIVE_CHARTS, strict=True):
        cell.vega_lite_chart(frames.as_table(cols)(snap), copy.deepcopy(vega), width="stretch")


def results(snap: RaceSnapshot, note: str | None = None) -> None:
    """The one-sentence summary and the per-request table with its CSV; `note` labels the
    local side's emulation."""
    if snap.error and snap.error.startswith(ENGINE_CHANGED):
        st.warning(snap.error)  # not an error of the race: the engine was replaced under it
    elif snap.error:
        st.error(f"The race ended with an error: {snap.error}")
    elif snap.phase in ENDED:
        st.warning(stopped_sentence(snap))
    elif snap.ratio is not None and not presenter.is_on():  # presenter mode: above the panels
        with st.container(key="summary"):
            st.success(summary_sentence(snap, note))
    df = frames.rows_frame(snap)
    if not df.empty:
        st.dataframe(df, hide_index=True)
        st.download_button("Download per-request metrics (CSV)", df.to_csv(index=False),
                           file_name="batchlens-arena.csv", mime="text/csv")


def stopped_sentence(snap: RaceSnapshot) -> str:
    """How a stopped (or abandoned) race ended: who finished on each side, in words."""
    why = ("Abandoned: the page's connection closed, so the race stopped"
           if snap.phase == "abandoned" else "Stopped")
    done = [f"{v.users_finished} of {count(v.num_users, 'user')} finished on the "
            f"{LABELS[name]}" for name, v in snap.sides.items() if v.started]
    return (f"{why}: {'; '.join(done) or 'no user had started'}. The rest were cancelled and "
            "their KV blocks freed.")


def summary_sentence(snap: RaceSnapshot, note: str | None = None) -> str:
    """One sentence for a race that ran to the end: both sides' totals and their ratio
    (and the local side's pace, when `note` labels an emulation)."""
    dc, loc = snap.sides["datacenter"], snap.sides["local"]
    users = "1 user" if dc.num_users == 1 else f"{dc.num_users} users at once"
    return (f"With {users}, the datacenter engine generated {_rate(dc.total_tokens_per_s)} "
            f"tokens/s in total, {snap.ratio:.1f}x the local PC's "
            f"{_rate(loc.total_tokens_per_s)} tokens/s serving one user at a time."
            + pace_sentence(note))


def ratio_line(snap: RaceSnapshot, note: str | None = None) -> None:
    """Presenter mode, once a race has ended: its outcome above both panels."""
    if snap.ratio is None or snap.error or snap.phase in ENDED:
        return  # the reason shows under the charts (results)
    with st.container(key="summary"):
        st.success(ratio_sentence(snap, note))


def ratio_sentence(snap: RaceSnapshot, note: str | None = None) -> str:
    """The race in one short sentence: "The datacenter served 32 users 8.6x faster than
    the local PC (139 against 16 tokens/s in total)." (and the local side's pace, when
    `note` labels an emulation)."""
    dc, loc = snap.sides["datacenter"], snap.sides["local"]
    shown = round(snap.ratio, 1)  # "1.0x faster" would read as twice as fast to some
    how = ("about as fast as" if shown == 1 else f"{shown:.1f}x faster than" if shown > 1
           else f"at {shown:.1f}x the speed of")
    return (f"The datacenter served {count(dc.num_users, 'user')} {how} the local PC "
            f"({_rate(dc.total_tokens_per_s)} against {_rate(loc.total_tokens_per_s)} "
            "tokens/s in total)." + pace_sentence(note))


def pace_sentence(note: str | None) -> str:
    """What a paced race's ratio compares, for the sentences above: a projection of another
    model on another device against the datacenter's real run ("" for an unpaced race)."""
    if not note:
        return ""
    pace = note.removeprefix("emulated: ").removesuffix(" (projected)")
    return (f" The local PC ran at the projected pace of {pace}; the datacenter ran its own "
            "model at its real speed.")


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 10 else f"{tokens_per_s:.1f}"


def how_measured() -> None:
    """The fairness method, and this race's exact set-up once there is one."""
    race = SLOT.job
    method.panel("The two sides run one after the other, each with every CPU thread, and "
                 "are drawn on one shared timeline where each side's t=0 is its own start. "
                 "TTFT, TPOT, end-to-end latency and tokens/s come from the same code for "
                 "both sides (engine/metrics.py), from monotonic timestamps.",
                 method.race_setup(race) if race is not None else None)
