"""Presenter mode's "edit a paragraph": speculative decoding off and on, at 1 user and at
32, side by side (tokens/s per user, acceptance rate), as the runs finish.

The comparison runs as this session's job (`workloads.speculative.SpecCompareJob`), each
run on an engine of its own built on the shared weights, so nobody's settings change; the
arena page shows it under the scenario buttons while it runs and once it has ended.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ui import hosting, shared
from ui.job_slot import JobSlot
from workloads import scenarios
from workloads.sides import count
from workloads.speculative import PRESENTER_USERS, SCENARIO, SpecCompareJob, SpecRun, speedup

SLOT: JobSlot[SpecCompareJob] = JobSlot("speculative_compare")


def start() -> None:
    """Start the comparison (from the presenter's scenario button)."""

    def build() -> SpecCompareJob:
        hosting.caps().check(max(PRESENTER_USERS), scenarios.get(SCENARIO).max_tokens,
                             "run")
        return SpecCompareJob(shared.shared_engine().loaded, PRESENTER_USERS,
                              base=shared.shared_engine().engine.config,
                              heartbeat_timeout=SLOT.heartbeat_s,
                              connected=shared.session_connected())

    SLOT.start(build)


def live() -> None:
    """The comparison, once this session has started one (nothing before)."""
    SLOT.show_error()
    if SLOT.job is None:
        return
    if SLOT.inputs_disabled():  # running: Stop; the page reruns once it has ended
        SLOT.buttons("spec_stop")
    SLOT.live(_view)


def _view(job: SpecCompareJob | None) -> None:
    if job is None:
        return
    runs, current = job.snapshot()
    with st.container(key="speculative-compare", border=True):
        st.subheader("Edit a paragraph: speculative decoding off and on")
        st.caption(scenarios.get(SCENARIO).shows)
        for users in job.users:
            _row(users, runs)
        if current is not None:
            st.caption(f"Running: {count(current[0], 'user')}, speculative decoding "
                       f"{'on' if current[1] else 'off'}...")
        elif job.error:
            st.error(f"The comparison ended with an error: {job.error}")
        elif job.finished and len(runs) < 2 * len(job.users):
            st.warning("Stopped before every run finished.")
        if runs:
            st.dataframe(runs_frame(runs), hide_index=True)


def _row(users: int, runs: list[SpecRun]) -> None:
    """One user count: tokens/s per user off and on, and the acceptance rate."""
    off = next((r for r in runs if r.users == users and not r.speculative), None)
    on = next((r for r in runs if r.users == users and r.speculative), None)
    gain = speedup(runs, users)
    a, b, c = st.columns(3)
    label = count(users, "user")
    a.metric(f"{label}, without: tokens/s per user",
             "—" if off is None else f"{off.tokens_per_s_per_user:.1f}")
    b.metric(f"{label}, with speculation: tokens/s per user",
             "—" if on is None else f"{on.tokens_per_s_per_user:.1f}",
             None if gain is None else f"{gain:.2f}x")
    c.metric(f"{label}: drafted tokens accepted",
             "—" if on is None or on.acceptance_rate is None else f"{on.acceptance_rate:.0%}")


def runs_frame(runs: list[SpecRun]) -> pd.DataFrame:
    """One row per run: users, speculation, tokens/s per user and in all, acceptance."""
    return pd.DataFrame.from_records([{
        "users": r.users, "speculation": "on" if r.speculative else "off",
        "tokens/s per user": round(r.tokens_per_s_per_user, 1),
        "total tokens/s": round(r.total_tokens_per_s, 1),
        "acceptance rate": None if r.acceptance_rate is None else round(r.acceptance_rate, 3),
        "tokens per step": None if r.mean_accepted_length is None
        else round(r.mean_accepted_length, 2),
        "output tokens": r.output_tokens} for r in runs])
