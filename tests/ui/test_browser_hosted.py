"""A shared instance in a real browser (Chromium, as in test_browser.py): a server started
in hosted mode with an admin password, visited by a visitor and by the admin.

- a visitor (no password) cannot apply engine settings; the admin's oversized pool gets a
  one-line refusal naming the limit, and no traceback;
- the admin's rebuild during a visitor's race leaves the visitor a finished race (the old
  engine drains) or a plain sentence;
- Stop of a 64-user race frees every block, read from the status strip, with fewer than
  64 users finished.
"""

from __future__ import annotations

import re
import time

import pytest
from polling import wait_for
from test_browser import (
    FREED_TIMEOUT_S,
    RACE_TIMEOUT_MS,
    all_blocks_free,
    click_run,
    open_arena,
    set_up_race,
    streamlit_server,
    strip_counts,
)

pytestmark = [pytest.mark.browser, pytest.mark.model]
PASSWORD = "s3cret-for-tests"
POOL = re.compile(r"KV blocks used: (\d+)/(\d+)")


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """The dashboard as a shared instance: `hosted = true` and an admin password in its
    secrets (still bound to localhost: tests never listen beyond this machine)."""
    folder = tmp_path_factory.mktemp("hosted")
    secrets = folder / "secrets.toml"
    secrets.write_text(f'hosted = true\nadmin_password = "{PASSWORD}"\n')
    with streamlit_server(folder, ("--secrets.files", str(secrets))) as url:
        yield url


def sidebar_number(page, label: str, value: int) -> None:
    field = page.locator("[data-testid='stSidebar']").get_by_label(label, exact=True)
    field.fill(str(value))
    field.press("Tab")


def apply(page, password: str | None) -> None:
    sidebar = page.locator("[data-testid='stSidebar']")
    if password is not None:
        box = sidebar.get_by_label("Admin password", exact=True)
        box.fill(password)
        box.press("Tab")
    sidebar.get_by_role("button", name="Apply", exact=True).click()


def sidebar_message(page, kind: str) -> str:
    """The text of the sidebar's first alert of `kind` ("error", "success"), once shown."""
    alert = page.locator("[data-testid='stSidebar'] [data-testid='stAlertContentError']"
                         if kind == "error" else
                         "[data-testid='stSidebar'] [data-testid='stAlertContentSuccess']")
    alert.first.wait_for(timeout=120_000)
    return alert.first.inner_text()


def pool_blocks(page) -> int:
    return int(POOL.search(page.locator(".st-key-status-strip").inner_text()).group(2))


def no_traceback(page) -> None:
    assert page.locator("[data-testid='stException']").count() == 0
    assert "Traceback" not in page.content()


def test_only_the_admin_can_apply_and_an_oversized_pool_is_refused_in_one_line(hosted,
                                                                                browser):
    page = open_arena(browser, hosted)
    page.locator(".st-key-status-strip").wait_for()
    blocks = pool_blocks(page)
    sidebar_number(page, "KV pool (blocks)", 10_000_000)
    apply(page, None)  # a visitor: no password
    assert "Only an admin can change the shared engine" in sidebar_message(page, "error")
    assert pool_blocks(page) == blocks
    sidebar_number(page, "KV pool (blocks)", 10_000_000)
    apply(page, PASSWORD)
    page.get_by_text("the largest pool that fits is").wait_for(timeout=120_000)
    error = sidebar_message(page, "error")
    assert error.startswith("Not applied: num_kv_blocks: a pool of 10,000,000 blocks")
    assert "of RAM free for it" in error and "\n" not in error.strip()
    no_traceback(page)
    assert pool_blocks(page) == blocks  # nothing was built
    page.context.close()


def test_a_rebuild_during_a_visitors_race_leaves_it_finished_or_told(hosted, browser):
    visitor, admin = open_arena(browser, hosted), open_arena(browser, hosted)
    # a story of up to 256 tokens: the datacenter side runs for seconds, long enough for the
    # 1 s status strip to show it (64 tokens take under a second with the bf16 matmul kernel)
    set_up_race(visitor, "Write a long story about a lighthouse keeper.", users=4,
                max_tokens=256)
    click_run(visitor)
    wait_for(lambda: (strip_counts(visitor) or (0, 0, 0))[2] > 0, 60,
             "the race never started", interval=0.1)
    apply(admin, PASSWORD)  # the same settings: a rebuild all the same
    assert "Engine rebuilt" in sidebar_message(admin, "success")
    ended = visitor.locator(".st-key-summary").or_(
        visitor.get_by_text("The admin changed the engine settings; this race was stopped."))
    ended.first.wait_for(timeout=RACE_TIMEOUT_MS)
    text = visitor.locator("[data-testid='stMain']").inner_text()
    assert "RuntimeError" not in text and "was the shared engine rebuilt" not in text
    no_traceback(visitor)
    for page in (visitor, admin):
        page.context.close()


def test_stop_of_a_64_user_race_frees_every_block(hosted, browser):
    page = open_arena(browser, hosted)
    # every user sends the long story: a short varied answer ("What is the capital of
    # France?") can finish before the last of 64 is admitted, and all 64 never run at once
    page.get_by_text("the same prompt", exact=True).click()
    wait_for(lambda: page.get_by_role("radio", name="the same prompt").is_checked(), 30,
             "'the same prompt' was never selected")
    set_up_race(page, "Write a long story about a lighthouse keeper.", users=64,
                max_tokens=1024)
    click_run(page)
    wait_for(lambda: (strip_counts(page) or (0, 0, 0))[2] == 64, 120,
             "the 64 requests never reached the engine", interval=0.1)
    wait_for(lambda: (strip_counts(page) or (0, 0, 0))[0] == 64, 120,
             "the 64 requests were never all running", interval=0.1)
    page.get_by_role("button", name="Stop", exact=True).click()
    clicked = time.monotonic()
    wait_for(lambda: all_blocks_free(page), FREED_TIMEOUT_S,
             f"blocks still held {FREED_TIMEOUT_S:g} s after Stop", interval=0.05)
    print(f"stop: every block free on the strip after {time.monotonic() - clicked:.2f} s")
    panel = page.locator(".st-key-side-datacenter")
    panel.get_by_text(re.compile(r"^Stopped: \d+ of 64 users finished\.$")).wait_for()
    assert "Done." not in panel.inner_text()
    no_traceback(page)
    page.context.close()
