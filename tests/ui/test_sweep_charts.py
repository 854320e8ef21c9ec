"""The sweep page's frames and chart builders, checked through `chart.to_dict()` (no model)."""

from __future__ import annotations

import pandas as pd

from ui import sweep_charts as charts

# Made-up rows in workloads.sweep's CSV columns, for the chart builders only.
EXAMPLE_ROWS = [
    {"side": side, "users": u, "throughput_tokens_per_s": tps * (u if side == "datacenter" else 1),
     "per_user_tokens_per_s_p50": tps / (1 if side == "datacenter" else u),
     "ttft_p50_s": 0.1 * u, "ttft_p99_s": 0.2 * u, "e2e_p50_s": 1.0 * u, "e2e_p99_s": 2.0 * u,
     "goodput_rps": 1.0 / u}
    for side, tps in (("datacenter", 20.0), ("local", 25.0)) for u in (1, 2, 4)
]
EXAMPLE_ROOF = [{"users": u, "total": 100.0 * u, "per_user": 100.0, "bound": "memory"}
                for u in (1, 2, 3, 4)]


def values(vega: dict, part: dict | None = None) -> list[dict]:
    """The rows of a Vega-Lite dict (or of one of its layers)."""
    return vega["datasets"][(part or vega)["data"]["name"]]


def points() -> pd.DataFrame:
    return charts.points_frame(EXAMPLE_ROWS)


def test_points_frame_names_the_sides_for_the_legend():
    assert set(points()["side"]) == {"Datacenter", "Local PC"}
    assert charts.points_frame([]).empty


def test_throughput_chart_draws_the_roofline_beneath_the_measured_lines():
    vega = charts.throughput_chart(points(), charts.roofline_frame(EXAMPLE_ROOF)).to_dict()
    roof, measured = vega["layer"]
    assert roof["mark"]["strokeDash"] and roof["encoding"]["y"]["field"] == "total"
    assert [r["total"] for r in values(vega, roof)] == [100.0, 200.0, 300.0, 400.0]
    assert measured["encoding"]["y"]["field"] == "throughput_tokens_per_s"
    assert measured["encoding"]["y"]["scale"]["type"] == "log"
    x = measured["encoding"]["x"]
    assert x["field"] == "users" and x["scale"] == {"type": "log", "base": 2}
    assert measured["encoding"]["color"]["scale"]["domain"] == [
        "Local PC", "Datacenter", charts.ROOF]
    assert len(values(vega, measured)) == 6


def test_rate_mode_and_no_roofline_draw_the_two_sides_only():
    df = points().rename(columns={"users": "rate_rps"})
    vega = charts.throughput_chart(df, charts.roofline_frame(EXAMPLE_ROOF), "rate_rps").to_dict()
    (measured,) = vega["layer"]
    assert measured["encoding"]["x"]["field"] == "rate_rps"
    assert "requests/s" in measured["encoding"]["x"]["title"]
    assert measured["encoding"]["color"]["scale"]["domain"] == ["Local PC", "Datacenter"]
    assert len(charts.per_user_chart(points(), None).to_dict()["layer"]) == 1


def test_per_user_chart_uses_the_median_and_the_per_user_roofline():
    vega = charts.per_user_chart(points(), charts.roofline_frame(EXAMPLE_ROOF)).to_dict()
    roof, measured = vega["layer"]
    assert roof["encoding"]["y"]["field"] == "per_user"
    assert measured["encoding"]["y"]["field"] == "per_user_tokens_per_s_p50"


def test_latency_chart_has_p50_solid_and_p99_dashed_per_side():
    long = charts.latency_frame(points(), "users", "ttft")
    assert len(long) == 12 and set(long["percentile"]) == {"p50", "p99"}
    local4 = long[(long["side"] == "Local PC") & (long["users"] == 4)]
    assert sorted(local4["seconds"]) == [0.4, 0.8]
    vega = charts.latency_chart(long, "users", "TTFT").to_dict()
    assert vega["encoding"]["strokeDash"]["scale"]["domain"] == ["p50", "p99"]
    assert vega["encoding"]["y"]["scale"]["type"] == "log"
    assert vega["title"] == "TTFT" and len(values(vega)) == 12


def test_goodput_chart_is_linear_from_zero():
    vega = charts.goodput_chart(points()).to_dict()
    assert vega["encoding"]["y"]["field"] == "goodput_rps"
    assert vega["encoding"]["y"]["scale"] == {"domainMin": 0}
    assert "SLO" in vega["title"]


def test_empty_frames_still_build_valid_charts():
    empty = charts.points_frame([])
    for chart in (charts.throughput_chart(empty, None), charts.per_user_chart(empty, None),
                  charts.latency_chart(charts.latency_frame(empty, "users", "e2e"), "users",
                                       "E2E"),
                  charts.goodput_chart(empty)):
        assert chart.to_dict()
