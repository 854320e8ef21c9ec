"""Fixtures for the page tests."""

from __future__ import annotations

import pytest

from ui import shared


@pytest.fixture
def fresh_engine():
    """Every test starts with a newly built shared engine and ends by shutting it down.
    The loaded weights (`loaded_model`) stay cached: they are read-only."""
    shared.shared_engine.clear()
    yield
    shared.shared_engine.clear()  # on_release shuts the engine down, cancelling requests
