"""The dashboard server's second door: the OpenAI-compatible API and /metrics (server/) on
the shared engine the pages use, so an API client's requests are batched with browser
users' and show on the status strip, the KV block map and the step timeline.

Settings, each from the environment or else Streamlit secrets (.streamlit/secrets.toml):

    BATCHLENS_API_KEY   api_key = "..." (or a list)   every /v1 route needs
                                                      `Authorization: Bearer <key>`
                                                      (env: keys separated by commas)
    BATCHLENS_MAX_WAITING       max_waiting = 256     429 "busy: N waiting" past it
    BATCHLENS_API_RPM   api_requests_per_minute = N   per key (per client address
    BATCHLENS_API_TPM   api_tokens_per_minute = N     where no key is set); none: no limit
    BATCHLENS_ALLOWED_ORIGINS   allowed_origins = ["*"]   origins a browser page may call
                                                      the API from (env: commas; "" none)
    BATCHLENS_METRICS_PREFIX    metrics_prefix = "batchlens"   what /metrics' names start
                                                      with ("vllm" for vLLM's dashboards)
    BATCHLENS_TOOL_CALL_PARSER  tool_call_parser = "hermes"   serves tool_choice "auto"
                                                      with that parser (none: a 400)
    BATCHLENS_CHAT_TEMPLATE     chat_template = "FILE"   a Jinja chat template in place
                                                      of the model's, for the API

/health and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import streamlit as st
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from engine import Engine
from engine.models import loader
from server.metrics import PREFIX, ServerMetrics, metrics_prefix
from server.protocol import read_chat_template
from server.routes import api_routes, cors_middleware
from server.tool_parsers import PARSERS
from ui import shared

# The API's threads reach the shared engine through st.cache_resource outside any script
# run; Streamlit warns about that on every call ("missing ScriptRunContext"), which is all
# that logger says. Those threads are not script runs by design.
logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context").setLevel(
    logging.ERROR)


def current_engine() -> Engine:
    """The shared engine as it is now (settings may have rebuilt it)."""
    return shared.shared_engine().engine


def _setting(env: str, secret: str) -> Any:
    """The environment variable `env`, else the secret `secret`, else None."""
    value = os.environ.get(env)
    if value:
        return value
    try:
        return st.secrets.get(secret) or None
    except Exception:  # no secrets file
        return None


def _count(env: str, secret: str, default: int | None) -> int | None:
    """A whole-number setting; `ValueError` naming it when it is not one."""
    value = _setting(env, secret)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{secret} (${env}) must be a whole number, got {value!r}") from None


def api_key() -> str | list[str] | None:
    """BATCHLENS_API_KEY (keys separated by commas), else `api_key` from Streamlit secrets
    (a string or a list), else None (no auth)."""
    key = _setting("BATCHLENS_API_KEY", "api_key")
    if isinstance(key, str) and "," in key:
        return [k.strip() for k in key.split(",") if k.strip()]
    return list(key) if isinstance(key, list | tuple) else key


def allowed_origins() -> list[str]:
    """BATCHLENS_ALLOWED_ORIGINS (origins separated by commas; set but empty: none), else
    `allowed_origins` from Streamlit secrets, else every origin (vLLM's default)."""
    env = os.environ.get("BATCHLENS_ALLOWED_ORIGINS")
    if env is not None:
        return [o.strip() for o in env.split(",") if o.strip()]
    value = _setting("BATCHLENS_ALLOWED_ORIGINS", "allowed_origins")
    if value is None:
        return ["*"]
    return [value] if isinstance(value, str) else [str(o) for o in value]


def prefix() -> str:
    """BATCHLENS_METRICS_PREFIX, else `metrics_prefix` from Streamlit secrets, else
    batchlens: what /metrics' names start with ("vllm" for vLLM's own dashboards);
    `ValueError` naming the setting when Prometheus would refuse it."""
    value = _setting("BATCHLENS_METRICS_PREFIX", "metrics_prefix")
    try:
        return metrics_prefix(PREFIX if value is None else str(value))
    except ValueError as exc:
        raise ValueError(f"metrics_prefix ($BATCHLENS_METRICS_PREFIX): "
                         f"{str(exc).removeprefix('metrics prefix: ')}") from None


def tool_parser() -> str | None:
    """BATCHLENS_TOOL_CALL_PARSER, else `tool_call_parser` from Streamlit secrets, else
    None (tool_choice "auto" is a 400); `ValueError` naming the parsers otherwise."""
    value = _setting("BATCHLENS_TOOL_CALL_PARSER", "tool_call_parser")
    if value is not None and value not in PARSERS:
        raise ValueError(f"tool_call_parser ($BATCHLENS_TOOL_CALL_PARSER) must be one of "
                         f"{', '.join(PARSERS)}, got {value!r}")
    return value


def chat_template() -> str | None:
    """BATCHLENS_CHAT_TEMPLATE, else `chat_template` from Streamlit secrets: a Jinja file
    (or the template itself) in place of the model's template for the API; `ValueError`
    naming the setting where it cannot be read."""
    value = _setting("BATCHLENS_CHAT_TEMPLATE", "chat_template")
    if value is None:
        return None
    try:
        return read_chat_template(str(value))
    except ValueError as exc:
        raise ValueError(f"chat_template ($BATCHLENS_CHAT_TEMPLATE): "
                         f"{str(exc).removeprefix('chat template: ')}") from None


def middleware() -> list[Middleware]:
    """CORS on the API's paths (not the pages'), from `allowed_origins()`."""
    return cors_middleware(allowed_origins())


def routes() -> list[BaseRoute]:
    """The API's routes, with a metrics exporter that watches every shared engine."""
    metrics = ServerMetrics(current_engine, prefix=prefix())
    shared.ENGINE_WATCHERS.append(metrics.watch)
    name = loader.resolve_model(os.environ.get("BATCHLENS_MODEL")).name
    return api_routes(current_engine, model_name=name, api_key=api_key(),
                      max_waiting=_count("BATCHLENS_MAX_WAITING", "max_waiting", 256),
                      requests_per_minute=_count("BATCHLENS_API_RPM",
                                                 "api_requests_per_minute", None),
                      tokens_per_minute=_count("BATCHLENS_API_TPM", "api_tokens_per_minute",
                                               None),
                      metrics=metrics, tool_parser=tool_parser(),
                      chat_template=chat_template())


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Load the model and start the shared engine in the background at server start, so
    the first API request or page view finds it ready; the server answers meanwhile."""
    task = asyncio.get_running_loop().run_in_executor(None, shared.shared_engine)
    yield
    task.cancel()
