"""One background job of this browser session (a race, a sweep, a KV scenario), held in
`st.session_state`, with Run and Stop buttons and a live view that redraws itself while
the job runs::

    SLOT = JobSlot("arena_race")
    controls():  running = SLOT.inputs_disabled()   inputs, then SLOT.buttons(...) and
                                                    SLOT.show_error()
    Run:         SLOT.start(lambda: Race(...))      replaces (closes) the last job; a
                                                    ValueError shows as "Not started: ...";
                                                    refused while another slot's job runs
    Stop:        SLOT.stop()                        cancels, and waits (at most STOP_WAIT_S)
                                                    until the job's requests have ended
    live():      SLOT.live(view)                    view(job) in a fragment, redrawn every
                                                    refresh_s while the job runs

The page's inputs are disabled while the job runs; when it ends, the live view reruns the
whole page once, so they come back. A browser session runs one job at a time, whatever the
page: a race, a sweep or a KV scenario. The jobs' heartbeat is the live view and the status
strip (`held_jobs`); a job also watches its session's websocket, so a closed tab's job
cancels itself within a second (workloads/job.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from workloads.job import BackgroundJob

REFRESH_S = float(os.environ.get("BATCHLENS_REFRESH_S", "0.5"))  # a live view of a job
SLOW_REFRESH_S = 2 * REFRESH_S  # a view with less to show: the status strip, an idle page,
#                                 a sweep (which leaves the CPU to its measurement)
HEARTBEAT_S = 5.0  # a job untouched for this long, its tab closed, cancels itself
STOP_WAIT_S = 2.0  # Stop returns once the job's requests ended (their blocks are free)
KINDS = {"race": "race", "sweep": "sweep", "kv": "KV cache scenario",  # job id prefixes
         "speculative": "speculative decoding comparison"}

J = TypeVar("J", bound=BackgroundJob)


def held_jobs() -> list[BackgroundJob]:
    """Every job this browser session holds, in any slot."""
    return [v for v in st.session_state.values() if isinstance(v, BackgroundJob)]


def job_kind(job: BackgroundJob) -> str:
    """What a job is, in words ("race", "sweep", "KV cache scenario")."""
    prefix = job.job_id.rsplit("-", 1)[0]
    return KINDS.get(prefix, prefix)


@dataclass(frozen=True)
class JobSlot(Generic[J]):
    """The job held in `st.session_state[key]`; at most one per slot and session."""

    key: str
    refresh_s: float = REFRESH_S  # how often the live view redraws while the job runs
    idle_refresh_s: float | None = None  # ... and while none runs (None: not by itself)
    heartbeat_s: float = HEARTBEAT_S  # the job's heartbeat timeout (its builder passes it)

    @property
    def job(self) -> J | None:
        """This session's job, running or ended; None before the first Run."""
        return st.session_state.get(self.key)

    def running(self) -> bool:
        job = self.job
        return job is not None and not job.finished

    def inputs_disabled(self) -> bool:
        """Whether the page's inputs are disabled now (a job runs). Remembered, so the
        live view can rerun the page once the job ends, enabling them again."""
        running = self.running()
        st.session_state[f"{self.key}_shown_running"] = running
        return running

    # ---- controls ----------------------------------------------------------------------
    def buttons(self, stop_key: str, *, on_run: Callable[[], None] | None = None,
                run_key: str | None = None, run_label: str = "Run",
                run_disabled: bool = False) -> DeltaGenerator:
        """Run (when `on_run` is given) and Stop in a row; Run is disabled while the job
        runs, Stop while none does. Returns the cell beside them, for a hint."""
        running = self.running()
        *cells, hint = st.columns([1, 1, 5] if on_run else [1, 5], vertical_alignment="center")
        if on_run is not None:
            cells[0].button(run_label, type="primary", key=run_key, on_click=on_run,
                            disabled=running or run_disabled, width="stretch")
        cells[-1].button("Stop", key=stop_key, on_click=self.stop, disabled=not running,
                         width="stretch")
        return hint

    def show_error(self) -> None:
        """Why the last Run did not start, once."""
        error = st.session_state.pop(f"{self.key}_error", None)
        if error:
            st.error(error)

    def start(self, build: Callable[[], J]) -> J | None:
        """Close the last job (a finished one at once), then build and start a new one. A
        `ValueError` from `build` (an impossible setting, a cap, a busy engine) is kept for
        `show_error`, and so is a job of this session still running in another slot."""
        other = next((job for job in held_jobs()
                      if job is not self.job and not job.finished), None)
        if other is not None:
            st.session_state[f"{self.key}_error"] = (
                f"Not started: one run at a time per browser session, and your "
                f"{job_kind(other)} is still running. Stop it first.")
            return None
        old = self.job
        if old is not None:
            old.close()
        try:
            job = build()
        except ValueError as exc:
            st.session_state[f"{self.key}_error"] = f"Not started: {exc}"
            return None
        st.session_state[self.key] = job.start()
        return job

    def stop(self) -> None:
        """Cancel the job's requests (the Stop button) and wait, at most `STOP_WAIT_S`,
        until they have ended, so the page redrawn after Stop shows their blocks free."""
        job = self.job
        if job is not None:
            job.stop()
            job.wait_cancelled(STOP_WAIT_S)

    # ---- the live view -----------------------------------------------------------------
    def live(self, view: Callable[[J | None], None]) -> None:
        """`view(job)` in a fragment that redraws itself every `refresh_s` while the job
        runs (every `idle_refresh_s` otherwise), touching the job each time; once a job the
        controls showed running has ended, the whole page reruns to enable them."""

        def redraw() -> None:
            job = self.job
            if job is not None:
                job.touch()
            view(job)
            if job is not None:
                job.shown()
            shown = f"{self.key}_shown_running"
            if job is not None and job.finished and st.session_state.get(shown):
                st.session_state[shown] = False
                st.rerun()

        st.fragment(redraw, run_every=self.refresh_s if self.running() else self.idle_refresh_s)()
