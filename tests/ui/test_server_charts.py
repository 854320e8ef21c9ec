"""The remote server's state over time: rows from readings, and the chart built from them."""

from __future__ import annotations

from server.remote_metrics import ServerState, StateSample
from ui.server_charts import SERIES, history_frame, state_chart


def readings() -> list[StateSample]:
    return [StateSample(100.0, ServerState(0, 0, 0.0, "batchlens")),
            StateSample(100.5, ServerState(8, 3, 0.25, "batchlens")),
            StateSample(101.0, ServerState(2, 0, None, "vllm"))]


def test_rows_are_seconds_since_the_first_reading_per_series():
    df = history_frame(readings())
    assert list(df.columns) == ["t", "series", "value"]
    assert df[df.series == "running"][["t", "value"]].values.tolist() == [
        [0.0, 0.0], [0.5, 8.0], [1.0, 2.0]]
    assert df[df.series == "waiting"]["value"].tolist() == [0.0, 3.0, 0.0]
    # KV usage only where the server exported it
    assert df[df.series == "KV cache used"][["t", "value"]].values.tolist() == [
        [0.0, 0.0], [0.5, 0.25]]
    assert history_frame([]).empty


def test_the_chart_puts_requests_left_and_kv_usage_right_in_percent():
    vega = state_chart(history_frame(readings())).to_dict()
    left, right = vega["layer"]
    assert left["encoding"]["y"]["title"] == "requests"
    assert right["encoding"]["y"]["axis"] == {"format": "%", "orient": "right"}
    assert right["encoding"]["y"]["scale"] == {"domain": [0, 1]}
    assert vega["resolve"] == {"scale": {"y": "independent"}}
    assert left["encoding"]["color"]["scale"]["domain"] == list(SERIES)
    rows = next(iter(vega["datasets"].values()))
    assert len(rows) == 8 and {r["series"] for r in rows} == set(SERIES)
