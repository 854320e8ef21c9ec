"""The dashboard server's second door: the OpenAI-compatible API and /metrics (server/) on
the shared engine the pages use, so an API client's requests are batched with browser
users' and show on the status strip, the KV block map and the step timeline.

The API key comes from the environment (BATCHLENS_API_KEY) or Streamlit secrets
(`api_key = "..."` in .streamlit/secrets.toml); with one set, every /v1 route needs
`Authorization: Bearer <key>`, and /health stays open.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import streamlit as st
from starlette.routing import BaseRoute

from engine import Engine
from engine.models import loader
from server.metrics import ServerMetrics
from server.routes import api_routes
from ui import shared

# The API's threads reach the shared engine through st.cache_resource outside any script
# run; Streamlit warns about that on every call ("missing ScriptRunContext"), which is all
# that logger says. Those threads are not script runs by design.
logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").setLevel(
    logging.ERROR)


def current_engine() -> Engine:
    """The shared engine as it is now (settings may have rebuilt it)."""
    return shared.shared_engine().engine


def api_key() -> str | None:
    """BATCHLENS_API_KEY, else `api_key` from Streamlit secrets, else None (no auth)."""
    key = os.environ.get("BATCHLENS_API_KEY")
    if key:
        return key
    try:
        return st.secrets.get("api_key") or None
    except Exception:  # no secrets file: no key
        return None


def routes() -> list[BaseRoute]:
    """The API's routes, with a metrics exporter that watches every shared engine."""
    metrics = ServerMetrics(current_engine)
    shared.ENGINE_WATCHERS.append(metrics.watch)
    name = loader.resolve_model(os.environ.get("BATCHLENS_MODEL")).name
    return api_routes(current_engine, model_name=name, api_key=api_key(), metrics=metrics)


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Load the model and start the shared engine in the background at server start, so
    the first API request or page view finds it ready; the server answers meanwhile."""
    task = asyncio.get_running_loop().run_in_executor(None, shared.shared_engine)
    yield
    task.cancel()
