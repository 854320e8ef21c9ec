"""The dashboard in a real browser: Debian's Chromium driven by Playwright's Python package.

The app is started with `streamlit run` on a free localhost port, once for the browser
modules that want it as `make run` starts it (`server`, tests/ui/conftest.py). Tests
wait on specific elements (metrics, charts, the summary), never on network idle: the
page streams over a websocket.

The server runs torch on one thread (OMP_NUM_THREADS=1; BATCHLENS_BROWSER_THREADS
overrides): on a 2-core machine shared with other jobs and with the browser itself, two
OpenMP threads stall at every barrier (seen: 13 vs 93 tokens/s for the same race). These
tests check the page, not the speed; the one speed assertion (datacenter > local) holds
either way.

Screenshots go to a temporary folder, so a test run leaves the checkout as it was;
`make screenshots` sets BATCHLENS_SCREENSHOTS=assets to refresh the README's images.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from page_geometry import cut_figures
from polling import wait_for

from server.child import child_server, free_port

pytestmark = [pytest.mark.browser, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
RACE_TIMEOUT_MS = 480_000
# Stop or a closed tab: the longest wait for every block of the race to be free. A bound on
# a hang, not the promise: an uncancelled race of these runs minutes longer, and "freed
# before the next step" is checked in engine steps (tests/server/test_cancel.py)
FREED_TIMEOUT_S = 60.0
STRIP = re.compile(r"running: (\d+) · waiting: (\d+) · yours: (\d+)")


@contextlib.contextmanager
def streamlit_server(folder: Path, args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> Iterator[str]:
    """`streamlit run app.py` on a free localhost port, its log in `folder`; yields its URL.
    `args` and `env` add Streamlit options and environment variables. The Fleet page's
    presenter day is cut to its first hour (its layout is the day's, in seconds) unless
    BATCHLENS_FLEET_DAY_HOURS says otherwise (`make screenshots`: the whole day)."""
    port = free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
           "--server.fileWatcherType", "none", "--server.port", str(port), *args]
    threads = os.environ.get("BATCHLENS_BROWSER_THREADS", "1")
    url = f"http://localhost:{port}"
    with child_server(cmd, f"{url}/_stcore/health", log=folder / "server.log", timeout=120,
                      env={**os.environ, "OMP_NUM_THREADS": threads,
                           "BATCHLENS_FLEET_DAY_HOURS":
                               os.environ.get("BATCHLENS_FLEET_DAY_HOURS", "1"),
                           **(env or {})},
                      cwd=ROOT):
        yield url


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: $BATCHLENS_SCREENSHOTS (relative to the repository), else a
    temporary folder."""
    folder = os.environ.get("BATCHLENS_SCREENSHOTS")
    if not folder:
        return tmp_path_factory.mktemp("screenshots")
    path = ROOT / folder  # an absolute folder stays as it is
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_arena(browser, url: str):
    page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
    page.set_default_timeout(120_000)
    page.goto(url)
    page.get_by_label("Your prompt").wait_for()  # the first start loads the model
    return page


def set_up_race(page, prompt: str, users: int, max_tokens: int) -> None:
    box = page.get_by_label("Your prompt")
    box.fill(prompt)
    box.blur()  # a text area commits on blur
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # A number typed while the prompt's rerun redraws the form can be drawn over with the
    # old value (seen once in CI: 120 s without the values); type them again then.
    for attempt in range(3):
        for label, value in (("Users", users), ("Max tokens", max_tokens)):
            field = page.get_by_label(label, exact=True)
            field.fill(str(value))
            field.press("Enter")
        try:
            page.wait_for_function(
                "([u, m]) => [...document.querySelectorAll('input')].some(i => i.value === u)"
                " && [...document.querySelectorAll('input')].some(i => i.value === m)",
                arg=[str(users), str(max_tokens)], timeout=30_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    assert page.get_by_role("button", name="Run", exact=True).is_enabled()


def click_run(page) -> None:
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_role("button", name="Stop", exact=True).wait_for(state="visible")


def wait_for_summary(page) -> str:
    summary = page.locator(".st-key-summary")
    summary.wait_for(timeout=RACE_TIMEOUT_MS)
    return summary.inner_text()


def total_tokens_per_s(page, side: str) -> float:
    metric = page.locator(f".st-key-side-{side} [data-testid='stMetric']").filter(
        has_text="Total tokens/s")
    return float(metric.locator("[data-testid='stMetricValue']").inner_text())


def test_datacenter_beats_the_local_pc_and_screenshot(server, browser, shots):
    page = open_arena(browser, server)
    set_up_race(page, "Explain in a few sentences why the sky is blue.", users=8, max_tokens=48)
    click_run(page)
    summary = wait_for_summary(page)
    assert "the datacenter engine generated" in summary
    for side in ("local", "datacenter"):
        finished = page.locator(f".st-key-side-{side} [data-testid='stMetric']").filter(
            has_text="Users finished").locator("[data-testid='stMetricValue']")
        assert finished.inner_text() == "8/8"
    datacenter, local = total_tokens_per_s(page, "datacenter"), total_tokens_per_s(page, "local")
    assert datacenter > local, (datacenter, local)
    charts = page.locator("[data-testid='stVegaLiteChart']")
    charts.nth(3).wait_for()
    assert charts.count() == 4
    page.get_by_role("button", name="Run", exact=True).wait_for()
    assert page.get_by_label("Your prompt").is_enabled()  # inputs are back after the run
    assert page.get_by_label("Max tokens", exact=True).input_value() == "48"
    # a finished race's figures ("0.16 s", "432.0") fit a 1280 px laptop screen too, where
    # each side's panel is under a third of the screen beside the sidebar, and a 1024 px
    # tablet's, where each side's rows of figures wrap
    for width, height in ((1280, 800), (1024, 768)):
        page.set_viewport_size({"width": width, "height": height})
        assert not cut_figures(page), width
    # Streamlit scrolls inside the page, so a tall viewport (not full_page) shows it all,
    # from the top: the click on Run leaves the page scrolled down to the race
    page.set_viewport_size({"width": 1600, "height": 3000})
    page.evaluate("document.querySelectorAll('*').forEach(e => { e.scrollTop = 0; })")
    charts.nth(3).wait_for()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(shots / "arena.png"))
    assert (shots / "arena.png").stat().st_size > 0
    page.context.close()


def test_two_sessions_share_the_engine_and_see_each_other(server, browser):
    pages = [open_arena(browser, server) for _ in range(2)]
    for page, prompt in zip(pages, ("Why do cats purr?", "Describe a sunny beach."),
                            strict=True):
        # long enough that both datacenter sides are in the shared engine together for a
        # few of the status strip's 1 s refreshes (24 tokens took under a second; 96 tokens,
        # ~1.3 s with the bfloat16 matmul kernel, once ended before the second race began);
        # one user each, as the local PC serves its users one after another
        set_up_race(page, prompt, users=1, max_tokens=256)
    for page in pages:
        click_run(page)
    saw_others = [False, False]
    deadline = time.monotonic() + RACE_TIMEOUT_MS / 1000
    while not all(p.locator(".st-key-summary").count() for p in pages):
        assert time.monotonic() < deadline, "the two races did not finish"
        for i, page in enumerate(pages):
            m = STRIP.search(page.locator(".st-key-status-strip").inner_text())
            if m:
                running, waiting, yours = map(int, m.groups())
                saw_others[i] |= running + waiting > yours
        time.sleep(0.2)
    assert saw_others == [True, True]
    for page in pages:
        assert "the datacenter engine generated" in wait_for_summary(page)
        page.context.close()


def strip_counts(page) -> tuple[int, int, int] | None:
    """(running, waiting, yours) from the status strip, or None before it is drawn."""
    m = STRIP.search(page.locator(".st-key-status-strip").inner_text())
    return tuple(map(int, m.groups())) if m else None


def all_blocks_free(page) -> bool:
    """The status strip shows nothing running or waiting and no KV block in use."""
    return (strip_counts(page) == (0, 0, 0)
            and "KV blocks used: 0/" in page.locator(".st-key-status-strip").inner_text())


def test_a_closed_tab_cancels_its_race_and_frees_its_blocks(server, browser):
    watcher = open_arena(browser, server)
    page = open_arena(browser, server)
    # 64 x 1024 tokens: minutes of work for the datacenter side alone, if not cancelled
    set_up_race(page, "Write a long story about a lighthouse keeper.", users=64,
                max_tokens=1024)
    click_run(page)
    wait_for(lambda: (strip_counts(page) or (0, 0, 0))[2] > 0, 60, "the race never started",
             interval=0.25)
    wait_for(lambda: (strip_counts(watcher) or (0, 0, 0))[0] > 0, 60,
             "the other tab never saw the race", interval=0.1)
    page.context.close()  # the websocket closes: the race sees its session gone
    closed = time.monotonic()
    wait_for(lambda: all_blocks_free(watcher), FREED_TIMEOUT_S,
             "the closed tab's requests still run or hold KV blocks", interval=0.05)
    print(f"closed tab: every block free on the other tab's strip after "
          f"{time.monotonic() - closed:.2f} s")
    watcher.context.close()


def test_api_clients_show_on_the_status_strip(server, browser):
    """The dashboard's own port serves the API on the same shared engine: 8 streaming API
    clients appear on the status strip as running requests (none of them the page's). A /v1
    path it lacks is the API's 404, not a page."""
    from openai import NotFoundError, OpenAI

    page = open_arena(browser, server)
    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    with pytest.raises(NotFoundError) as err:
        client.embeddings.create(model=model, input="Hi")
    assert err.value.body["code"] == "route_not_found"
    # a chat page on another origin may call the API, not read the dashboard's pages
    origin = {"Origin": "https://chat.example"}
    assert httpx.get(f"{server}/v1/models", headers=origin,
                     timeout=30).headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(server, headers=origin,
                                                          timeout=30).headers
    streams = [client.completions.create(
        model=model, prompt=f"Story number {i}: once upon a time", max_tokens=512,
        stream=True, extra_body={"ignore_eos": True}) for i in range(8)]
    try:
        for stream in streams:  # every request is in the engine once it streamed a chunk
            next(iter(stream))
        wait_for(lambda: (strip_counts(page) or (0, 0, 0))[0] >= 8, 60,
                 "the status strip never showed the 8 API requests running", interval=0.25)
        assert strip_counts(page)[2] == 0  # not this browser session's
    finally:
        for stream in streams:
            stream.close()  # a closed stream cancels its request
    wait_for(lambda: strip_counts(page) == (0, 0, 0), 60,
             "the closed API streams still run", interval=0.25)
    page.context.close()


def answers(page) -> list[str]:
    """Your answer as shown on each side (plain text blocks), once each side shows one:
    while a rerun replaces a panel, its old block can stand beside the new one."""
    shown = []
    for side in ("local", "datacenter"):
        block = page.locator(f".st-key-side-{side} [data-testid='stCode']")
        wait_for(lambda block=block: block.count() == 1, 30,
                 f"the {side} side never settled on one answer block", interval=0.1)
        shown.append(block.inner_text())
    return shown


def screenshot(page, folder: Path, name: str) -> None:
    page.set_viewport_size({"width": 1600, "height": 2400})
    page.wait_for_timeout(1500)  # let charts finish drawing
    page.screenshot(path=str(folder / f"presenter_{name}.png"))
    page.set_viewport_size({"width": 1600, "height": 1000})


def act_until(act: Callable[[], object], done: Callable[[], bool], tries: int, wait_s: float,
              settle: Callable[[], object] | None = None) -> bool:
    """`act()` until `done()` holds, waiting `wait_s` after each: an act that lands while
    Streamlit re-renders (a click, a key) is lost, so it is made again, at most `tries`
    times, after `settle()` where given. An act the page does not take (a disabled or gone
    button) is asked `done()` again. Returns whether `done()` held."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(tries):
        if done():  # an earlier act took effect late, or there is nothing to do
            return True
        try:
            act()
        except PlaywrightTimeout:
            continue
        try:
            wait_for(done, wait_s, interval=0.25)
            return True
        except AssertionError:
            if settle is not None:
                settle()
    return done()


def click_until(button, done: Callable[[], bool], tries: int, wait_s: float) -> bool:
    """Click `button` until `done()` holds (`act_until`)."""
    return act_until(lambda: button.click(timeout=15_000), done, tries, wait_s)


def remove_chip(page, name: str, tries: int = 6) -> None:
    """Click a multiselect chip's remove button until the chip is gone (a click that lands
    while the page's first run is still re-rendering the widget is lost)."""
    chip = page.get_by_role("button", name=name, exact=True)
    if not click_until(chip, lambda: chip.count() == 0, tries, 10):
        raise AssertionError(f"{name!r} still there after {tries} clicks")


def test_presenter_mode_scenario_replays_and_every_page(server, browser, shots):
    page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
    page.set_default_timeout(120_000)
    page.goto(f"{server}/?presenter=1")
    one_user = page.get_by_role("button", name="One user", exact=True)
    one_user.wait_for()
    assert page.get_by_text("Datacenter engine", exact=True).count() == 0  # settings hidden
    shown = []
    for _ in range(2):  # a scripted scenario gives the same text every time
        one_user.click()
        page.locator(".st-key-summary").wait_for(state="detached")
        wait_for_summary(page)
        shown.append(answers(page))
    assert shown[0] == shown[1] and all(t.strip() for t in shown[0]), shown
    screenshot(page, shots, "arena")
    # the shared system prompt scenario opens the KV cache page and plays there
    page.get_by_role("button", name=re.compile("sharing a 300-token system prompt")).click()
    page.wait_for_url(re.compile(r"/kv_cache"))
    page.get_by_text(re.compile(r"hit rate", re.I)).first.wait_for()
    page.locator(".st-key-kv-result").wait_for(timeout=RACE_TIMEOUT_MS)
    assert "presenter=1" in page.url
    screenshot(page, shots, "kv_cache")
    # the load sweep, 4 tokens per request and up to 8 users to keep the test short (the
    # local side runs its requests one by one: 1..64 users is 127 of them, 1..8 is 15)
    page.goto(f"{server}/sweep?presenter=1")
    page.get_by_text("Sweep settings", exact=True).click()  # folded away in presenter mode
    for users in ("64", "32", "16"):
        remove_chip(page, f"Remove {users}")
    field = page.get_by_label("Max tokens per request", exact=True)
    field.fill("4")
    field.press("Enter")
    page.wait_for_function("() => [...document.querySelectorAll('input')]"
                           ".some(i => i.value === '4')")
    # the Enter above reruns the page: a click landing in that rerun is lost, so Run is
    # clicked until the sweep runs (its Stop enabled) or, being this short, has ended
    summary = page.locator(".st-key-sweep-summary")
    running = page.locator(".st-key-sweep_stop button:enabled")
    assert click_until(page.get_by_role("button", name="Run sweep", exact=True),
                       lambda: running.count() > 0 or summary.count() > 0, 6, 5), \
        "the sweep never started"
    summary.wait_for(timeout=RACE_TIMEOUT_MS)
    assert "the datacenter's total rose" in summary.inner_text()
    screenshot(page, shots, "sweep")
    page.goto(f"{server}/hardware?presenter=1")
    page.locator("[data-testid='stVegaLiteChart']").first.wait_for()
    assert page.get_by_role("button", name="One user", exact=True).count() == 0
    screenshot(page, shots, "hardware")
    page.context.close()


def test_answers_per_user_shows_your_candidates_in_tabs_on_both_sides(server, browser):
    page = open_arena(browser, server)
    set_up_race(page, "Name three colours.", users=2, max_tokens=8)
    field = page.get_by_label("Answers per user", exact=True)
    field.fill("3")
    field.press("Enter")
    page.wait_for_function("() => [...document.querySelectorAll('input')]"
                           ".some(i => i.getAttribute('aria-label') === 'Answers per user'"
                           " && i.value === '3')")
    click_run(page)
    wait_for_summary(page)
    for side in ("local", "datacenter"):
        panel = page.locator(f".st-key-side-{side}")
        tabs = panel.get_by_role("tab")
        assert tabs.all_inner_texts() == ["Answer 1", "Answer 2", "Answer 3"]
        tabs.nth(2).click()  # the third answer's text is shown in its own tab
        shown = panel.locator("[data-testid='stCode']").filter(visible=True)
        wait_for(lambda shown=shown: shown.count() == 1, timeout=30)
        assert shown.inner_text().strip()
    assert "held 3 times" in page.locator(".st-key-side-local").inner_text()
    assert "computed once" in page.locator(".st-key-side-datacenter").inner_text()
    page.context.close()


def test_four_answers_scenario_shows_shared_blocks_and_the_saving(server, browser):
    page = browser.new_context(viewport={"width": 1600, "height": 1400}).new_page()
    page.set_default_timeout(120_000)
    page.goto(f"{server}/kv_cache")
    run = page.locator(".st-key-kv_run_parallel_answers button")
    run.click()
    shared = page.locator(".st-key-kv-shared")
    shared.wait_for(timeout=RACE_TIMEOUT_MS)
    assert re.search(r"KV shared: [\d.]+ MiB saved \(\d+%\)", shared.inner_text())
    result = page.locator(".st-key-kv-result")
    result.wait_for(timeout=RACE_TIMEOUT_MS)
    assert "at its peak, KV shared:" in result.inner_text()
    page.context.close()


# each page's last metric label: once it shows, the page has drawn every figure
LAST_FIGURE = {"": "Ahead of you", "sweep": "Datacenter ÷ local PC", "kv_cache": "Preemptions",
               "hardware": "Response", "datacenter": "TTFT"}


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (1024, 768)])
def test_every_page_s_figures_fit_a_laptop_screen_beside_the_sidebar(server, browser, width,
                                                                     height):
    """Normal mode at 1280x800, the narrowest common laptop screen (and a projector's),
    and 1024x768, a tablet's or an old projector's, with the sidebar open: no metric value
    or label on any page is cut short (six figures in one row cut "0 / 2,912" and
    "Prefix-cache hit rate" short at 1440 px, three in half the Hardware page "347 ms" at
    1366, "1,393,528" tokens the Datacenter's at 1280; at 1024 every page but two cut
    some, until rows of figures wrapped)."""
    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.set_default_timeout(120_000)
    for path, last in LAST_FIGURE.items():
        page.goto(f"{server}/{path}")
        page.locator("[data-testid='stMetricLabel']", has_text=last).first.wait_for()
        problems = cut_figures(page)
        assert not problems, (path or "arena", problems)
    page.context.close()
