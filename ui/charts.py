"""Pure chart builders: a DataFrame in, an `alt.Chart` out. No Streamlit here."""

from __future__ import annotations

import altair as alt
import pandas as pd

from ui.palette import DATACENTER, DATACENTER_COLOR, LOCAL, LOCAL_COLOR

SIDE_SCALE = alt.Scale(domain=[LOCAL, DATACENTER], range=[LOCAL_COLOR, DATACENTER_COLOR])
# Streamlit fits a whole chart (title, two legend rows and axes included) in its height;
# 400 px leaves a plot of ~210 px (at 260 it was ~60 px).
HEIGHT = 400


def _side_color() -> alt.Color:
    return alt.Color("side:N", scale=SIDE_SCALE, title=None, legend=alt.Legend(orient="top"))


def tokens_chart(df: pd.DataFrame) -> alt.Chart:
    """Total tokens generated over time, one line per side (each from its own t=0)."""
    return alt.Chart(df, title="Tokens generated (all users)", height=HEIGHT).mark_line(
        interpolate="step-after", strokeWidth=3).encode(
        x=alt.X("t:Q", title="seconds since the side's start"),
        y=alt.Y("tokens:Q", title="tokens"),
        color=_side_color(),
    )


def latency_chart(df: pd.DataFrame) -> alt.Chart:
    """TTFT and end-to-end latency by user (side, user, metric, seconds): a staircase
    locally, flat when batched."""
    return alt.Chart(df, title="Latency per user", height=HEIGHT).mark_line(
        point=True, strokeWidth=2).encode(
        x=alt.X("user:Q", title="user (arrival order)", axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("seconds:Q", title="seconds"),
        color=_side_color(),
        strokeDash=alt.StrokeDash("metric:N", title=None,
                                  scale=alt.Scale(domain=["TTFT", "end-to-end"]),
                                  legend=alt.Legend(orient="top")),
    )


def kv_chart(df: pd.DataFrame) -> alt.Chart:
    """KV memory over time: reserved (contiguous window or paged blocks) vs used."""
    return alt.Chart(df, title="KV cache memory", height=HEIGHT).mark_line(
        interpolate="step-after", strokeWidth=2).encode(
        x=alt.X("t:Q", title="seconds since the side's start"),
        y=alt.Y("mib:Q", title="MiB"),
        color=_side_color(),
        strokeDash=alt.StrokeDash("kind:N", title=None,
                                  scale=alt.Scale(domain=["reserved", "used"]),
                                  legend=alt.Legend(orient="top")),
    )


def batch_chart(df: pd.DataFrame) -> alt.Chart:
    """Sequences per datacenter engine step: the batch continuous batching builds."""
    return alt.Chart(df, title="Datacenter batch size per step", height=HEIGHT).mark_line(
        interpolate="step-after", color=DATACENTER_COLOR, strokeWidth=2).encode(
        x=alt.X("t:Q", title="seconds since the datacenter's start"),
        y=alt.Y("num_seqs:Q", title="sequences in the step"),
    )


def template(chart: alt.Chart) -> dict:
    """The chart's Vega-Lite spec without its rows, validated once: a live page redraws
    it with new rows (`st.vega_lite_chart(rows, spec)`) without rebuilding the chart."""
    spec = chart.to_dict()
    spec.pop("datasets", None)
    spec.pop("data", None)
    return spec
