"""The KV cache page's parts: scenario cards, the live block maps and figures, the
scheduler's steps, and the last scenario's result with its block size trade-off.

    controls()  one card per KV scenario (prefix caching, block size, Run), and Stop
    live()      a fragment redrawn often while a scenario runs (less often otherwise) for
                the engine shown: a running scenario's own engine, else the shared one
                -> figures, paged map | contiguous layout, steps, last scenario

A scenario plays on an engine of its own (`workloads.scenario_job`), built on the shared
weights and held in this session's job slot, so the shared engine's settings are never
touched. Every figure comes from the
engine shown (`kv_snapshot()`, `stats()`) or from the scenario's result; model output is
shown only as plain text (`st.code`).
"""

from __future__ import annotations

import copy

import pandas as pd
import streamlit as st

from engine.engine import Engine
from engine.kv_cache import BlockInfo, KVCacheStats, waste_for_block_size
from engine.local import DEFAULT_N_CTX
from engine.serving import ServingStats
from ui import clicker, kv_charts, kv_frames, method, presenter, shared
from ui.charts import template
from ui.job_slot import SLOW_REFRESH_S, JobSlot
from workloads.scenario_job import ScenarioJob, scenario_config
from workloads.scenarios import KV_SCENARIOS, get

SLOT: JobSlot[ScenarioJob] = JobSlot("kv_job", idle_refresh_s=SLOW_REFRESH_S)
KEY_RUNS = "kv_runs"
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_RUNS = 10


@st.cache_resource(show_spinner=False)
def chart_templates() -> dict[str, dict]:
    """Every chart's Vega-Lite dict (the block maps once per grid width), built and
    validated once per process: a refresh only sends new rows."""
    templates = {
        "steps": template(kv_charts.steps_chart(kv_frames.step_frame((), 0))),
        "waste": template(kv_charts.waste_chart(kv_frames.waste_frame([], BLOCK_SIZES, 16))),
    }
    for c in kv_frames.GRID_COLUMNS:
        templates[f"block_map-{c}"] = template(
            kv_charts.block_map_chart(kv_frames.block_map_frame([]), c))
        templates[f"contiguous-{c}"] = template(
            kv_charts.contiguous_chart(kv_frames.contiguous_frame([], 0), c))
    return templates


PRESENTER_MAP_PX = 240  # a block map's height in presenter mode: on the first screen


def draw(name: str, df: pd.DataFrame, height: int | str = "content") -> None:
    st.vega_lite_chart(df, copy.deepcopy(chart_templates()[name]), width="stretch",
                       height=height)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def intro() -> None:
    chart_templates()
    st.header("KV cache: blocks, sharing, preemption")
    st.caption("The datacenter engine keeps every request's keys and values in fixed-size "
               "blocks of one pool, handed out as tokens arrive and shared between requests "
               "with the same prefix. The local PC reserves its whole context window per "
               "request, used or not.")


# ---- controls ----------------------------------------------------------------------
def controls() -> None:
    """One card per KV scenario, with its prefix caching and block size; Stop below."""
    ss = st.session_state
    running = SLOT.inputs_disabled()
    if presenter.is_on():
        _presenter_bar(running)
        return
    for col, key in zip(st.columns(len(KV_SCENARIOS)), KV_SCENARIOS, strict=True):
        with col.container(border=True, key=f"kv-card-{key}"):
            _scenario_card(key, running)
    auto = ss.pop(presenter.KEY_KV_START, None)  # presenter mode's scenario button
    if auto in KV_SCENARIOS and not running:
        _on_run(auto)
        st.rerun()
    SLOT.buttons("kv_stop").caption("Each scenario plays on an engine of its own, on the "
                                    "same weights: the shared engine and its settings are "
                                    "not touched.")
    SLOT.show_error()


def _presenter_bar(running: bool) -> None:
    """Presenter mode: one button per scenario (its card's settings hidden: each plays with
    its own defaults), Stop, and the clicker stepping through them."""
    ss = st.session_state
    job = SLOT.job
    current = job.scenario.key if job is not None else None
    st.caption("Each scenario plays on an engine of its own, on the same weights. "
               + clicker.HINT)
    step = clicker.step()
    chosen = ss.pop(presenter.KEY_KV_START, None)  # the arena's scenario button
    if chosen is None and not running:
        chosen = clicker.pick(KV_SCENARIOS, current, step)
    *cells, stop = st.columns([1] * len(KV_SCENARIOS) + [0.55], vertical_alignment="center")
    for col, key in zip(cells, KV_SCENARIOS, strict=True):
        if col.button(get(key).title, key=f"kv_run_{key}", disabled=running, width="stretch",
                      help=get(key).shows,
                      type="primary" if key == current else "secondary"):
            chosen = key
    stop.button("Stop", key="kv_stop", on_click=SLOT.stop, disabled=not running,
                width="stretch")
    SLOT.show_error()
    if chosen in KV_SCENARIOS and not running:
        _on_run(chosen)
        st.rerun()


def _scenario_card(key: str, running: bool) -> None:
    sc = get(key)
    cfg = sc.engine_config()
    st.subheader(sc.title)
    st.caption(sc.shows)
    st.checkbox("Prefix caching", cfg.enable_prefix_caching, key=f"kv_prefix_{key}",
                disabled=running)
    bs = st.select_slider("Block size (tokens)", BLOCK_SIZES, cfg.block_size,
                          key=f"kv_block_{key}", disabled=running)
    pool = scenario_config(sc, int(bs))
    who = _count(sc.num_users, "user") + (f" × {sc.n} answers" if sc.n > 1 else "")
    st.caption(f"{who} · pool {pool.num_kv_blocks:,} blocks × {bs} tokens "
               f"(the same {pool.num_kv_blocks * bs:,} token slots at every block size)")
    st.button("Run", type="primary", key=f"kv_run_{key}", on_click=_on_run, args=(key,),
              disabled=running, width="stretch")


def _on_run(key: str) -> None:
    """Play scenario `key` with its card's settings (its own, where no card is shown)."""
    ss, cfg = st.session_state, get(key).engine_config()
    SLOT.start(lambda: ScenarioJob(
        get(key), shared.shared_engine().loaded,
        block_size=int(ss.get(f"kv_block_{key}", cfg.block_size)),
        prefix_caching=bool(ss.get(f"kv_prefix_{key}", cfg.enable_prefix_caching))))


# ---- the live view -----------------------------------------------------------------
def live() -> None:
    """Figures, block maps, steps and the last scenario, refreshed in place."""
    SLOT.live(_live_view)


def shown_engine(job: ScenarioJob | None) -> tuple[Engine, str]:
    """A running scenario's engine, else the shared one; with a line saying which."""
    if job is not None and not job.finished:
        cfg = job.config
        return job.engine, (
            f"Showing the engine of the scenario “{job.scenario.title}”: "
            f"{job.engine.kv.num_blocks:,} blocks × {cfg.block_size} tokens, prefix caching "
            f"{'on' if cfg.enable_prefix_caching else 'off'} — live.")
    return shared.shared_engine().engine, (
        "Showing the shared datacenter engine: every browser session's requests, live.")


def _live_view(job: ScenarioJob | None) -> None:
    engine, which = shown_engine(job)
    blocks, kv = engine.kv_snapshot()  # the map and its counts from one moment
    stats = engine.stats()
    with st.container(key="kv-shown"):
        st.markdown(f"**{which}**")
    figures(kv, stats)
    paged, contiguous = st.columns(2, gap="large")
    with paged:
        block_map(blocks, kv)
        shared_line(kv, stats.kv_bytes_per_token)
    with contiguous:
        contiguous_layout(blocks, kv)
    draw("steps", kv_frames.step_frame(stats.recent_steps, stats.num_steps))
    last_scenario(job)


def figures(kv: KVCacheStats, stats: ServingStats) -> None:
    """Usage, waste, prefix-cache hit rate and preemptions of the engine shown: one row on
    a presenter's full-width screen, two rows of three beside the sidebar, where six
    columns cut "1,234 / 2,912" short."""
    cols = presenter.metric_columns(6, 3)
    cols[0].metric("Blocks used", f"{kv.used_blocks:,} / {kv.num_blocks:,}",
                   help="Blocks in some request's block table / blocks in the pool.")
    cols[1].metric("Cached blocks", f"{kv.cached_blocks:,}",
                   help="Free blocks that still hold a full block's hash: a later request "
                        "with the same prefix reads them instead of recomputing.")
    cols[2].metric("KV usage", _pct(kv.usage))
    cols[3].metric("Waste", _pct(kv.waste if kv.reserved_slots else None),
                   help="Token slots reserved by live requests but not (yet) filled: "
                        "only the tail of each request's last block.")
    cols[4].metric("Prefix-cache hit rate",
                   _pct(kv.prefix_hit_rate if kv.prefix_queries else None),
                   help="Prompt tokens found in cached blocks / prompt tokens looked up.")
    cols[5].metric("Preemptions", f"{stats.num_preemptions:,}",
                   help="Requests whose blocks were freed to make room, to be recomputed.")


def block_map(blocks: list[BlockInfo], kv: KVCacheStats) -> None:
    """The paged pool, block by block."""
    group = kv_frames.blocks_per_cell(kv.num_blocks)
    cell = "one cell = one block" if group == 1 else f"one cell = {group} blocks"
    with st.container(key="kv-paged-caption"):
        st.caption(f"{kv.num_blocks:,} blocks × {kv.block_size} tokens ({cell}): "
                   f"{kv.used_blocks:,} used · {kv.cached_blocks:,} cached · "
                   f"{kv.free_blocks:,} free")
    columns = kv_frames.map_columns(kv.num_blocks)
    draw(f"block_map-{columns}", kv_frames.block_map_frame(blocks),
         presenter.figure_height(PRESENTER_MAP_PX))


def shared_line(kv: KVCacheStats, bytes_per_token: int) -> None:
    """"KV shared: X MiB saved (Y%)" while blocks are shared between block tables."""
    saving = kv_frames.kv_shared(kv.reserved_slots, kv.used_blocks, kv.block_size,
                                 bytes_per_token)
    if saving is not None:
        with st.container(key="kv-shared"):
            st.markdown(f"**{saving.line}** — {saving.separate_blocks:,} blocks as "
                        f"separate copies, {saving.held_blocks:,} held.")


def contiguous_layout(blocks: list[BlockInfo], kv: KVCacheStats) -> None:
    """The same requests as the local PC would hold them: `DEFAULT_N_CTX` tokens each."""
    res = kv_frames.contiguous_reservations(blocks, DEFAULT_N_CTX, kv.block_size)
    per = -(-DEFAULT_N_CTX // kv.block_size)
    fit = kv_frames.fitting(res, kv.num_blocks)
    if not res:
        text = (f"n_ctx = {DEFAULT_N_CTX:,} tokens = {per:,} blocks per request. No request "
                "holds blocks now.")
    else:
        used = sum(r.used_blocks for r in res[:fit])
        text = (f"n_ctx = {DEFAULT_N_CTX:,} tokens = {per:,} blocks per request: {fit} of "
                f"{len(res)} requests fit this pool")
        if fit:
            text += (f"; {fit * per:,} blocks reserved, {used:,} used "
                     f"({1 - used / (fit * per):.0%} never used)")
        if per > kv.num_blocks:
            text += f"; one reservation is bigger than the whole pool ({kv.num_blocks:,})"
        text += f". Paged, all {len(res)} hold {kv.used_blocks:,} blocks."
    with st.container(key="kv-contiguous-caption"):
        st.caption(text)
    columns = kv_frames.map_columns(kv.num_blocks)
    draw(f"contiguous-{columns}", kv_frames.contiguous_frame(res, kv.num_blocks),
         presenter.figure_height(PRESENTER_MAP_PX))


# ---- the last scenario ---------------------------------------------------------------
def last_scenario(job: ScenarioJob | None) -> None:
    """Progress or result of this session's last scenario, and waste vs block size."""
    st.subheader("Last scenario")
    if job is None:
        st.info("Press Run on a scenario: its requests, steps and block size trade-off "
                "show here.")
        return
    left, right = st.columns(2, gap="large")
    with left:
        if job.finished:
            result_line(job)
            if job.final_stats is not None:
                fs = job.final_stats
                st.caption("Its steps, to the end (its engine is shut down now):")
                draw("steps", kv_frames.step_frame(fs.recent_steps, fs.num_steps))
        else:
            st.info(f"Running “{job.scenario.title}”: {len(job.lengths())} of "
                    f"{job.scenario.num_users} users submitted so far.")
    with right:
        lengths = job.lengths()
        if lengths:
            draw("waste", kv_frames.waste_frame(lengths, BLOCK_SIZES, job.config.block_size))
            st.caption(f"From the token lengths (prompt + output) of the {len(lengths)} "
                       "requests of this scenario.")
    if job.finished:
        _record(job)
        runs_table()
        answers(job)


def result_line(job: ScenarioJob) -> None:
    """One line: hit rate, median TTFT, preemptions (from the scenario's result)."""
    res, cfg = job.result, job.config
    if job.error or res is None:
        st.error(f"The scenario failed: {job.error}")
        return
    ttft = "—" if res.ttft_p50 is None else f"{res.ttft_p50:.2f} s"
    line = (f"{job.scenario.title} (block size {cfg.block_size}, prefix caching "
            f"{'on' if cfg.enable_prefix_caching else 'off'}): prefix-cache hit rate "
            f"{res.hit_rate:.0%} · median TTFT {ttft} · {_count(res.preemptions, 'preemption')} · "
            f"{len(res.outputs)} requests")
    fs = job.final_stats
    peak = None if fs is None else kv_frames.peak_kv_shared(
        fs.recent_steps, job.engine.kv.num_blocks, cfg.block_size, fs.kv_bytes_per_token)
    if peak is not None:
        line += f" · at its peak, {peak.line}"
    with st.container(key="kv-result"):
        if res.stopped:
            st.warning(f"Stopped: the rest was cancelled and its blocks freed. {line}")
        else:
            st.success(line)


def run_row(job: ScenarioJob) -> dict:
    """One row of the runs table."""
    res, cfg = job.result, job.config
    return {
        "scenario": job.scenario.title,
        "prefix caching": "on" if cfg.enable_prefix_caching else "off",
        "block size": cfg.block_size,
        "blocks": cfg.num_kv_blocks,
        "hit rate": res.hit_rate if res else None,
        "TTFT p50 (s)": res.ttft_p50 if res else None,
        "preemptions": res.preemptions if res else None,
        "waste": waste_for_block_size(job.lengths(), cfg.block_size),
        "requests": len(res.outputs) if res else 0,
        "ended": "error" if job.error else "stopped" if res and res.stopped else "done",
    }


def _record(job: ScenarioJob) -> None:
    runs: dict = st.session_state.setdefault(KEY_RUNS, {})
    if job.job_id not in runs:
        runs[job.job_id] = run_row(job)
        while len(runs) > MAX_RUNS:
            runs.pop(next(iter(runs)))


def runs_table() -> None:
    """This session's scenario runs, newest last: compare prefix caching and block sizes."""
    rows = list(st.session_state.get(KEY_RUNS, {}).values())
    if not rows:
        return
    pct = st.column_config.NumberColumn(format="percent")
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch", column_config={
        "hit rate": pct, "waste": pct,
        "TTFT p50 (s)": st.column_config.NumberColumn(format="%.3f")})


def answers(job: ScenarioJob) -> None:
    """Every user's answer, as plain text."""
    if job.result is None or not job.result.outputs:
        return
    outs = job.result.outputs
    with st.expander(f"Answers ({len(outs)} users)"):
        st.code("\n".join(
            f"user {i}: {a.text.strip()}" if len(o.answers) == 1
            else f"user {i}, answer {j + 1}: {a.text.strip()}"
            for i, o in enumerate(outs) for j, a in enumerate(o.answers)),
            language=None, wrap_lines=True)


def how_measured() -> None:
    """How the block maps, waste and hit rate are computed."""
    method.panel(
        "The block maps and the figures above them come from one `kv_snapshot()` of "
        "the engine shown: every block's state, ref count and block tables, and the "
        "pool's counts, read under the engine's lock. Waste is reserved-but-unused "
        "token slots / reserved slots. The prefix-cache hit rate is prompt tokens read "
        "from cached blocks / prompt tokens looked up. The contiguous layout places "
        f"the same requests as the local PC holds them: {DEFAULT_N_CTX:,} tokens "
        "(its context window) reserved per request, laid end to end in a pool of the "
        "same size. A scenario's pool keeps its size in token slots when you change "
        "the block size. Waste vs block size uses "
        "sum(ceil(L/bs)·bs − L) / sum(ceil(L/bs)·bs) over the requests' token "
        "lengths L (prompt + output).", title="How this is measured")
