"""Race snapshots as columns, DataFrames (charts, table, CSV) or Arrow tables (the live
charts). Pure, no Streamlit.

The live page rebuilds the charts' rows a few times a second while the engine runs in the
same process, so rows are built column by column from the snapshot's lists and handed to
the page as Arrow tables (no pandas on that path): every millisecond spent here is a
millisecond the page holds the GIL that the engine's step loop also needs. The race keeps
its series whole; a chart gets at most ~`MAX_POINTS` of each (`thin`).
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import pyarrow as pa

from ui.palette import SIDE_NAMES
from workloads.race import RaceSnapshot

ROW_COLUMNS = ["side", "user", "you", "ttft_s", "tpot_s", "e2e_s", "queue_s", "tokens",
               "tokens_per_s", "finish_reason"]
METRICS = {"ttft_s": "TTFT", "e2e_s": "end-to-end"}
MAX_POINTS = 400  # per series on a chart
Columns = dict[str, list]


def thin(points: list[dict], limit: int = MAX_POINTS) -> list[dict]:
    """Every k-th point plus the last, so a chart never gets more than ~`limit` points."""
    if len(points) <= limit:
        return list(points)
    step = -(-len(points) // limit)
    return points[::step] + ([points[-1]] if (len(points) - 1) % step else [])


def _columns(records: list[dict], names: list[str]) -> Columns:
    cols = {c: [r.get(c) for r in records] for c in names}
    if "side" in cols:
        cols["side"] = [SIDE_NAMES.get(s, s) for s in cols["side"]]
    return cols


def tokens_columns(snap: RaceSnapshot) -> Columns:
    """side, t (s since that side's start), tokens (generated so far, all users)."""
    return _columns(thin(snap.tokens), ["side", "t", "tokens"])


def kv_columns(snap: RaceSnapshot) -> Columns:
    """side, t, kind ("reserved" | "used"), bytes, mib; each kind thinned on its own (one
    k-th of interleaved pairs could keep a single kind)."""
    points = [p for kind in ("reserved", "used")
              for p in thin([q for q in snap.kv if q["kind"] == kind])]
    cols = _columns(points, ["side", "t", "kind", "bytes"])
    cols["mib"] = [float(b) / 2**20 for b in cols["bytes"]]
    return cols


def batch_columns(snap: RaceSnapshot) -> Columns:
    """t, num_seqs: sequences in each datacenter engine step."""
    return _columns(thin(snap.batch), ["t", "num_seqs"])


def latency_columns(snap: RaceSnapshot) -> Columns:
    """side, user, metric ("TTFT" | "end-to-end"), seconds: one row per finished request
    and metric (all TTFT rows first)."""
    pairs = [(r, label, col) for col, label in METRICS.items() for r in snap.rows]
    return {"side": [SIDE_NAMES.get(r["side"], r["side"]) for r, _, _ in pairs],
            "user": [r["user"] for r, _, _ in pairs],
            "metric": [label for _, label, _ in pairs],
            "seconds": [r[col] for r, _, col in pairs]}


def as_frame(columns: Callable[[RaceSnapshot], Columns]) -> Callable[[RaceSnapshot], pd.DataFrame]:
    def frame(snap: RaceSnapshot) -> pd.DataFrame:
        return pd.DataFrame(columns(snap))

    frame.__doc__ = columns.__doc__
    return frame


def as_table(columns: Callable[[RaceSnapshot], Columns]) -> Callable[[RaceSnapshot], pa.Table]:
    def table(snap: RaceSnapshot) -> pa.Table:
        return pa.table(columns(snap))

    table.__doc__ = columns.__doc__
    return table


tokens_frame = as_frame(tokens_columns)
kv_frame = as_frame(kv_columns)
batch_frame = as_frame(batch_columns)
latency_frame = as_frame(latency_columns)


def rows_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """One row per finished request: the table and the CSV."""
    return pd.DataFrame(_columns(snap.rows, ROW_COLUMNS), columns=ROW_COLUMNS)
