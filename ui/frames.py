"""Race snapshots as DataFrames for the charts and the table (pure, no Streamlit).

The live page rebuilds these a few times a second while the engine runs in the same
process, so they are built column by column from the snapshot's lists (no record parsing,
no `melt`): every millisecond here is a millisecond the page holds the GIL.
"""

from __future__ import annotations

import pandas as pd

from engine.race import RaceSnapshot

SIDE_NAMES = {"local": "Local PC", "datacenter": "Datacenter"}
ROW_COLUMNS = ["side", "user", "you", "ttft_s", "tpot_s", "e2e_s", "queue_s", "tokens",
               "tokens_per_s", "finish_reason"]
METRICS = {"ttft_s": "TTFT", "e2e_s": "end-to-end"}


def _frame(records: list[dict], columns: list[str]) -> pd.DataFrame:
    data = {c: [r.get(c) for r in records] for c in columns}
    if "side" in data:
        data["side"] = [SIDE_NAMES.get(s, s) for s in data["side"]]
    return pd.DataFrame(data, columns=columns)


def tokens_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, t (s since that side's start), tokens (generated so far, all users)."""
    return _frame(snap.tokens, ["side", "t", "tokens"])


def kv_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, t, kind ("reserved" | "used"), bytes, mib."""
    df = _frame(snap.kv, ["side", "t", "kind", "bytes"])
    df["mib"] = [float(b) / 2**20 for b in df["bytes"]]
    return df


def batch_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """t, num_seqs: sequences in each datacenter engine step."""
    return _frame(snap.batch, ["t", "num_seqs"])


def latency_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, user, metric ("TTFT" | "end-to-end"), seconds: one row per finished request
    and metric (all TTFT rows first, as a melt of the rows would give)."""
    rows = [(SIDE_NAMES.get(r["side"], r["side"]), r["user"], label, r[col])
            for col, label in METRICS.items() for r in snap.rows]
    return pd.DataFrame(rows, columns=["side", "user", "metric", "seconds"])


def rows_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """One row per finished request: the table and the CSV."""
    return _frame(snap.rows, ROW_COLUMNS)
