"""The status strip: what the shared engine is doing for every browser session."""

from __future__ import annotations

import streamlit as st

from engine import ServingStats
from ui import presenter, shared
from ui.job_slot import SLOW_REFRESH_S, held_jobs
from workloads.sides import count


def status_line(stats: ServingStats, mine: tuple[str, ...]) -> str:
    """One line: requests running and waiting (all sessions, and how many are yours: those
    whose id starts with one of `mine`, your jobs' ids); "engine stopped" once its loop has
    stopped (the reason stays in the server's log and /health, not on visitors' pages)."""
    if stats.stopped is not None:
        return ("Shared datacenter engine — engine stopped: it serves no requests until an "
                f"admin restarts it · {stats.model} on {stats.device}, {dtype_words(stats)}")
    ids = stats.running_ids + stats.waiting_ids
    yours = sum(1 for rid in ids if rid.startswith(mine))
    kv = stats.kv
    return (f"Shared datacenter engine (all sessions) — running: {stats.num_running} · "
            f"waiting: {stats.num_waiting} · yours: {yours} · KV blocks used: "
            f"{kv.used_blocks}/{kv.num_blocks} ({kv.usage:.0%}) · "
            f"{stats.model} on {stats.device}, {dtype_words(stats)}")


def dtype_words(stats: ServingStats) -> str:
    """The dtype and why it was chosen: "bfloat16 (decode steps 2.6x ... as fast as
    float32 here, measured on the first start)"."""
    why = stats.dtype_reason.removeprefix(f"{stats.dtype}: ").strip()
    return f"{stats.dtype} ({why})" if why and why != stats.dtype else stats.dtype


def where_line(stats: ServingStats, running: int) -> str:
    """Presenter mode's header: what runs where, in plain words, and how busy it is."""
    device = "GPU" if stats.device.startswith("cuda") else "CPU"
    local = "the same CPU" if device == "CPU" else "this machine's CPU"
    if stats.stopped is not None:
        return "The datacenter engine is stopped: an admin restarts it."
    busy = f" · now serving {count(running, 'request')}" if running else ""
    return (f"**Datacenter:** this machine's {device}, batching · **Local PC:** {local}, one "
            f"user at a time{busy}")


@st.fragment(run_every=SLOW_REFRESH_S)
def status_strip() -> None:
    """Refreshes itself every second, without rerunning the page. It is also the
    heartbeat of this session's jobs (its race, its sweep): a closed tab stops it, so they
    cancel themselves; switching pages does not."""
    jobs = held_jobs()
    for job in jobs:  # the tab is open (on any page): keep its jobs alive
        job.touch()
    stats = shared.shared_engine().engine.stats(steps_after=None)
    line = status_line(stats, tuple(job.job_id for job in jobs))
    with st.container(key="status-strip"):
        if presenter.is_on():  # one plain line; the engineering terms in its tooltip
            st.markdown(where_line(stats, stats.num_running + stats.num_waiting), help=line)
        else:
            st.caption(line)
