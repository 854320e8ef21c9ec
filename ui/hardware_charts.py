"""Pure chart builders for the hardware page: a DataFrame in, an Altair chart out.

No Streamlit and no roofline arithmetic here: the frames come from `ui.hardware_view`, whose
numbers come from `measure.hardware`.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from ui.palette import ACCENT, DATACENTER_COLOR, INK, LOCAL_COLOR

PARTS = ["weights", "KV cache"]
PART_SCALE = alt.Scale(domain=PARTS, range=[DATACENTER_COLOR, ACCENT])
SERIES = ["per user", "total"]
SERIES_SCALE = alt.Scale(domain=SERIES, range=[LOCAL_COLOR, DATACENTER_COLOR])
BATCH_DOMAIN = [1, 1024]
OFFLOAD_COLOR = LOCAL_COLOR
# Streamlit fits a whole chart (title, legend and axes included) in its height, so text
# is placed from the top of the plot, whose own height is not known here.
HEIGHT = 380
FIT_HEIGHT = 240


def fit_chart(df: pd.DataFrame, memory_gib: float, device: str) -> alt.LayerChart:
    """Weights and KV cache stacked in one horizontal bar, against the device-memory line.

    df: one row per part, columns `part` ("weights" | "KV cache") and `gib`.
    """
    top = max(float(df["gib"].sum()), memory_gib) * 1.08
    bars = df.assign(order=[PARTS.index(p) for p in df["part"]], row="")
    x = alt.X("gib:Q", title="GiB", stack="zero", scale=alt.Scale(domain=[0, top]))
    bar = alt.Chart(bars).mark_bar(size=28).encode(
        x=x,
        y=alt.Y("row:N", axis=None),
        color=alt.Color("part:N", scale=PART_SCALE, title=None,
                        legend=alt.Legend(orient="bottom")),
        order=alt.Order("order:Q"),
        tooltip=["part:N", alt.Tooltip("gib:Q", format=",.1f", title="GiB")],
    )
    line = pd.DataFrame({"gib": [memory_gib], "label": [f"{device}: {memory_gib:.3g} GiB"]})
    rule = alt.Chart(line).mark_rule(color=INK, strokeWidth=3, strokeDash=[6, 3]).encode(x=x)
    left_half = memory_gib < 0.55 * top  # label on the side of the line with room for it
    label = alt.Chart(line).mark_text(  # above the bar, which is centred in the plot
        align="left" if left_half else "right", dx=6 if left_half else -6, baseline="top",
        color=INK, fontWeight="bold").encode(x=x, y=alt.value(2), text="label:N")
    return alt.layer(bar, rule, label, title="Weights + KV cache vs device memory",
                     height=FIT_HEIGHT)


def offload_regions(df: pd.DataFrame) -> pd.DataFrame:
    """Contiguous runs of offload-bound batches in a decode frame, as `start`, `end` rows."""
    grid = df.drop_duplicates("batch").sort_values("batch")
    runs: list[tuple[int, int]] = []
    start = prev = None
    for batch, bound in zip(grid["batch"], grid["bound"], strict=True):
        if bound == "offload" and start is None:
            start = batch
        elif bound != "offload" and start is not None:
            runs.append((start, prev))
            start = None
        prev = batch
    if start is not None:
        runs.append((start, prev))
    return pd.DataFrame(runs, columns=["start", "end"])


def decode_chart(df: pd.DataFrame, b_star: float) -> alt.LayerChart:
    """Decode tokens/s per user and in total vs batch (log-log), the compute-bound batch B*
    as a labelled rule, and the offload-bound batches shaded.

    df: columns `batch`, `series` ("per user" | "total"), `tokens_per_s`, `bound`.
    """
    x_scale = alt.Scale(type="log", base=2, domain=BATCH_DOMAIN)
    x = alt.X("batch:Q", title="batch (concurrent users)", scale=x_scale)
    lines = alt.Chart(df).mark_line(strokeWidth=3, clip=True).encode(
        x=x,
        y=alt.Y("tokens_per_s:Q", title="decode tokens/s", scale=alt.Scale(type="log")),
        color=alt.Color("series:N", scale=SERIES_SCALE, title=None,
                        legend=alt.Legend(orient="top")),
        tooltip=["batch:Q", "series:N", alt.Tooltip("tokens_per_s:Q", format=",.1f"), "bound:N"],
    )
    regions = offload_regions(df).assign(label="offload-bound: does not fit")
    shade = alt.Chart(regions).mark_rect(color=OFFLOAD_COLOR, opacity=0.12, clip=True).encode(
        x=alt.X("start:Q", scale=x_scale, title="batch (concurrent users)"), x2="end:Q")
    shade_label = alt.Chart(regions).mark_text(
        align="right", dx=-6, baseline="top", color=OFFLOAD_COLOR, fontWeight="bold",
        clip=True).encode(x=alt.X("end:Q", scale=x_scale), y=alt.value(24), text="label:N")
    star = pd.DataFrame({"batch": [b_star], "label": [f"B* ≈ {b_star:.0f}: compute-bound →"]})
    rule = alt.Chart(star).mark_rule(color=INK, strokeWidth=2, strokeDash=[6, 3],
                                     clip=True).encode(x=x)
    rule_label = alt.Chart(star).mark_text(
        align="left", dx=6, baseline="top", color=INK, fontWeight="bold", clip=True).encode(
        x=x, y=alt.value(4), text="label:N")
    return alt.layer(shade, shade_label, lines, rule, rule_label,
                     title="Decode tokens/s vs batch", height=HEIGHT)
