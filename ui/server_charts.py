"""A remote server's own state over time: running and waiting requests and KV-cache usage
as its /metrics reported them (`RemoteSide.server_history()`, read every half second
while requests are out), drawn beside the streams while a race or a sweep runs.

    history_frame(samples) -> rows (t, series, value), t in seconds since the first reading
    state_chart(rows)      -> requests on the left axis, KV cache used (%) on the right
    chart(side) / panel(side)  the Streamlit parts; "not exported by this server" where
                               the server exports none of the known names
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import altair as alt
import pandas as pd
import streamlit as st

from server.remote import RemoteSide
from server.remote_metrics import NOT_EXPORTED, StateSample
from ui.palette import ACCENT, DATACENTER_COLOR, LOCAL_COLOR

SERIES = ("running", "waiting", "KV cache used")
COLUMNS = ("t", "series", "value")
HEIGHT = 260


def history_frame(samples: Sequence[StateSample]) -> pd.DataFrame:
    """One row per reading and series: seconds since the first reading, the series
    ("running", "waiting", "KV cache used" as a fraction; no KV rows where the server
    does not export it) and its value."""
    if not samples:
        return pd.DataFrame(columns=list(COLUMNS))
    t0 = samples[0].time
    rows = []
    for s in samples:
        t, state = s.time - t0, s.state
        rows += [(t, SERIES[0], state.running), (t, SERIES[1], state.waiting)]
        if state.kv_usage is not None:
            rows.append((t, SERIES[2], state.kv_usage))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def state_chart(df: pd.DataFrame, title: str = "The server's own state") -> alt.LayerChart:
    """Running and waiting requests (left axis) and the KV cache used (right axis, %) over
    the seconds since the first reading, one step line each."""
    color = alt.Color("series:N", title=None, legend=alt.Legend(orient="top"),
                      scale=alt.Scale(domain=list(SERIES),
                                      range=[DATACENTER_COLOR, LOCAL_COLOR, ACCENT]))
    x = alt.X("t:Q", title="seconds since the first reading")
    base = alt.Chart(df).mark_line(interpolate="step-after", strokeWidth=2)
    requests = base.transform_filter(alt.FieldOneOfPredicate("series", list(SERIES[:2]))).encode(
        x=x, color=color, y=alt.Y("value:Q", title="requests", axis=alt.Axis(tickMinStep=1)))
    kv = base.transform_filter(alt.FieldEqualPredicate("series", SERIES[2])).encode(
        x=x, color=color, strokeDash=alt.value([4, 3]),
        y=alt.Y("value:Q", title="KV cache used", scale=alt.Scale(domain=[0, 1]),
                axis=alt.Axis(format="%", orient="right")))
    return alt.layer(requests, kv, title=title, height=HEIGHT).resolve_scale(y="independent")


@st.cache_resource(show_spinner=False)
def _template() -> dict:
    """The chart's Vega-Lite dict without rows, built once per process (a refresh sends
    rows only)."""
    vega = state_chart(history_frame([])).to_dict()
    vega.pop("datasets", None)
    vega.pop("data", None)
    return vega


def chart(side: RemoteSide) -> None:
    """The side's server state over time, in a container keyed `server-state-{role}`;
    nothing before the first reading."""
    history = side.server_history()
    if not history:
        return
    with st.container(key=f"server-state-{side.role}"):
        st.vega_lite_chart(history_frame(history), copy.deepcopy(_template()),
                           width="stretch")


def panel(side: object) -> None:
    """A remote side's server state: the chart, or "not exported by this server";
    nothing for an in-process side."""
    if not isinstance(side, RemoteSide):
        return
    if side.server_state() is None and not side.server_history():
        st.caption(f"Live server state (running, waiting, KV usage): {NOT_EXPORTED}.")
        return
    chart(side)
