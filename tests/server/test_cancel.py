"""An HTTP client that goes away mid-prefill frees its request's KV blocks before the
engine's next step: the route cancels on the connection's disconnect, and the engine
applies cancels between steps, so between two chunks of a long prompt's prefill. The
promise is checked in engine steps (`Engine.cancel_lags`), not in seconds, so a slow
machine cannot fail it. Real engine, real uvicorn on 127.0.0.1, a real socket closed by
the client."""

from __future__ import annotations

import httpx
import pytest
from http_server import serving
from polling import wait_for

from engine import Engine, EngineConfig, SamplingParams
from server.routes import api_routes

FREED_TIMEOUT_S = 120.0  # how long the test waits at most (a bound on a hang, not a promise)
CHUNK = 128  # tokens per step: many steps to the whole prompt


@pytest.fixture(scope="module")
def long_prefill(loaded):
    """An engine with room for a 3,000-token prompt, prefilled 128 tokens a step."""
    config = EngineConfig(num_kv_blocks=256, max_num_batched_tokens=CHUNK)
    with Engine(config, loaded=loaded) as eng, \
            serving(api_routes(lambda: eng, model_name=loaded.name)) as url:
        eng.generate(["warm up " * 100], SamplingParams(max_tokens=1))  # first-call costs
        yield eng, url


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_disconnect_mid_prefill_frees_the_blocks_before_the_next_step(long_prefill, path):
    eng, url = long_prefill
    words = " ".join(f"w{i}" for i in range(700))  # ~2,700 tokens
    body = {"model": eng.loaded.name, "max_tokens": 50, "stream": True, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    tokens_before = eng.stats(steps_after=None).num_output_tokens
    lags_before = len(eng.cancel_lags())
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        # mid-prefill: the request holds blocks, several chunks are in, no token yet
        wait_for(lambda: eng.stats(steps_after=None).kv.used_blocks >= 3 * CHUNK // 16, 30,
                 "the prefill did not start")
        stats = eng.stats(steps_after=None)
        assert stats.num_running == 1 and stats.num_output_tokens == tokens_before
        assert stats.kv.used_blocks < 2600 // 16  # the prompt is not all in yet
    # leaving the block closed the connection
    wait_for(lambda: eng.stats(steps_after=None).kv.used_blocks == 0, FREED_TIMEOUT_S,
             "the blocks were never freed after the disconnect")
    lags = eng.cancel_lags()[lags_before:]
    assert len(lags) == 1 and lags[0] <= 1, lags  # at most the step already running
    stats = eng.stats(steps_after=None)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_output_tokens == tokens_before  # cancelled before its first token
