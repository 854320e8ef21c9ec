"""Per-API-key rate limits: the sliding window with a hand-driven clock (no model), then the
API's 429s with `Retry-After`, seen by the official `openai` client against a real engine
behind uvicorn on 127.0.0.1."""

from __future__ import annotations

import httpx
import openai
import pytest
from http_server import serving

from engine import Engine, EngineConfig
from server.errors import APIError
from server.rate_limit import RateLimiter
from server.routes import api_routes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide_and_say_when_to_retry():
    clock = FakeClock()
    limits = RateLimiter(requests_per_minute=2, clock=clock)
    limits.admit("a", 10)
    clock.now += 20
    limits.admit("a", 10)
    limits.admit("b", 10)  # another key has its own window
    clock.now += 10
    with pytest.raises(APIError) as err:
        limits.admit("a", 10)
    assert err.value.status == 429 and err.value.type == "rate_limit_error"
    assert err.value.message == ("rate limit: this API key sent 2 requests in the last "
                                 "minute (limit 2 per minute)")
    assert err.value.retry_after == pytest.approx(30.0)  # the first ages out at t+60
    assert err.value.headers == {"Retry-After": "30"}
    clock.now += 30
    limits.admit("a", 10)


def test_tokens_per_minute_count_the_estimate_until_settled():
    clock = FakeClock()
    limits = RateLimiter(tokens_per_minute=100, clock=clock)
    first = limits.admit("k", 60)  # prompt + max_tokens, the most it may use
    clock.now += 5
    with pytest.raises(APIError) as err:
        limits.admit("k", 50, who="this client")
    assert err.value.message == ("rate limit: this client used 60 of its 100 tokens per "
                                 "minute; this request may use 50 more")
    assert err.value.retry_after == pytest.approx(55.0)
    first.settle(30)  # it used 30: the rest comes back
    first.settle(500)  # a settlement never charges more than the estimate
    assert first.tokens == 30
    limits.admit("k", 50)
    with pytest.raises(APIError) as err:
        limits.admit("k", 101)
    assert "more than the 100 tokens per minute" in err.value.message
    assert err.value.retry_after is None and err.value.headers == {}  # waiting cannot help


def test_the_retry_after_of_tokens_is_when_enough_ages_out():
    clock = FakeClock()
    limits = RateLimiter(tokens_per_minute=100, clock=clock)
    for _ in range(4):
        limits.admit("k", 25)
        clock.now += 10
    with pytest.raises(APIError) as err:  # 100 used: two of the 25s must age out for 40
        limits.admit("k", 40)
    assert err.value.retry_after == pytest.approx(1000 + 10 + 60 - clock.now)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "60"])
def test_limits_must_be_whole_numbers(bad):
    with pytest.raises(ValueError, match="requests_per_minute must be an integer >= 1"):
        RateLimiter(requests_per_minute=bad)


# ---- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(loaded):
    with Engine(EngineConfig(num_kv_blocks=64), loaded=loaded) as eng:
        yield eng


def api_routes_for(engine: Engine, **kwargs):
    return api_routes(lambda: engine, model_name=engine.loaded.name, **kwargs)


def client_for(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_each_api_key_has_its_own_requests_per_minute(engine):
    name = engine.loaded.name
    routes = api_routes_for(engine, api_key=["key-a", "key-b"], requests_per_minute=2)
    with serving(routes) as url, client_for(url, "key-a") as a, client_for(url, "key-b") as b:
        for _ in range(2):
            a.completions.create(model=name, prompt="Hi", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as err:
            a.chat.completions.create(model=name, max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])
        assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
        assert "this API key sent 2 requests in the last minute" in err.value.body["message"]
        assert 55 <= int(err.value.response.headers["retry-after"]) <= 60
        assert b.completions.create(model=name, prompt="Hi", max_tokens=2).usage
        with pytest.raises(openai.AuthenticationError):  # a bad key is 401, not counted
            client_for(url, "key-c").completions.create(model=name, prompt="Hi", max_tokens=2)


def test_tokens_per_minute_refuse_with_retry_after(engine):
    name = engine.loaded.name
    with serving(api_routes_for(engine, tokens_per_minute=120)) as url:
        body = {"model": name, "prompt": "Hello there", "max_tokens": 50, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            r.read()  # ~53 tokens: the first request's estimate, then what it used
        with client_for(url, "none") as c, pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=name, prompt="Hello there", max_tokens=80)
        assert "tokens per minute" in err.value.body["message"]
        assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
        with client_for(url, "none") as c, pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=name, prompt="Hello", max_tokens=200)
        assert "more than the 120 tokens per minute" in err.value.body["message"]
        assert "retry-after" not in err.value.response.headers
        ok = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": "Hello there", "max_tokens": 20})
        assert ok.status_code == 200  # 53 + ~23 fit the 120 of the minute
