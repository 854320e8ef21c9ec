"""Pure chart builders for the sweep page: a DataFrame in, an Altair chart out. No Streamlit.

The frames come from `workloads.sweep.rows` (one row per side and load, CSV column names) and
`workloads.sweep.roofline`; `points_frame` / `latency_frame` / `roofline_frame` shape them.
Loads are drawn on a log-2 x axis, so 1, 2, 4 ... 64 users sit evenly spaced.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from ui.palette import DATACENTER, DATACENTER_COLOR, LOCAL, LOCAL_COLOR, SIDE_NAMES

SIDES = [LOCAL, DATACENTER]
ROOF = "Roofline: this machine"
COLORS = {LOCAL: LOCAL_COLOR, DATACENTER: DATACENTER_COLOR, ROOF: "#6b7280"}
PERCENTILES = ["p50", "p99"]
X_TITLES = {"users": "concurrent users (log scale)",
            "rate_rps": "arrival rate, requests/s (log scale)"}
HEIGHT = 420  # the whole chart: title, legends and axes fit in it too (Streamlit)
FONT = {"labelFontSize": 14, "titleFontSize": 15}


# ---- frames --------------------------------------------------------------------------
def points_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The sweep's rows with display names for the sides (the table and the charts)."""
    df = pd.DataFrame.from_records(rows)
    if "side" in df:
        df["side"] = df["side"].map(SIDE_NAMES)
    return df


def latency_frame(points: pd.DataFrame, x: str, metric: str) -> pd.DataFrame:
    """side, x, percentile ("p50" | "p99"), seconds; `metric` is "ttft" or "e2e"."""
    cols = {f"{metric}_{p}_s": p for p in PERCENTILES}
    if points.empty:
        return pd.DataFrame(columns=["side", x, "percentile", "seconds"])
    long = points.melt(id_vars=["side", x], value_vars=list(cols), var_name="percentile",
                       value_name="seconds")
    long["percentile"] = long["percentile"].map(cols)
    return long


def roofline_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """users, total, per_user, bound (from `workloads.sweep.roofline`) and side = ROOF."""
    df = pd.DataFrame.from_records(rows, columns=["users", "total", "per_user", "bound"])
    return df.assign(side=ROOF)


# ---- charts --------------------------------------------------------------------------
def _x(x: str) -> alt.X:
    return alt.X(f"{x}:Q", title=X_TITLES.get(x, x), scale=alt.Scale(type="log", base=2),
                 axis=alt.Axis(**FONT))


def _color(series: list[str]) -> alt.Color:
    scale = alt.Scale(domain=series, range=[COLORS[s] for s in series])
    return alt.Color("side:N", scale=scale, title=None,
                     legend=alt.Legend(orient="top", labelFontSize=15, symbolStrokeWidth=4,
                                       labelLimit=300))


def _measured(points: pd.DataFrame, x: str, y: str, y_title: str, log_y: bool,
              series: list[str]) -> alt.Chart:
    scale = alt.Scale(type="log") if log_y else alt.Scale(domainMin=0)
    # a linear axis with no points yet would label its one tick "0.000000"
    labels = {} if log_y else {"format": ",.4~r"}
    return alt.Chart(points).mark_line(point=alt.OverlayMarkDef(size=90), strokeWidth=3).encode(
        x=_x(x),
        y=alt.Y(f"{y}:Q", title=y_title, scale=scale, axis=alt.Axis(**FONT, **labels)),
        color=_color(series),
        tooltip=["side:N", f"{x}:Q", alt.Tooltip(f"{y}:Q", format=",.3g")],
    )


def _with_roof(points: pd.DataFrame, roof: pd.DataFrame | None, x: str, y: str, roof_y: str,
               title: str, y_title: str) -> alt.LayerChart:
    """Measured lines on a log y axis; the roofline (users mode only) drawn beneath them."""
    draw_roof = roof is not None and not roof.empty and x == "users"
    series = SIDES + [ROOF] if draw_roof else SIDES
    layers = []
    if draw_roof:
        layers.append(alt.Chart(roof).mark_line(
            strokeDash=[8, 5], strokeWidth=2.5, clip=True).encode(
            x=_x("users"), y=alt.Y(f"{roof_y}:Q"), color=_color(series),
            tooltip=["users:Q", alt.Tooltip(f"{roof_y}:Q", format=",.0f", title="tokens/s"),
                     "bound:N"]))
    layers.append(_measured(points, x, y, y_title, True, series))
    return alt.layer(*layers, title=title, height=HEIGHT)


def throughput_chart(points: pd.DataFrame, roof: pd.DataFrame | None,
                     x: str = "users") -> alt.LayerChart:
    """Total tokens/s vs load, both sides; this machine's roofline ceiling beneath."""
    return _with_roof(points, roof, x, "throughput_tokens_per_s", "total",
                      "Total tokens/s (all users together)", "tokens/s, log scale")


def per_user_chart(points: pd.DataFrame, roof: pd.DataFrame | None,
                   x: str = "users") -> alt.LayerChart:
    """Median tokens/s each user gets (tokens / E2E, queueing included) vs load."""
    return _with_roof(points, roof, x, "per_user_tokens_per_s_p50", "per_user",
                      "Tokens/s each user gets (median)", "tokens/s per user, log scale")


def latency_chart(df: pd.DataFrame, x: str, title: str) -> alt.Chart:
    """p50 (solid) and p99 (dashed) latency vs load, one colour per side; log y."""
    return alt.Chart(df, title=title, height=HEIGHT).mark_line(
        point=alt.OverlayMarkDef(size=70), strokeWidth=3).encode(
        x=_x(x),
        y=alt.Y("seconds:Q", title="seconds, log scale", scale=alt.Scale(type="log"),
                axis=alt.Axis(**FONT)),
        color=_color(SIDES),
        strokeDash=alt.StrokeDash("percentile:N", title=None,
                                  scale=alt.Scale(domain=PERCENTILES, range=[[1, 0], [6, 4]]),
                                  legend=alt.Legend(orient="top", labelFontSize=15,
                                                    symbolType="stroke", symbolStrokeWidth=3)),
        tooltip=["side:N", f"{x}:Q", "percentile:N", alt.Tooltip("seconds:Q", format=",.3g")],
    )


def goodput_chart(points: pd.DataFrame, x: str = "users") -> alt.Chart:
    """Requests/s that met every SLO vs load, both sides (linear y: zero is common)."""
    return _measured(points, x, "goodput_rps", "requests/s within the SLOs", False,
                     SIDES).properties(title="Goodput under your SLOs", height=HEIGHT)
