"""A page's own URL opened first on a freshly started server (a presenter's bookmark)
gets the dashboard's shell and presenter mode, not the bare page."""

from __future__ import annotations

import pytest
from test_browser import streamlit_server

pytestmark = [pytest.mark.browser, pytest.mark.model]


def test_a_page_url_opened_first_on_a_fresh_server_has_the_shell(browser, tmp_path):
    with streamlit_server(tmp_path) as url:  # its own server: no session has opened it yet
        page = browser.new_context(viewport={"width": 1280, "height": 720}).new_page()
        page.set_default_timeout(120_000)
        page.goto(f"{url}/kv_cache?presenter=1")
        # the presenter header comes from dashboard.py, the page's title from pages/kv_cache.py
        page.get_by_text("Local PC:", exact=False).first.wait_for()
        page.get_by_text("KV cache: blocks, sharing, preemption").wait_for()
        assert page.get_by_role("link", name="Arena").count() >= 1  # the navigation
        page.close()
