"""Faults, injected into a real engine served over real HTTP (uvicorn on 127.0.0.1, the
official `openai` client): a model step that raises fails only that step's requests, and
the next ones succeed; an engine loop that dies turns /health into 503, its requests into
clear errors and the status strip into "engine stopped", and `restart()` brings it back.

The injections patch one object of the engine under test for the test's length (the
runner's `execute` for one call, the core's `schedule`); nothing else is faked.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from http_server import serving
from polling import wait_for

from engine import Engine, EngineConfig
from engine.kv_cache import KVCacheStats
from engine.serving import ServingStats
from server.routes import api_routes
from ui.status import status_line

TIMEOUT_S = 60.0


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                         timeout=TIMEOUT_S)


def quiet(eng: Engine) -> bool:
    s = eng.stats(steps_after=None)
    return s.num_running == 0 and s.num_waiting == 0 and s.kv.used_blocks == 0


@pytest.fixture
def served(loaded):
    """A fresh engine that serves one request at a time (so a second one waits outside
    the first one's steps), behind the API: (engine, base URL)."""
    with Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=1), loaded=loaded) as eng, \
            serving(api_routes(lambda: eng, model_name=loaded.name)) as url:
        yield eng, url


def test_a_failing_step_fails_only_its_requests(served, monkeypatch):
    eng, url = served
    name = eng.loaded.name
    runner = eng.core.runner
    real_execute = runner.execute
    armed = threading.Event()

    def execute_failing_once(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected step failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute_failing_once)
    waiting_result: dict[str, object] = {}
    with client_for(url) as c:
        stream = c.completions.create(model=name, prompt="Count to one hundred:",
                                      max_tokens=200, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(c for c in chunks if c.choices and c.choices[0].text)
        running_id = first.id

        def waiting_request() -> None:  # queued behind the stream: not in the failing step
            try:
                waiting_result["ok"] = c.completions.create(
                    model=name, prompt="The capital of France is", max_tokens=6,
                    temperature=0, extra_body={"ignore_eos": True})
            except Exception as exc:
                waiting_result["error"] = exc

        second = threading.Thread(target=waiting_request)
        second.start()
        wait_for(lambda: eng.stats(steps_after=None).num_waiting == 1, 10,
                 "the second request did not queue")
        assert eng.stats(steps_after=None).running_ids == (running_id,)
        armed.set()
        with pytest.raises(openai.APIError, match="injected step failure"):
            for _ in chunks:
                pass
        second.join(TIMEOUT_S)
        assert "error" not in waiting_result, waiting_result.get("error")
        done = waiting_result["ok"]
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
        after = c.completions.create(model=name, prompt="Hello", max_tokens=4,
                                     extra_body={"ignore_eos": True})
        assert after.usage.completion_tokens == 4
    assert not armed.is_set()
    wait_for(lambda: quiet(eng), 5, "blocks were left held after the failed step")
    assert eng.stopped_reason is None
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_dead_loop_is_503_and_engine_stopped_until_restarted(served, monkeypatch):
    eng, url = served
    name = eng.loaded.name
    core = eng.core
    real_schedule = core.schedule
    armed = threading.Event()

    def schedule_or_die():
        if armed.is_set():
            raise RuntimeError("injected loop failure")
        return real_schedule()

    monkeypatch.setattr(core, "schedule", schedule_or_die)
    with client_for(url) as c:
        stream = c.completions.create(model=name, prompt="Count to one hundred:",
                                      max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(c for c in chunks if c.choices and c.choices[0].text)
        armed.set()
        # the request in flight ends with an error naming the failure, not a hang
        with pytest.raises(openai.APIError, match="the engine loop failed"):
            for _ in chunks:
                pass
        wait_for(lambda: not eng._thread.is_alive(), 10, "the loop did not stop")

        stopped = eng.stopped_reason
        assert stopped == "stopped: the engine loop failed (RuntimeError: injected loop failure)"
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == f"engine {stopped}"
        stats = eng.stats(steps_after=None)
        assert stats.stopped == stopped
        assert stats.kv.used_blocks == 0 and stats.num_running == stats.num_waiting == 0
        assert "engine stopped" in status_line(stats, ())
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=name, prompt="Hello", max_tokens=4)
        assert err.value.status_code == 503 and "the engine loop failed" in str(err.value)

        assert eng.restart() is True
        assert eng.restart() is False  # running again: nothing to do
        assert eng.stopped_reason is None
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        out = c.completions.create(model=name, prompt="Hello", max_tokens=4,
                                   extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        assert eng.stats(steps_after=None).num_finished >= 2  # counters kept over the restart
    wait_for(lambda: quiet(eng), 5, "blocks were left held after the restart")


def test_the_status_strip_says_engine_stopped():
    kv = KVCacheStats(num_blocks=8, block_size=16, used_blocks=0, cached_blocks=0,
                      free_blocks=8, used_slots=0, reserved_slots=0, prefix_queries=0,
                      prefix_hits=0)
    fields = dict(model="m", device="cpu", dtype="float32", dtype_reason="", num_running=0,
                  num_waiting=0, running_ids=(), waiting_ids=(), num_finished=0,
                  num_output_tokens=0, kv_bytes_per_token=1, kv_reserved_bytes=0,
                  kv_used_bytes=0, kv=kv)
    serving = status_line(ServingStats(**fields), ())
    assert "running: 0" in serving and "engine stopped" not in serving
    stopped = status_line(ServingStats(**fields, stopped="stopped: the engine loop failed "
                                       "(RuntimeError: /srv/secret/path.py)"), ())
    assert stopped.startswith("Shared datacenter engine — engine stopped")
    assert "restarts" in stopped and "/srv/secret" not in stopped  # no internals on a page
