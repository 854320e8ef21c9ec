"""AppTest of the sweep page: controls, a tiny sweep to the end, its table and CSV, stop."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pandas as pd
import pytest
from apptest import new_app, run_until, wait_idle
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest

from ui import shared, sweep_view
from workloads.sweep import DEFAULT_USERS, SweepPlan, SweepSnapshot

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("fresh_engine")]
PAGE = "pages/sweep.py"


def sweep_page() -> AppTest:
    at = new_app().switch_page(PAGE).run()
    assert not at.exception, at.exception
    return at


def sweep_of(at: AppTest):
    return at.session_state[sweep_view.SLOT.key]


@pytest.fixture
def downloads(monkeypatch) -> dict[str, bytes]:
    """What each download button would hand the browser, by file name."""
    saved: dict[str, bytes] = {}
    original = MemoryMediaFileStorage.load_and_get_id

    def record(self, path_or_data, mimetype, kind, filename=None):
        saved[filename] = path_or_data
        return original(self, path_or_data, mimetype, kind, filename)

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", record)
    return saved


def metric(at: AppTest, label_start: str) -> str:
    return next(m.value for m in at.metric if m.label.startswith(label_start))


def test_page_shows_the_default_sweep_an_empty_layout_and_needs_a_load():
    at = sweep_page()
    assert at.header[0].value.startswith("Sweep")
    assert at.multiselect(key="sweep_users").value == list(DEFAULT_USERS)
    assert at.number_input(key="sweep_max_tokens").value == 16
    assert not at.button(key="sweep_run_button").disabled
    assert at.button(key="sweep_stop").disabled
    assert any("127 requests per side" in c.value for c in at.caption)
    assert at.info and "Run sweep" in at.info[0].value
    assert len(at.get("vega_lite_chart")) == 5  # four charts and goodput, empty, before Run
    at.multiselect(key="sweep_users").set_value([]).run()
    assert at.button(key="sweep_run_button").disabled
    assert any("levels" in c.value for c in at.caption)


def test_a_tiny_sweep_runs_to_a_summary_table_and_csv(downloads):
    at = sweep_page()
    at.multiselect(key="sweep_users").set_value([1, 2])
    at.number_input(key="sweep_max_tokens").set_value(2)
    at.button(key="sweep_run_button").click().run()
    assert at.button(key="sweep_run_button").disabled and not at.button(key="sweep_stop").disabled
    run_until(at, lambda a: bool(a.success) or bool(a.error) or bool(a.warning))
    assert not at.error, at.error[0].value
    assert "the datacenter's total" in at.success[0].value
    table = at.dataframe[0].value
    assert len(table) == 4 and list(table["users"]) == [1, 1, 2, 2]
    assert list(table["side"]) == ["datacenter", "local"] * 2
    assert list(table["output_tokens"]) == [2, 2, 4, 4]
    assert {"throughput_tokens_per_s", "ttft_p99_s", "e2e_p50_s", "goodput_rps"} <= set(table)
    assert len(at.get("download_button")) == 1
    csv = pd.read_csv(io.BytesIO(downloads["batchlens-sweep.csv"]))
    assert len(csv) == 4 and list(csv["users"]) == [1, 1, 2, 2]
    assert list(csv["output_tokens"]) == [2, 2, 4, 4] and list(csv.columns) == list(table)
    assert len(at.get("vega_lite_chart")) == 5
    best = table[table["side"] == "datacenter"]["throughput_tokens_per_s"].max()
    assert metric(at, "Measured tokens/s") == sweep_view.fmt_number(best)
    assert not at.button(key="sweep_run_button").disabled  # inputs are enabled again


def test_stop_ends_the_sweep_and_frees_its_blocks():
    at = sweep_page()
    at.multiselect(key="sweep_users").set_value([1, 8])
    at.number_input(key="sweep_max_tokens").set_value(24)
    at.button(key="sweep_run_button").click().run()
    sweep = sweep_of(at)
    run_until(at, lambda a: len(sweep.snapshot().points) >= 1)
    at.button(key="sweep_stop").click().run()
    run_until(at, lambda a: bool(a.warning))
    assert "Stopped after" in at.warning[0].value
    engine = shared.shared_engine().engine
    wait_idle(engine)
    kv = engine.stats().kv
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == kv.num_blocks
    assert len(at.dataframe[0].value) == len(sweep.snapshot().points) < 4


def test_rate_mode_sweeps_poisson_arrivals_without_a_roofline():
    at = sweep_page()
    at.radio(key="sweep_mode").set_value("rate").run()
    at.multiselect(key="sweep_rates").set_value([4.0])
    at.slider(key="sweep_duration").set_value(2)
    at.number_input(key="sweep_max_tokens").set_value(2)
    at.button(key="sweep_run_button").click().run()
    run_until(at, lambda a: bool(a.success) or bool(a.error) or bool(a.warning))
    assert not at.error, at.error[0].value
    table = at.dataframe[0].value
    requests = len(sweep_of(at).plan.arrivals(4.0))
    assert list(table["rate_rps"]) == [4.0, 4.0] and list(table["requests"]) == [requests] * 2
    assert any("No roofline in rate mode" in c.value for c in at.caption)


def test_the_calculator_names_an_out_of_range_number_instead_of_dropping_it():
    at = sweep_page()
    at.number_input(key="sweep_each").set_value(5000.0).run()
    at.number_input(key="sweep_connected").set_value(0).run()
    errors = [e.value for e in at.error]
    assert ("Tokens/s each active user needs: 5,000 is out of range; enter a number from "
            "0.5 to 1,000") in errors
    assert ("Connected users: 0 is out of range; enter a whole number from 1 to "
            "100,000,000") in errors
    assert not at.exception


def test_the_progress_names_the_load_being_measured_in_words():
    def current(plan: SweepPlan, side: str, level: float) -> str:
        snap = SweepSnapshot("running", 0.0, 0.0, (side, level), (), False, None)
        return sweep_view._current(snap, SimpleNamespace(plan=plan))

    users = SweepPlan(levels=(1, 2))
    assert current(users, "datacenter", 1) == "datacenter, 1 user"
    assert current(users, "local", 2) == "local PC, 2 users"
    assert current(SweepPlan("rate", (0.5,)), "local", 0.5) == "local PC, 0.5 requests/s"


def test_the_presenters_summary_drops_only_the_local_pcs_clause():
    dc, local = sweep_view.DATACENTER, sweep_view.LOCAL
    points = pd.DataFrame({"side": [dc, local, dc, local],
                           "users": [1, 1, 64, 64],
                           "throughput_tokens_per_s": [80.0, 90.0, 2000.0, 85.0]})
    full = sweep_view.summary_sentence(points, "users")
    short = sweep_view.summary_sentence(points, "users", short=True)
    assert full == ("From 1 to 64 users, the datacenter's total rose from 80.0 to 2,000 "
                    "tokens/s (25.0x); the local PC, serving one user at a time, stayed "
                    "between 85.0 and 90.0 tokens/s.")
    assert short == full.replace("the local PC, serving one user at a time,", "the local PC's")
