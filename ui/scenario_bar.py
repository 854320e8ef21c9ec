"""The presenter's scenario bar: one button per scripted scenario (presenter mode only),
each opening the view that plays it, Stop beside them, and the clicker's keys stepping
through them. It sits above the views it starts, so none of them imports it and
presenter.py imports none of them."""

from __future__ import annotations

import streamlit as st

from ui import arena, clicker, presenter, speculative_view
from workloads import scenarios

KEY_PLAYED = "presenter_played"  # the scenario last started from the bar (or the clicker)


def show() -> None:
    """In presenter mode, one button per scripted scenario, disabled while a race runs,
    the last one started highlighted. The KV cache page's scenarios open that page, which
    plays them; "edit a paragraph" compares speculative decoding off and on below the
    buttons; the others start a race here."""
    if not presenter.is_on():
        return
    ss = st.session_state
    disabled = arena.SLOT.running() or speculative_view.SLOT.running()
    keys = presenter.SCENARIOS
    st.caption("Scripted scenarios: fixed prompts, greedy decoding, the same text every run. "
               + clicker.HINT)
    step = clicker.step()
    chosen = None if disabled else clicker.pick(keys, ss.get(KEY_PLAYED), step)
    *cells, stop = st.columns([1] * len(keys) + [0.55], vertical_alignment="center")
    current = ss.get(KEY_PLAYED, "many_users")
    for col, key in zip(cells, keys, strict=True):
        sc = scenarios.get(key)
        if col.button(sc.title, key=f"scenario-{key}", disabled=disabled, width="stretch",
                      help=sc.shows, type="primary" if key == current else "secondary"):
            chosen = key
    stop.button("Stop", key="presenter_stop", on_click=arena.SLOT.stop,
                disabled=not arena.SLOT.running(), width="stretch")
    if chosen is not None:
        play(chosen)


def play(key: str) -> None:
    """Start a scenario where it plays, and remember it for the clicker."""
    st.session_state[KEY_PLAYED] = key
    if key in scenarios.KV_SCENARIOS:
        st.session_state[presenter.KEY_KV_START] = key
        st.switch_page("pages/kv_cache.py")
    elif key == speculative_view.SCENARIO:  # speculation off and on, under the buttons
        speculative_view.start()
        st.rerun()
    else:
        arena.start_scenario(key)
        st.rerun()
