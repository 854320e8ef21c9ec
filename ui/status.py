"""The status strip: what the shared engine is doing for every browser session."""

from __future__ import annotations

import streamlit as st

from engine import ServingStats
from ui import shared

STATUS_REFRESH_S = 1.0


def status_line(stats: ServingStats, mine_prefix: str | None) -> str:
    """One line: requests running and waiting (all sessions, and how many are yours)."""
    ids = stats.running_ids + stats.waiting_ids
    yours = sum(1 for rid in ids if mine_prefix and rid.startswith(mine_prefix))
    kv = stats.kv
    return (f"Shared datacenter engine (all sessions) — running: {stats.num_running} · "
            f"waiting: {stats.num_waiting} · yours: {yours} · KV blocks used: "
            f"{kv.used_blocks}/{kv.num_blocks} ({kv.usage:.0%}) · "
            f"{stats.model} on {stats.device}, {stats.dtype}")


@st.fragment(run_every=STATUS_REFRESH_S)
def status_strip() -> None:
    """Refreshes itself every second, without rerunning the page. It is also the
    heartbeat of this session's race and sweep: a closed tab stops it, so they cancel
    themselves; switching pages does not."""
    for key in shared.HEARTBEAT_KEYS:  # the tab is open (on any page): keep its jobs alive
        job = st.session_state.get(key)
        if job is not None:
            job.touch()
    race = st.session_state.get(shared.RACE_KEY)
    prefix = race.race_id if race is not None else None
    stats = shared.shared_engine().engine.stats(steps_after=None)
    with st.container(key="status-strip"):
        st.caption(status_line(stats, prefix))
