"""Pure chart builders for the KV cache page: a DataFrame (from `ui.kv_frames`) in, an
Altair chart out. No Streamlit and no KV arithmetic here.

Every chart takes its colours and labels from data columns or from fixed scales, so its
Vega-Lite dict does not depend on the rows: the page builds each once
(`ui.charts.template`) and redraws it with new rows a few times a second.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from ui.kv_frames import GRID_COLUMNS
from ui.palette import ACCENT, DATACENTER_COLOR, INK

MAP_WIDTH_PX = 576  # about half a wide page: a row's height is this over the columns
HEIGHT = 360  # the whole chart: title, legends and axes fit in it too (Streamlit)
TITLE_PX, SUBTITLE_PX = 18, 14
PREEMPT_COLOR = "#d62728"
KINDS = ["prefill", "decode", "accepted draft", "rejected draft"]  # drafts: speculation
KIND_SCALE = alt.Scale(domain=KINDS, range=[ACCENT, DATACENTER_COLOR, "#20a39e", "#c9ced6"])


def _title(text: str, subtitle: list[str]) -> alt.Title:
    """A title readable on a projector, its key to the colours below it."""
    return alt.Title(text, subtitle=subtitle, anchor="start", fontSize=TITLE_PX,
                     subtitleFontSize=SUBTITLE_PX, subtitleColor=INK)


def cell_px(columns: int) -> int:
    """Height of a block map row, so cells come out about square."""
    return MAP_WIDTH_PX // columns


def _grid(columns: int) -> dict:
    """x and y of a grid `columns` cells wide (rows as many as the data has)."""
    assert columns in GRID_COLUMNS
    return {"x": alt.X("col:O", axis=None, scale=alt.Scale(domain=list(range(columns)))),
            "y": alt.Y("row:O", axis=None)}


def _cells(columns: int, tooltip: list) -> alt.Chart:
    """Rectangles on the grid, filled with each row's own colour."""
    return alt.Chart().mark_rect(stroke="white", strokeWidth=1).encode(
        **_grid(columns), color=alt.Color("color:N", scale=None), tooltip=tooltip)


def block_map_chart(df: pd.DataFrame, columns: int = GRID_COLUMNS[-1]) -> alt.LayerChart:
    """The paged pool, one cell per block (or per `blocks_per_cell` blocks): coloured by
    the request that holds it, cached and free blocks in greys, the ref count written on
    shared blocks.

    df: `ui.kv_frames.block_map_frame`, laid out `columns` cells a row."""
    tooltip = [alt.Tooltip("first_block:Q", title="first block"),
               alt.Tooltip("last_block:Q", title="last block"), "state:N",
               alt.Tooltip("owners:N", title="block tables"),
               alt.Tooltip("ref_count:Q", title="ref count"),
               "used:Q", "cached:Q", "free:Q"]
    font = min(14, max(8, cell_px(columns) // 2 + 3))
    labels = alt.Chart().mark_text(fontSize=font, fontWeight="bold", color=INK).encode(
        **_grid(columns), text="label:N").transform_filter("datum.ref_count > 1")
    title = _title("Paged: blocks handed out on demand", [
        "colour: the request holding the block · number: ref count of a shared block",
        "slate: cached (free, kept for prefix hits) · light grey: free"])
    return alt.layer(_cells(columns, tooltip), labels, data=df, title=title,
                     height=alt.Step(cell_px(columns)))


def contiguous_chart(df: pd.DataFrame, columns: int = GRID_COLUMNS[-1]) -> alt.LayerChart:
    """The same pool laid out as the local PC does it: each request reserves its whole
    context window end to end; used blocks solid, reserved-but-unused ones pale.

    df: `ui.kv_frames.contiguous_frame`, laid out `columns` cells a row."""
    tooltip = [alt.Tooltip("first_block:Q", title="first block"),
               alt.Tooltip("last_block:Q", title="last block"), "state:N",
               alt.Tooltip("owner:N", title="request"), "used:Q", "reserved:Q", "free:Q"]
    cells = _cells(columns, tooltip).encode(opacity=alt.Opacity("opacity:Q", scale=None))
    title = _title("Contiguous: a whole context window per request", [
        "the same pool, at the same scale, as the local PC reserves it",
        "solid: used · pale: reserved, never used · light grey: free"])
    return alt.layer(cells, data=df, title=title, height=alt.Step(cell_px(columns)))


def steps_chart(df: pd.DataFrame) -> alt.LayerChart:
    """Prefill and decode tokens in each scheduler step, stacked (with speculative decoding
    also the drafts verified, accepted and rejected); steps that preempted requests marked
    in red.

    df: `ui.kv_frames.step_frame`."""
    x = alt.X("x0:Q", title="engine step", axis=alt.Axis(format="d", tickMinStep=1),
              scale=alt.Scale(zero=False, nice=False))
    tooltip = ["step:Q", "kind:N", "tokens:Q", alt.Tooltip("num_seqs:Q", title="sequences"),
               alt.Tooltip("num_preempted:Q", title="preempted"),
               alt.Tooltip("ms:Q", format=".1f", title="step ms"),
               alt.Tooltip("kv_usage:Q", format=".0%", title="KV usage")]
    y = alt.Y("lo:Q", title="tokens in the step", axis=alt.Axis(format="d", tickMinStep=1))
    bars = alt.Chart().mark_rect().encode(
        x=x, x2=alt.X2(field="x1"), y=y,
        y2=alt.Y2(field="hi"),
        color=alt.Color("kind:N", scale=KIND_SCALE, title=None,
                        legend=alt.Legend(orient="top")),
        tooltip=tooltip)
    preempted = "datum.kind == 'prefill' && datum.num_preempted > 0"
    rule = alt.Chart().mark_rule(color=PREEMPT_COLOR, strokeWidth=2, strokeDash=[4, 2]).encode(
        x="step:Q").transform_filter(preempted)
    mark = alt.Chart().mark_point(shape="triangle-down", filled=True, size=160, opacity=1,
                                  color=PREEMPT_COLOR).encode(
        x="step:Q", y=alt.value(0), tooltip=tooltip).transform_filter(preempted)
    title = _title("Scheduler steps: prefill and decode tokens per step",
                   ["red ▼: the step preempted requests (freed their blocks, to be "
                    "recomputed)"])
    return alt.layer(bars, rule, mark, data=df, title=title, height=HEIGHT)


def waste_chart(df: pd.DataFrame) -> alt.LayerChart:
    """Share of reserved slots left empty vs block size (log 2), the chosen size marked.

    df: `ui.kv_frames.waste_frame`."""
    x = alt.X("block_size:Q", title="block size (tokens)",
              scale=alt.Scale(type="log", base=2), axis=alt.Axis(format="d"))
    y = alt.Y("waste:Q", title="reserved slots left empty", axis=alt.Axis(format="%"),
              scale=alt.Scale(padding=0))
    tooltip = ["block_size:Q", alt.Tooltip("waste:Q", format=".1%")]
    line = alt.Chart().mark_line(point=alt.OverlayMarkDef(color=DATACENTER_COLOR, size=60),
                                 strokeWidth=3, color=DATACENTER_COLOR).encode(
        x=x, y=y, tooltip=tooltip)
    chosen = "datum.chosen"
    rule = alt.Chart().mark_rule(color=INK, strokeDash=[6, 3], strokeWidth=2).encode(
        x=x).transform_filter(chosen)
    point = alt.Chart().mark_point(filled=True, size=260, color=PREEMPT_COLOR, opacity=1).encode(
        x=x, y=y, tooltip=tooltip).transform_filter(chosen)
    labels = [alt.Chart().mark_text(align=side, dx=8 if side == "left" else -8,
                                    baseline="top", fontWeight="bold", color=INK,
                                    fontSize=13).encode(x=x, y=alt.value(2), text="label:N")
              .transform_filter(f"{chosen} && datum.label_side == '{side}'")
              for side in ("left", "right")]
    title = _title("Waste vs block size, for these requests",
                   ["only the tail of each request's last block is wasted: bigger blocks, "
                    "bigger tails"])
    return alt.layer(line, rule, point, *labels, data=df, title=title, height=HEIGHT)
