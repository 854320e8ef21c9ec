"""The Fleet page in headless Chromium against `streamlit run app.py`: a short run from
the form, its figures and charts drawn, and the presenter's day."""

from __future__ import annotations

import pytest
from page_geometry import cut_figures

pytestmark = [pytest.mark.browser, pytest.mark.model]  # the app loads the shared engine


def open_fleet(browser, url: str):
    page = browser.new_context(viewport={"width": 1600, "height": 1100}).new_page()
    page.set_default_timeout(180_000)
    page.goto(f"{url}/fleet")
    page.get_by_role("button", name="Run", exact=True).wait_for()
    return page


def test_a_short_run_draws_its_figures_and_charts(server, browser, tmp_path):
    page = open_fleet(browser, server)
    hours = page.get_by_label("Simulated hours", exact=True)
    hours.fill("0.05")
    rate = page.get_by_label("Output tokens/s (peak)", exact=True)
    rate.fill("300")
    page.get_by_role("button", name="Run", exact=True).click()
    gpu = page.locator("[data-testid='stMetric']").filter(has_text="GPU-hours")
    gpu.locator("[data-testid='stMetricValue']").wait_for()
    page.locator("[data-testid='stVegaLiteChart']").nth(4).wait_for()
    text = page.locator("[data-testid='stMarkdownContainer']").filter(
        has_text="simulated hours (simulated in").first.inner_text()
    assert "over 0.05 simulated hours" in text
    done, dropped = (page.locator("[data-testid='stMetric']").filter(has_text=name)
                     .locator("[data-testid='stMetricValue']").inner_text()
                     for name in ("Finished", "Dropped"))
    assert int(done.replace(",", "")) > 0 and dropped == "0"
    page.screenshot(path=str(tmp_path / "fleet.png"), full_page=True)
    assert (tmp_path / "fleet.png").stat().st_size > 10_000
    # the run's figures fit a 1280 px laptop screen beside the sidebar ("138.7 / 153.4 ms"
    # in one figure did not), and a 1024 px tablet's, where rows of figures wrap
    for width, height in ((1280, 800), (1024, 768)):
        page.set_viewport_size({"width": width, "height": height})
        assert not cut_figures(page), width
