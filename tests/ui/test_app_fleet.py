"""The Fleet page (AppTest, run on its own: no model, no shared engine), its chart builders
(`chart.to_dict()`), and the presenter's scenario, which gives the same figures every run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from fleet import store
from fleet.report import behind
from fleet.scenarios import FleetParams, day_of_1000_users, run_scenario
from ui import fleet_charts as charts
from ui import fleet_view as view

PAGE = str(Path(__file__).resolve().parents[2] / "pages" / "fleet.py")
SMALL = dict(trace="steady", tokens_per_s=600.0, hours=0.05)


@pytest.fixture(autouse=True)
def fresh_results(monkeypatch, tmp_path):
    """Each test simulates afresh (the page keeps runs for the process, and the presenter's
    day on disk: here in a folder of the test's own) and the presenter's day is cut to its
    first half hour (the night: a few thousand requests)."""
    monkeypatch.setattr(view, "_RESULTS", {})
    monkeypatch.setattr(store, "FOLDER", tmp_path / "fleet")
    monkeypatch.setattr(view, "DAY_HOURS", 0.5)


def page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=300).run()
    assert not at.exception, at.exception
    return at


def pick(at: AppTest, **picks: object) -> None:
    for key, value in picks.items():
        widget = next(w for w in at.main if getattr(w, "key", None) == view.K + key)
        widget.set_value(value)


def press(at: AppTest, label: str) -> AppTest:
    next(b for b in at.button if b.label == label).click()
    at.run()
    assert not at.exception, at.exception
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_the_page_asks_for_a_run_first() -> None:
    at = page()
    assert [i.value for i in at.info] == [view.IDLE]
    assert not at.metric and not at.get("vega_lite_chart")
    # the local PCs by their datasheet names, not their keys
    local = next(w for w in at.selectbox if w.key == view.K + "local")
    assert local.options[0] == "Laptop CPU (DDR5-5600, 32 GB)" and local.value == "laptop_cpu"


def test_a_run_shows_the_simulations_own_figures_and_every_chart() -> None:
    at = page()
    pick(at, **SMALL)
    press(at, "Run")
    s, _ = run_scenario(FleetParams(**SMALL).scenario())
    assert metric(at, "Finished") == f"{s['finished']:,}"
    assert metric(at, "Dropped") == f"{s['dropped']:,}"
    assert metric(at, "GPU-hours") == f"{s['gpu_hours']:,.1f}"
    for key, label in view.LATENCY_FIGURES.items():  # one figure each beside the sidebar
        assert metric(at, label) == view.fmt_seconds(s[key])
    assert metric(at, "PCs") == f"{s['local']['pcs']:,}"
    assert len(at.get("vega_lite_chart")) == 5
    # one replica of this machine falls behind 600 tokens/s: the page says so, and why
    assert [w.value for w in at.warning] == [behind(s)] and behind(s) is not None


def test_a_fleet_that_keeps_up_shows_no_warning() -> None:
    at = page()
    pick(at, **SMALL | {"tokens_per_s": 60.0})
    press(at, "Run")
    assert at.metric and not at.warning


def test_a_bad_choice_is_a_readable_message() -> None:
    at = page()
    pick(at, trace="csv")
    press(at, "Run")
    assert [e.value for e in at.error] == [
        "Not started: trace: a CSV file is needed for the CSV trace"]


@pytest.mark.exhaustive
def test_the_presenter_day_gives_the_same_figures_twice(monkeypatch) -> None:
    at = page()
    press(at, "A day of a 1,000-user service")
    first = [(m.label, m.value) for m in at.metric]
    assert first and any("1,000 connected" in md.value for md in at.markdown)
    view._RESULTS.clear()
    for kept in store.FOLDER.glob("*.json"):
        kept.unlink()  # simulated again, not read back
    at.run()
    assert [(m.label, m.value) for m in at.metric] == first
    assert len(list(store.FOLDER.glob("*.json"))) == 1
    view._RESULTS.clear()  # a new process: read back from disk, drawn the same

    def not_simulated(*args, **kwargs):
        raise AssertionError("the stored day is simulated again")

    monkeypatch.setattr(view, "run_scenario", not_simulated)
    at.run()
    assert not at.exception, at.exception
    assert [(m.label, m.value) for m in at.metric] == first


def test_presenter_mode_puts_the_day_s_headline_and_first_charts_first() -> None:
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.session_state["presenter"] = True
    at.run()
    assert not at.exception, at.exception
    assert [i.value for i in at.info] == [view.IDLE_PRESENTER]  # the day's button first
    popover = at.get("popover")[0]  # the form folds into the bar's Settings popover
    assert {getattr(w, "key", None) for w in popover} >= {view.K + "trace", view.K + "layout"}
    press(at, "A day of a 1,000-user service")
    order = [e.type for e in at.main if e.type in ("metric", "vega_lite_chart")]
    first_chart = order.index("vega_lite_chart")
    assert order[:first_chart] == ["metric"] * 4  # latency and throughput, then the charts
    labels = [m.label for m in at.metric]
    assert labels[:4] == ["TTFT p50 / p99", "TPOT p50 / p99", "Throughput",
                          "Finished / dropped"]
    assert "GPU-hours" in labels[4:]  # the cost figures follow the charts
    assert len(at.get("vega_lite_chart")) == 5


@pytest.mark.exhaustive
def test_the_presenter_scenario_repeats_exactly() -> None:
    a, sa = run_scenario(day_of_1000_users(1800.0))
    b, sb = run_scenario(day_of_1000_users(1800.0))
    timing = {"wall_s", "cpu_s"}
    assert {k: v for k, v in a.items() if k not in timing} == {
        k: v for k, v in b.items() if k not in timing}
    assert sa == sb
    assert a["requests"] > 1000


def test_the_chart_builders_draw_what_they_are_given() -> None:
    tokens = pd.DataFrame({"hour": [0.5, 0.5, 0.5], "series": ["demand", "delivered",
                                                               "capacity"],
                           "tokens_per_s": [100.0, 90.0, 300.0]})
    spec = charts.tokens_chart(tokens).to_dict()
    assert spec["mark"]["type"] == "line"
    assert spec["encoding"]["color"]["scale"]["domain"] == ["demand", "delivered", "capacity"]
    lat = pd.DataFrame({"hour": [1.0, 1.0], "metric": ["TTFT", "TPOT"],
                        "percentile": ["p99", "p50"], "seconds": [0.2, 0.01]})
    spec = charts.latency_chart(lat).to_dict()
    assert spec["encoding"]["y"]["scale"]["type"] == "log"
    rows = next(iter(spec["datasets"].values()))
    assert sorted(r["series"] for r in rows) == ["TPOT p50", "TTFT p99"]
    assert sorted(r["ms"] for r in rows) == [10.0, 200.0]
    empty = charts.latency_chart(charts.frame([], ["hour", "metric", "percentile",
                                                   "seconds"])).to_dict()
    assert empty["mark"]["type"] == "line"
    reps = charts.replicas_chart(pd.DataFrame({"hour": [0.0], "state": ["ready"],
                                               "replicas": [3]})).to_dict()
    assert reps["encoding"]["y"]["stack"] is True
