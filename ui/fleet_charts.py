"""Pure chart builders for the fleet page: a DataFrame in, an Altair chart out. No
Streamlit. The frames are `fleet.report.series` lists made into DataFrames; hours of the
simulated day run along every x axis."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from ui.palette import ACCENT, DATACENTER_COLOR, INK, LOCAL_COLOR

HEIGHT = 300
FONT = {"labelFontSize": 13, "titleFontSize": 14}
TOKENS = {"demand": LOCAL_COLOR, "delivered": DATACENTER_COLOR, "capacity": "#6b7280"}
STATES = {"ready": DATACENTER_COLOR, "starting": ACCENT}
QUEUE = {"waiting": LOCAL_COLOR, "running": DATACENTER_COLOR}
LATENCY = {"TTFT p50": DATACENTER_COLOR, "TTFT p99": "#1b4f8a", "TPOT p50": ACCENT,
           "TPOT p99": "#a86d00"}


def frame(rows: list[dict[str, Any]], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame.from_records(rows, columns=columns)


def _x() -> alt.X:
    return alt.X("hour:Q", title="simulated hours", axis=alt.Axis(**FONT))


def _color(field: str, colors: dict[str, str], title: str) -> alt.Color:
    return alt.Color(f"{field}:N", title=title,
                     scale=alt.Scale(domain=list(colors), range=list(colors.values())),
                     legend=alt.Legend(orient="top", **FONT))


def tokens_chart(df: pd.DataFrame) -> alt.Chart:
    """Demand, delivered output tokens/s and the ready replicas' capacity over the day."""
    return alt.Chart(df, height=HEIGHT, title="Demand vs capacity (output tokens/s)").mark_line(
        interpolate="step-after").encode(
        _x(), alt.Y("tokens_per_s:Q", title="tokens/s", axis=alt.Axis(**FONT)),
        _color("series", TOKENS, ""),
        tooltip=["hour:Q", "series:N", alt.Tooltip("tokens_per_s:Q", format=",.0f")])


def replicas_chart(df: pd.DataFrame) -> alt.Chart:
    """Ready and starting (cold-starting) replicas, stacked."""
    return alt.Chart(df, height=HEIGHT, title="Replicas").mark_area(
        interpolate="step-after").encode(
        _x(), alt.Y("replicas:Q", title="replicas", stack=True, axis=alt.Axis(**FONT)),
        _color("state", STATES, ""), tooltip=["hour:Q", "state:N", "replicas:Q"])


def queue_chart(df: pd.DataFrame) -> alt.Chart:
    """Requests waiting in the replicas' queues and running in their batches."""
    return alt.Chart(df, height=HEIGHT, title="Requests in the fleet").mark_line().encode(
        _x(), alt.Y("requests:Q", title="requests", axis=alt.Axis(**FONT)),
        _color("state", QUEUE, ""), tooltip=["hour:Q", "state:N", "requests:Q"])


def latency_chart(df: pd.DataFrame) -> alt.Chart:
    """TTFT and TPOT p50 / p99 of the requests arriving in each bucket (log scale)."""
    df = df.assign(series=df["metric"] + " " + df["percentile"],
                   ms=df["seconds"] * 1e3) if not df.empty else df.assign(series=[], ms=[])
    return alt.Chart(df, height=HEIGHT, title="Latency over the day").mark_line(
        point=False).encode(
        _x(), alt.Y("ms:Q", title="ms (log scale)", scale=alt.Scale(type="log"),
                    axis=alt.Axis(**FONT)),
        _color("series", LATENCY, ""),
        tooltip=["hour:Q", "series:N", alt.Tooltip("ms:Q", format=",.1f")])


def local_chart(df: pd.DataFrame) -> alt.Chart:
    """Per-user tokens/s and joules per token: the fleet against a PC per user
    (columns: side, measure, value)."""
    return alt.Chart(df, height=220).mark_bar().encode(
        alt.X("value:Q", title=None, axis=alt.Axis(**FONT)),
        alt.Y("side:N", title=None, axis=alt.Axis(**FONT)),
        alt.Color("side:N", legend=None,
                  scale=alt.Scale(range=[DATACENTER_COLOR, LOCAL_COLOR])),
        alt.Row("measure:N", title=None, header=alt.Header(labelFontSize=13, labelColor=INK)),
        tooltip=["side:N", "measure:N", alt.Tooltip("value:Q", format=",.3f")],
    ).resolve_scale(x="independent")
