"""Presenter mode on a projector's screen, in a real browser, by DOM geometry: at 1280x720
and 1920x1080, once a page's scenario has begun, its headings, headline numbers and main
figure lie inside the viewport and no metric value is wider than its box or wraps; the
clicker's keys start the next and the previous scenario.

Nothing is timed and no pixel is compared: each check polls the DOM (tests/polling.py)
until the scenario's state is on the page, then reads the boxes (tests/ui/page_geometry.py).
A page added later gets the same test by adding one `PresenterView` row to `VIEWS`.

Screenshots of each view at 1280x720 go to a temporary folder, or to assets/ under
`make screenshots` (BATCHLENS_SCREENSHOTS=assets), as the README's presenter images.
"""

from __future__ import annotations

import pytest
from page_geometry import PresenterView, misfits
from polling import wait_for
from test_browser import RACE_TIMEOUT_MS, act_until, click_until, shots  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.model]

SIZES = ((1280, 720), (1920, 1080))
SHOT_SIZE = (1280, 720)
FIT_TIMEOUT_S = 30.0  # how long a begun scenario's page may take to settle into place
METRIC_VALUE = "[data-testid='stMetricValue']"
FIRST_CHART = "[data-testid='stVegaLiteChart']"


def side(name: str) -> tuple[str, str]:
    """A race panel's heading and headline number."""
    return (f".st-key-side-{name} h3", f".st-key-headline-{name} {METRIC_VALUE}")


VIEWS = (
    PresenterView("arena", "Arena", "32 users",
                  ".st-key-side-datacenter:has-text('had an answer after')",
                  (*side("local"), *side("datacenter")), stop="Stop"),
    PresenterView("kv_cache", "KV cache", "8 users sharing a 300-token system prompt",
                  ".st-key-kv-shown:has-text('Showing the engine of the scenario'), "
                  ".st-key-kv-result",
                  ("[data-testid='stColumn']:has(.st-key-kv-paged-caption) " + FIRST_CHART,),
                  stop="Stop"),
    PresenterView("sweep", "Sweep", "Run sweep", "[data-testid='stProgress']",
                  (FIRST_CHART,), stop="Stop", shot_when=".st-key-sweep-summary"),
    PresenterView("hardware", "Hardware", None, FIRST_CHART,
                  (FIRST_CHART,)),
    # the scenario's last layout: its verdict, decode figures and both charts
    PresenterView("datacenter", "Datacenter", "TP=8: PCIe 5.0",
                  ".st-key-dc_stage_tp8-pcie5 [data-testid='stBaseButton-primary']",
                  (".st-key-dc-verdict", f".st-key-dc-decode-metrics {METRIC_VALUE}",
                   f".st-key-dc-decode-chart {FIRST_CHART}",
                   f".st-key-dc-breakdown-chart {FIRST_CHART}")),
    # the day's figures and its first row of charts, once simulated (or read from disk)
    PresenterView("fleet", "Fleet", "A day of a 1,000-user service",
                  f".st-key-fleet-replicas-chart {FIRST_CHART}",
                  (f".st-key-fleet-headline {METRIC_VALUE}",
                   f".st-key-fleet-tokens-chart {FIRST_CHART}",
                   f".st-key-fleet-replicas-chart {FIRST_CHART}")),
)


def presenter_page(browser, url: str, width: int, height: int):
    """A tab at `width` x `height` on the arena in presenter mode, its buttons drawn."""
    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.set_default_timeout(120_000)
    page.goto(f"{url}/?presenter=1")
    # the module's first page load also loads the model, slow on a busy machine
    page.get_by_role("button", name="One user", exact=True).wait_for(timeout=RACE_TIMEOUT_MS)
    return page


def wait_until_fits(page, selectors: tuple[str, ...]) -> None:
    """Poll until every selector lies inside the viewport and no metric overflows; fail
    with what was still wrong."""
    last: list[list[str]] = [[]]

    def fits() -> bool:
        last[0] = misfits(page, selectors)
        return not last[0]

    try:
        wait_for(fits, FIT_TIMEOUT_S, interval=0.25)
    except AssertionError:
        raise AssertionError(f"at {page.viewport_size}: {last[0]}") from None


def enabled(page, name: str) -> bool:
    button = page.get_by_role("button", name=name, exact=True)
    return button.count() == 1 and button.is_enabled()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.name)
def test_a_begun_scenario_fits_the_screen(server, browser, shots, view, size):  # noqa: F811
    page = presenter_page(browser, server, *size)
    if view.name != "arena":
        page.get_by_role("link", name=view.link, exact=True).click()
    if view.scenario is not None:
        button = page.get_by_role("button", name=view.scenario, exact=True)
        wait_for(button.is_enabled, 120, f"{view.scenario} never enabled", interval=0.25)
        button.click()
    page.locator(view.started).first.wait_for(timeout=RACE_TIMEOUT_MS)
    wait_until_fits(page, view.above_fold)
    if size == SHOT_SIZE and view.name != "arena":  # the arena's: once its race has ended
        if view.shot_when is not None:
            page.locator(view.shot_when).first.wait_for(timeout=RACE_TIMEOUT_MS)
            wait_until_fits(page, view.above_fold)
        screenshot(page, shots / f"presenter_{view.name}.png")
    if view.stop is not None:
        click_stop(page, view.stop)
    page.context.close()


def click_stop(page, name: str = "Stop", tries: int = 4) -> None:
    """Click Stop until it is disabled (nothing runs), again where a click was lost, as a
    presenter would; a scenario that ends between a check and the click disables Stop by
    itself."""
    button = page.get_by_role("button", name=name, exact=True)
    if not click_until(button, lambda: not enabled(page, name), tries, 20):
        raise AssertionError(f"{name} clicked {tries} times and still enabled: "
                             f"{race_state(page)}")


def press_until(page, key: str, done, tries: int = 3, wait_s: float = 20) -> bool:
    """Press `key` until `done()` holds (`act_until`): a press made before the clicker's
    listener is mounted, or while a rerun mounts it again, is lost. It is made again only
    once the page is idle: a rerun under way may be the last press taking effect."""
    def idle() -> None:
        wait_for(lambda: done() or page.locator("[data-testid='stStatusWidget']").count() == 0,
                 60, "the page stayed busy", interval=0.25)

    return act_until(lambda: page.keyboard.press(key), done, tries, wait_s, settle=idle)


def screenshot(page, path) -> None:
    """The screen as the audience sees it: the pointer moved off the buttons first, so no
    tooltip covers the page, and every widget drawn (a page whose chart is up may still
    show grey placeholders for the widgets above it)."""
    width, height = page.viewport_size["width"], page.viewport_size["height"]
    page.mouse.move(width - 2, height - 2)
    page.get_by_role("tooltip").first.wait_for(state="hidden")
    page.locator("[data-testid^='stSkeleton']").first.wait_for(state="detached")
    page.screenshot(path=str(path))


def test_the_ended_race_and_its_ratio_fit_above_the_panels(server, browser,  # noqa: F811
                                                           shots):  # noqa: F811
    page = presenter_page(browser, server, *SHOT_SIZE)
    page.get_by_role("button", name="32 users", exact=True).click()
    page.locator(".st-key-summary").wait_for(timeout=RACE_TIMEOUT_MS)
    assert "The datacenter served 32 users" in page.locator(".st-key-summary").inner_text()
    wait_until_fits(page, (".st-key-summary", *side("local"), *side("datacenter")))
    summary = page.locator(".st-key-summary").bounding_box()
    panel = page.locator(".st-key-side-local").bounding_box()
    assert summary["y"] + summary["height"] <= panel["y"]  # the sentence is above the panels
    assert page.get_by_text("The last of 32 users had an answer after").count() == 2
    screenshot(page, shots / "presenter_arena.png")
    page.context.close()


def played(page) -> str | None:
    """The scenario the bar highlights (the last one started), by its button's key."""
    return page.evaluate("""() => {
      const b = document.querySelector('[class*="st-key-scenario-"] '
                                        + '[data-testid="stBaseButton-primary"]');
      const box = b && b.closest('[class*="st-key-scenario-"]');
      return box ? [...box.classList].find(c => c.startsWith('st-key-scenario-'))
                     .replace('st-key-scenario-', '') : null; }""")


def users_in_race(page) -> str:
    """The datacenter panel's "Finished" figure, e.g. "0/32", once the panel shows one:
    while a rerun replaces the panel, its old figure can stand beside the new one."""
    value = page.locator(".st-key-side-datacenter [data-testid='stMetric']").filter(
        has_text="Finished").locator(METRIC_VALUE)
    wait_for(lambda: value.count() == 1, 30, "the datacenter panel never settled on one "
             "Finished figure", interval=0.1)
    return value.inner_text()


def race_state(page) -> str:
    """What the page shows of the race, for a failure's message."""
    stop = "enabled" if enabled(page, "Stop") else "disabled"
    finished = users_in_race(page) if page.locator(".st-key-side-datacenter").count() else "-"
    return f"at {page.url}, {played(page)} played, Stop {stop}, finished {finished}"


def test_clicker_keys_start_the_next_and_the_previous_scenario(server, browser):  # noqa: F811
    page = presenter_page(browser, server, *SHOT_SIZE)
    assert page.get_by_text("Clicker: PageDown or →").count() == 1  # the hint is shown
    # nothing played yet: the first scenario
    if not press_until(page, "PageDown", lambda: played(page) == "one_user"):
        raise AssertionError(f"PageDown did not start One user: {race_state(page)}")
    page.locator(".st-key-summary").wait_for(timeout=RACE_TIMEOUT_MS)
    assert users_in_race(page) == "1/1"
    wait_for(lambda: enabled(page, "32 users"), 60, "the buttons stayed disabled",
             interval=0.25)
    if not press_until(page, "ArrowRight", lambda: played(page) == "many_users"
                       and users_in_race(page).endswith("/32")):
        raise AssertionError(f"ArrowRight did not start 32 users: {race_state(page)}")
    click_stop(page)
    try:
        wait_for(lambda: enabled(page, "One user"), 60, interval=0.25)
    except AssertionError:
        raise AssertionError(f"Stop did not end the race: {race_state(page)}") from None
    if not press_until(page, "PageUp", lambda: played(page) == "one_user"
                       and users_in_race(page).endswith("/1")):
        raise AssertionError(f"PageUp did not start One user again: {race_state(page)}")
    page.locator(".st-key-summary").wait_for(timeout=RACE_TIMEOUT_MS)
    page.context.close()
