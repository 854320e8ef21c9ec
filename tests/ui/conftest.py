"""Fixtures for the page tests: a fresh shared engine (AppTest), a headless Chromium and
one dashboard server for the browser tests."""

from __future__ import annotations

import os

import pytest

from ui import shared


@pytest.fixture
def fresh_engine():
    """Every test starts with a newly built shared engine and ends by shutting it down.
    The loaded weights (`loaded_model`) stay cached: they are read-only."""
    shared.shared_engine.clear()
    yield
    shared.shared_engine.clear()  # on_release shuts the engine down, cancelling requests


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright's Python package (never `playwright
    install`); skipped where it is missing."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing (apt-get install --no-install-recommends chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The dashboard as `make run` starts it (a local instance), one for every browser module
    that wants that, since each start loads the model again in the server; modules that need
    other options or a server no session has opened start their own. Yields its URL."""
    from test_browser import streamlit_server

    with streamlit_server(tmp_path_factory.mktemp("streamlit")) as url:
        yield url
