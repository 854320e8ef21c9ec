"""Pure chart builders for the Datacenter page: a DataFrame in, an Altair chart out.

No Streamlit and no projection arithmetic here: the frames come from `ui.datacenter_view`,
whose numbers come from `measure.projection` and `measure.hardware`.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from ui.palette import ACCENT, DATACENTER_COLOR, INK, LOCAL_COLOR

SERIES = ["per user", "total"]
SERIES_SCALE = alt.Scale(domain=SERIES, range=[LOCAL_COLOR, DATACENTER_COLOR])
KINDS = ["measured", "ideal (roofline)"]
KIND_DASH = alt.Scale(domain=KINDS, range=[[1, 0], [6, 4]])
PARTS = ["GEMM", "attention", "communication", "other"]
PART_SCALE = alt.Scale(domain=PARTS, range=[DATACENTER_COLOR, ACCENT, LOCAL_COLOR, "#9ca3af"])
BATCH_DOMAIN = [1, 1024]
HEIGHT = 360


def _y_domain(df: pd.DataFrame) -> list[float]:
    values = df["tokens_per_s"]
    return [float(values.min()) * 0.8, float(values.max()) * 1.25]


def decode_chart(df: pd.DataFrame, title: str, y_domain: list[float] | None = None
                 ) -> alt.Chart:
    """Decode tokens/s per user and in total vs batch (log-log); measured solid, the
    roofline dashed.

    df: columns `batch`, `series` ("per user" | "total"), `kind` (`KINDS`),
    `tokens_per_s`.
    """
    x = alt.X("batch:Q", title="batch (concurrent users)",
              scale=alt.Scale(type="log", base=2, domain=BATCH_DOMAIN))
    y = alt.Y("tokens_per_s:Q", title="decode tokens/s",
              scale=alt.Scale(type="log", domain=y_domain or _y_domain(df)))
    return alt.Chart(df, title=title, height=HEIGHT).mark_line(strokeWidth=3, clip=True).encode(
        x=x, y=y,
        color=alt.Color("series:N", scale=SERIES_SCALE, title=None,
                        legend=alt.Legend(orient="top")),
        strokeDash=alt.StrokeDash("kind:N", scale=KIND_DASH, title=None,
                                  legend=alt.Legend(orient="top")),
        detail="kind:N",
        tooltip=["batch:Q", "series:N", "kind:N",
                 alt.Tooltip("tokens_per_s:Q", format=",.1f", title="tokens/s")],
    )


def local_chart(df: pd.DataFrame, y_domain: list[float]) -> alt.Chart:
    """The same model on local PCs, on the datacenter chart's axes: tokens/s per user vs
    batch by the roofline, one line per device (offload-bound where it does not fit).

    df: columns `batch`, `device`, `tokens_per_s`, `bound`.
    """
    x = alt.X("batch:Q", title="batch (concurrent users)",
              scale=alt.Scale(type="log", base=2, domain=BATCH_DOMAIN))
    y = alt.Y("tokens_per_s:Q", title="decode tokens/s per user",
              scale=alt.Scale(type="log", domain=y_domain))
    return alt.Chart(df, title="The same model on a local PC (roofline, per user)",
                     height=HEIGHT).mark_line(strokeWidth=3, clip=True).encode(
        x=x, y=y, color=alt.Color("device:N", title=None, legend=alt.Legend(orient="top")),
        tooltip=["device:N", "batch:Q", alt.Tooltip("tokens_per_s:Q", format=",.2f"),
                 "bound:N"],
    )


def breakdown_chart(df: pd.DataFrame, title: str) -> alt.Chart:
    """Where a step's time goes: one stacked horizontal bar per row label.

    df: columns `step` (the bar's label), `part` (`PARTS`), `ms`, and `order` (bar order).
    """
    parts = df.assign(part_order=[PARTS.index(p) for p in df["part"]])
    steps = list(dict.fromkeys(parts.sort_values("order")["step"]))
    return alt.Chart(parts, title=title).mark_bar().encode(
        x=alt.X("ms:Q", title="milliseconds", stack="zero"),
        y=alt.Y("step:N", title=None, sort=steps, axis=alt.Axis(labelLimit=240)),
        color=alt.Color("part:N", scale=PART_SCALE, title=None,
                        legend=alt.Legend(orient="bottom")),
        order=alt.Order("part_order:Q"),
        tooltip=["step:N", "part:N", alt.Tooltip("ms:Q", format=",.2f")],
    ).properties(height=170 + 44 * len(steps))  # the height holds title, axis and legend


def scenario_chart(df: pd.DataFrame) -> alt.Chart:
    """The presenter scenario's layouts: decode tokens/s in total at batch 64 (0 where the
    layout does not fit), labelled.

    df: columns `step` (label), `tokens_per_s`, `order`.
    """
    steps = list(df.sort_values("order")["step"])
    base = alt.Chart(df).encode(
        y=alt.Y("step:N", title=None, sort=steps, axis=alt.Axis(labelLimit=320)),
        x=alt.X("tokens_per_s:Q", title="decode tokens/s in total at batch 64"))
    bars = base.mark_bar(size=26, color=DATACENTER_COLOR)
    text = base.mark_text(align="left", dx=6, color=INK, fontWeight="bold").encode(
        text=alt.Text("tokens_per_s:Q", format=",.0f"))
    return alt.layer(bars, text, title="70B on 8 GPUs").properties(height=100 + 40 * len(steps))
