"""A real engine served over HTTP for the API and remote-side tests."""

from __future__ import annotations

import openai
import pytest
from http_server import serving

from engine import Engine, EngineConfig
from server.metrics import ServerMetrics
from server.routes import api_routes


@pytest.fixture(scope="module")
def api_engine(loaded):
    """A small engine: 256 blocks of 16 tokens, so the limit is the 4096-token pool."""
    with Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256),
                loaded=loaded) as eng:
        yield eng


@pytest.fixture(scope="module")
def name(api_engine) -> str:
    return api_engine.loaded.name


@pytest.fixture(scope="module")
def url(api_engine, name):
    """`api_engine` behind the API and /metrics on 127.0.0.1: the server's root URL."""
    metrics = ServerMetrics(lambda: api_engine)
    metrics.watch(api_engine)
    with serving(api_routes(lambda: api_engine, model_name=name, metrics=metrics)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    """The official OpenAI client on `url`'s API: no retries, a model test's patience."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                       timeout=120.0) as c:
        yield c
