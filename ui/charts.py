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


def _dashed_by(field: str, values: list[str]) -> alt.StrokeDash:
    """Solid for the first of `values`, dashed for the second, legend on top."""
    return alt.StrokeDash(f"{field}:N", title=None, scale=alt.Scale(domain=values),
                          legend=alt.Legend(orient="top"))


def _timeline(df: pd.DataFrame, title: str, y: alt.Y, stroke_width: int,
              **encoding: alt.StrokeDash) -> alt.Chart:
    """A step line per side over the seconds since that side's own start."""
    return alt.Chart(df, title=title, height=HEIGHT).mark_line(
        interpolate="step-after", strokeWidth=stroke_width).encode(
        x=alt.X("t:Q", title="seconds since the side's start"), y=y, color=_side_color(),
        **encoding)


def tokens_chart(df: pd.DataFrame) -> alt.Chart:
    """Total tokens generated over time, one line per side (each from its own t=0)."""
    return _timeline(df, "Tokens generated (all users)", alt.Y("tokens:Q", title="tokens"), 3)


def latency_chart(df: pd.DataFrame) -> alt.Chart:
    """TTFT and end-to-end latency by user (side, user, metric, seconds): a staircase
    locally, flat when batched."""
    return alt.Chart(df, title="Latency per user", height=HEIGHT).mark_line(
        point=True, strokeWidth=2).encode(
        x=alt.X("user:Q", title="user (arrival order)", axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("seconds:Q", title="seconds"),
        color=_side_color(),
        strokeDash=_dashed_by("metric", ["TTFT", "end-to-end"]),
    )


def kv_chart(df: pd.DataFrame) -> alt.Chart:
    """KV memory over time: reserved (contiguous window or paged blocks) vs used."""
    return _timeline(df, "KV cache memory", alt.Y("mib:Q", title="MiB"), 2,
                     strokeDash=_dashed_by("kind", ["reserved", "used"]))


def batch_chart(df: pd.DataFrame) -> alt.Chart:
    """Sequences per datacenter engine step: the batch continuous batching builds."""
    return alt.Chart(df, title="Datacenter batch size per step", height=HEIGHT).mark_line(
        interpolate="step-after", color=DATACENTER_COLOR, strokeWidth=2).encode(
        x=alt.X("t:Q", title="seconds since the datacenter's start"),
        y=alt.Y("num_seqs:Q", title="sequences in the step"),
    )


def template(chart: alt.Chart) -> dict:
    """The chart's Vega-Lite dict without its rows, validated once: a live page redraws
    it with new rows (`st.vega_lite_chart(rows, vega)`) without rebuilding the chart."""
    vega = chart.to_dict()
    vega.pop("datasets", None)
    vega.pop("data", None)
    return vega
