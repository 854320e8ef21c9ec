"""The Datacenter page in a real browser (Chromium, as in test_browser.py): every system ×
TP choice renders without an exception and shows the projection's verdict, an impossible
layout says why in one line, and the presenter's "70B on 8 GPUs" gives the same text
every run. Screenshot: assets/datacenter.png when BATCHLENS_SCREENSHOTS is set."""

from __future__ import annotations

import pytest
from polling import wait_for
from test_browser import shots  # noqa: F401  (a fixture)

from measure import projection as P
from ui import datacenter_view as view

pytestmark = [pytest.mark.browser, pytest.mark.model]
MODEL = "llama-3.1-70b"
# NVLink 4, NVLink 5 and PCIe systems, in the browser; tests/ui/test_app_datacenter.py
# renders every system × TP choice
BROWSER_SYSTEMS = ("h100_sxm", "b200_sxm", "l40s")


def open_page(browser, url: str):
    page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
    page.set_default_timeout(300_000)  # a busy machine: the model load, then the tables
    page.goto(url)  # the front door first: the session opens on the app's navigation
    page.get_by_label("Your prompt").wait_for()  # the first start loads the model
    page.locator("[data-testid='stSidebarNav'] a", has_text="Datacenter").click()
    page.locator(".st-key-dc-verdict").wait_for()  # the first visit compiles the layout
    return page


def verdict(page) -> str:
    return page.locator(".st-key-dc-verdict").inner_text().strip()


def expected(system: str, tp: int) -> str:
    layout = P.Layout(MODEL, system, "trtllm", tp=tp)
    found = P.check(layout, 2048, 64)
    return found.reason if not found.ok else f"Fits: {layout.label()}"


def choose_system(page, name: str) -> None:
    page.locator(".st-key-dc_system").click()
    page.get_by_role("option", name=name, exact=True).click()


def choose_tp(page, tp: int) -> None:
    page.locator(".st-key-dc_tp").get_by_text(str(tp), exact=True).click()


def settled(page, want: str) -> bool:
    """The verdict shows `want` and the rerun has finished (no 'running' indicator)."""
    try:
        text = verdict(page)
    except Exception:  # redrawn while read
        return False
    running = page.locator("[data-testid='stStatusWidget']").count() > 0
    return text.startswith(want) and not running


def test_every_system_and_tp_renders_and_says_why(server, browser, shots):  # noqa: F811
    page = open_page(browser, server)
    assert verdict(page).startswith(expected("h100_sxm", 8))
    for system in BROWSER_SYSTEMS:  # the AppTest walks every system; here one per link
        choose_system(page, P.get_system(system).name)
        for tp in P.TP_SIZES:
            choose_tp(page, tp)
            want = expected(system, tp)
            wait_for(lambda w=want: settled(page, w), 300, f"{system} TP={tp}: {want}")
            assert page.locator("[data-testid='stException']").count() == 0, (system, tp)
            assert "\n" not in verdict(page), verdict(page)
    # back to the default layout for the picture
    choose_system(page, P.get_system("h100_sxm").name)
    choose_tp(page, 8)
    wait_for(lambda: settled(page, expected("h100_sxm", 8)), 300, "back to H100 TP=8")
    page.locator("[data-testid='stVegaLiteChart']").first.wait_for()
    page.set_viewport_size({"width": 1600, "height": 2400})
    page.wait_for_timeout(1500)  # let charts finish drawing
    page.screenshot(path=str(shots / "datacenter.png"))
    page.context.close()


def test_the_scenario_gives_the_same_text_every_run(server, browser):
    shown = []
    for _ in range(2):
        page = open_page(browser, f"{server}")
        page.get_by_role("button", name="70B on 8 GPUs", exact=True).click()
        box = page.locator(".st-key-dc-scenario")
        box.wait_for()
        box.locator("strong", has_text="TP=8: the same eight over PCIe 5.0").wait_for()
        box.get_by_text("as measured on RTX PRO 6000", exact=False).last.wait_for()
        # the sentences, not the chart (whose axis labels draw when they are ready)
        shown.append(box.locator("[data-testid='stMarkdownContainer']").all_inner_texts())
        page.context.close()
    assert shown[0] == shown[1]
    text = " ".join(shown[0])
    pcie = view.scenario_frame()["comm_share"].iloc[-1]
    assert "Does not fit" in text and "fits;" in text and f"{pcie:.0%} of each step" in text
