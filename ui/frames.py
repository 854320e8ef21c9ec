"""Race snapshots as DataFrames for the charts and the table (pure, no Streamlit)."""

from __future__ import annotations

import pandas as pd

from engine.race import RaceSnapshot

SIDE_NAMES = {"local": "Local PC", "datacenter": "Datacenter"}
ROW_COLUMNS = ["side", "user", "you", "ttft_s", "tpot_s", "e2e_s", "queue_s", "tokens",
               "tokens_per_s", "finish_reason"]


def _frame(records: list[dict], columns: list[str]) -> pd.DataFrame:
    df = pd.DataFrame.from_records(records, columns=columns)
    if "side" in df:
        df["side"] = df["side"].map(SIDE_NAMES)
    return df


def tokens_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, t (s since that side's start), tokens (generated so far, all users)."""
    return _frame(snap.tokens, ["side", "t", "tokens"])


def kv_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, t, kind ("reserved" | "used"), bytes, mib."""
    df = _frame(snap.kv, ["side", "t", "kind", "bytes"])
    df["mib"] = df["bytes"].astype(float) / 2**20
    return df


def batch_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """t, num_seqs: sequences in each datacenter engine step."""
    return _frame(snap.batch, ["t", "num_seqs"])


def latency_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """side, user, metric ("TTFT" | "end-to-end"), seconds: one row per finished request
    and metric."""
    long = rows_frame(snap).melt(id_vars=["side", "user"], value_vars=["ttft_s", "e2e_s"],
                                 var_name="metric", value_name="seconds")
    long["metric"] = long["metric"].map({"ttft_s": "TTFT", "e2e_s": "end-to-end"})
    return long


def rows_frame(snap: RaceSnapshot) -> pd.DataFrame:
    """One row per finished request: the table and the CSV."""
    return _frame(snap.rows, ROW_COLUMNS)
