"""The dashboard's API settings read from the environment (ui/api.py)."""

from __future__ import annotations

import pytest

from ui import api


@pytest.mark.parametrize(("env", "origins"), [
    (None, ["*"]),  # unset: every origin, as vLLM's server
    ("https://chat.example, https://b.example", ["https://chat.example", "https://b.example"]),
    ("", []),  # set but empty: no CORS at all
])
def test_allowed_origins_from_the_environment(monkeypatch, env, origins):
    if env is None:
        monkeypatch.delenv("BATCHLENS_ALLOWED_ORIGINS", raising=False)
    else:
        monkeypatch.setenv("BATCHLENS_ALLOWED_ORIGINS", env)
    assert api.allowed_origins() == origins
    assert len(api.middleware()) == (1 if origins else 0)
