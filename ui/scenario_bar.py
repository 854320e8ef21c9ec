"""The presenter's scenario bar: one button per scripted scenario (presenter mode only),
each opening the view that plays it. It sits above the views it starts, so none of them
imports it and presenter.py imports none of them."""

from __future__ import annotations

import streamlit as st

from ui import arena, presenter, speculative_view
from workloads import scenarios


def show() -> None:
    """In presenter mode, one button per scripted scenario, disabled while a race runs.
    The KV cache page's scenarios open that page, which plays them; "edit a paragraph"
    compares speculative decoding off and on below the buttons; the others start a race
    here."""
    if not presenter.is_on():
        return
    st.caption("Scripted scenarios: fixed prompts, greedy decoding, the same text every run.")
    disabled = arena.SLOT.running() or speculative_view.SLOT.running()
    keys = presenter.SCENARIOS
    for col, key in zip(st.columns(len(keys)), keys, strict=True):
        sc = scenarios.get(key)
        if col.button(sc.title, key=f"scenario-{key}", disabled=disabled, width="stretch",
                      help=sc.shows, type="primary" if key == "many_users" else "secondary"):
            if key in scenarios.KV_SCENARIOS:
                st.session_state[presenter.KEY_KV_START] = key
                st.switch_page("pages/kv_cache.py")
            elif key == speculative_view.SCENARIO:  # speculation off and on, under the buttons
                speculative_view.start()
                st.rerun()
            else:
                arena.start_scenario(key)
                st.rerun()
