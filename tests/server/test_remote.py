"""`RemoteSide`: any OpenAI-compatible server as the datacenter or the local PC.

Model-free tests drive a scripted stand-in server (uvicorn on 127.0.0.1, a thread): each
prompt's first word picks what it answers (a good stream, no usage, garbage, a 404, a
stall, an error event...), so every error of an endpoint is met, each beside a good
request in flight that must finish untouched. `model` tests use real batchlens servers:
one in a thread (the remote datacenter, its engine at hand to check batching and freed
blocks) and one as a separate `batchlens serve` process with one sequence at a time and a
key (the remote local PC); greedy float32 text must equal the in-process engine's.

All traffic goes to 127.0.0.1, a few requests per test, each bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from http_server import serving
from polling import wait_for
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import Engine, SamplingParams
from measure.bench.serve import LoadRequest, run_load
from server.child import child_server, free_port, health_url, serve_command
from server.remote import PLACEHOLDER_TOKEN, STATE_POLL_S, RemoteError, RemoteSide
from server.routes import api_routes
from workloads.prompts import chat
from workloads.race import Race
from workloads.sweep import Sweep, SweepPlan

ROOT = Path(__file__).resolve().parents[2]
RESULT_S = 30.0  # the longest any stand-in request may take
MODEL_RESULT_S = 120.0
STUB = "stub"
KEY = "sekret"
VLLM_METRICS = ('vllm:num_requests_running{model_name="stub"} 3\n'
                'vllm:num_requests_waiting{model_name="stub"} 1\n'
                'vllm:kv_cache_usage_perc{model_name="stub"} 0.5\n')


# ---- a scripted stand-in server ---------------------------------------------------------
class Script:
    """What the stand-in saw: request bodies, streams in flight (and the most at once),
    streams whose client went away; and the /metrics text it serves (None: 404)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.gone: list[str] = []
        self.metrics_text: str | None = None
        self.metrics_gets = 0

    def reset(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.gone.clear()
            self.in_flight = self.max_in_flight = 0


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(chat: bool, text: str | None = None, finish: str | None = None,
           role: bool = False) -> str:
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return _event({"id": "x", "object": "chunk", "choices": [choice]})


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 3}}


def stand_in(script: Script) -> list[Route]:
    """The stand-in's routes. The prompt's first word picks the answer:

    good       "Hel", "lo", " world" 50 ms apart, usage of 5 tokens (more than chunks)
    nousage    "a", "b" and finish_reason "length", no usage (llama.cpp's server)
    slow       five chunks 100 ms apart (for batching and one-at-a-time checks)
    stall      the chat role chunk, then nothing for 30 s
    linger     as good, then the connection held open for 30 s after [DONE]
    cut        one chunk, then the stream ends without a finish reason or [DONE]
    midstream  one chunk, then an `error` event
    garbage    an event that is not JSON
    plain      a JSON body where a stream was asked for
    ghost      404 model_not_found
    """
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": STUB, "object": "model", "max_model_len": 4096},
            {"id": "other", "object": "model"}]})

    async def slow_models(request: Request) -> Response:
        await asyncio.sleep(3)
        return await models(request)

    async def junk_models(request: Request) -> Response:
        return PlainTextResponse("hello")

    async def metrics(request: Request) -> Response:
        with script.lock:
            script.metrics_gets += 1
        if script.metrics_text is None:
            return PlainTextResponse("404 page not found", status_code=404)
        return PlainTextResponse(script.metrics_text)

    async def generate(request: Request) -> Response:
        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        kind = prompt.split()[0] if isinstance(prompt, str) else "good"
        with script.lock:
            script.bodies.append(body)
        if kind == "ghost":
            return JSONResponse({"error": {"message": "The model `stub` does not exist.",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        if kind == "garbage":
            return Response("data: {not json\n\n", media_type="text/event-stream")
        if kind == "plain":
            return JSONResponse({"choices": [{"text": "whole"}]})
        return StreamingResponse(_events(script, request, kind, chat, prompt),
                                 media_type="text/event-stream")

    return [Route("/v1/models", models), Route("/slow/v1/models", slow_models),
            Route("/junk/v1/models", junk_models), Route("/metrics", metrics),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"])]


async def _events(script: Script, request: Request, kind: str, chat: bool, prompt: str):
    with script.lock:
        script.in_flight += 1
        script.max_in_flight = max(script.max_in_flight, script.in_flight)
    finished = False
    try:
        if chat:
            yield _chunk(chat, "", role=True)
        if kind == "stall":  # nothing sent, so watch for the client going away
            for _ in range(300):
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.1)
        texts = {"good": ["Hel", "lo", " world"], "nousage": ["a", "b"],
                 "slow": ["s"] * 5}.get(kind, ["x"])
        gap = 0.1 if kind == "slow" else 0.05
        for text in texts:
            await asyncio.sleep(gap)
            yield _chunk(chat, text)
        if kind == "cut":
            finished = True
            return
        if kind == "midstream":
            yield "event: error\ndata: " + json.dumps(
                {"error": {"message": "injected failure", "type": "server_error"}}) + "\n\n"
        else:
            yield _chunk(chat, None, "length" if kind == "nousage" else "stop")
            if kind != "nousage":
                yield _event({"id": "x", "choices": [], "usage": USAGE})
        yield "data: [DONE]\n\n"
        finished = True
        if kind == "linger":
            for _ in range(300):
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.1)
    finally:
        with script.lock:
            script.in_flight -= 1
            if not finished:
                script.gone.append(prompt)


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def stub_url(script) -> Iterator[str]:
    with serving(stand_in(script)) as url:
        yield url


@pytest.fixture
def side_of(stub_url, script):
    """Build sides on the stand-in (keyword args of `RemoteSide`); all shut down after."""
    script.reset()
    sides: list[RemoteSide] = []

    def make(path: str = "/v1", **kwargs) -> RemoteSide:
        sides.append(RemoteSide(stub_url + path, **kwargs))
        return sides[-1]

    yield make
    for side in sides:
        side.shutdown()


def quiet(engine: Engine) -> bool:
    s = engine.stats(steps_after=None)
    return s.num_running == 0 and s.num_waiting == 0 and s.kv.used_blocks == 0


def results(handles, timeout: float = RESULT_S):
    return [h.result(timeout=timeout) for h in handles]


# ---- construction and its errors -----------------------------------------------------------
def test_the_model_defaults_to_the_first_listed_and_stats_are_our_own(side_of, stub_url):
    side = side_of(role="local")
    assert (side.model, side.max_model_len, side.url) == (STUB, 4096, stub_url + "/v1")
    s = side.stats()
    assert (s.model, s.device, s.max_num_running, s.n_ctx) == (STUB, stub_url + "/v1", 1, 4096)
    assert (s.num_running, s.num_waiting, s.num_finished, s.kv_used_bytes, s.kv) == (
        0, 0, 0, 0, None)
    assert side_of(model="other").stats().max_num_running == 0
    assert side_of(model="other").model == "other"


@pytest.mark.parametrize(("path", "kwargs", "expected"), [
    ("/v1", {"model": "nope"}, "404 model 'nope' not found (the server serves 'stub', 'other')"),
    ("/nowhere/v1", {}, "404 not found: GET /nowhere/v1/models (is {url}/nowhere/v1 the /v1 "
                        "base of an OpenAI-compatible server?)"),
    ("/slow/v1", {"timeout": 0.3}, "timeout: nothing received for 0.3 s"),
    ("/junk/v1", {}, "malformed answer to GET /junk/v1/models (not an OpenAI model list)"),
], ids=["404-model", "404-path", "timeout", "malformed"])
def test_construction_errors_name_the_endpoint(stub_url, path, kwargs, expected):
    with pytest.raises(RemoteError) as err:
        RemoteSide(stub_url + path, **kwargs)
    assert str(err.value).startswith(f"remote datacenter {stub_url}{path}: ")
    assert expected.format(url=stub_url) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_an_unreachable_endpoint_is_named_without_its_password():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteError) as err:
        RemoteSide(url.replace("//", "//user:pw@"), role="local", timeout=5)
    assert str(err.value) == f"remote local {url}: unreachable (connection refused)"
    # a named endpoint (from an admin's secrets) goes by its name: its address stays here
    with pytest.raises(RemoteError) as err:
        RemoteSide(url, role="local", name="laptop", timeout=5)
    assert str(err.value) == "remote local 'laptop': unreachable (connection refused)"


def test_a_wrong_or_missing_key_is_401_and_the_key_is_never_shown():
    stub = SimpleNamespace(loaded=SimpleNamespace(name="keyed"), max_model_len=2048)
    with serving(api_routes(lambda: stub, model_name="keyed", api_key=KEY)) as url:
        with pytest.raises(RemoteError) as err:
            RemoteSide(url + "/v1", api_key="wrong-key-123")
        assert str(err.value).startswith(f"remote datacenter {url}/v1: 401 unauthorized: "
                                          "the API key was refused (invalid API key)")
        assert "wrong-key-123" not in str(err.value)
        with pytest.raises(RemoteError, match="401 unauthorized: an API key is needed"):
            RemoteSide(url + "/v1")
        with RemoteSide(url + "/v1", api_key=KEY) as side:
            assert side.model == "keyed"
            assert KEY not in f"{side!r} {side} {side.stats()} {side.server_state()}"


def test_bad_arguments_are_value_errors(stub_url):
    for kwargs, word in [({"role": "cloud"}, "role"), ({"api": "responses"}, "api"),
                         ({"timeout": 0}, "timeout")]:
        with pytest.raises(ValueError, match=word):
            RemoteSide(stub_url + "/v1", **kwargs)
    with pytest.raises(ValueError, match="base_url") as err:
        RemoteSide("ftp://me:secret@host/v1")
    assert "secret" not in str(err.value)


# ---- the wire format ------------------------------------------------------------------------
def test_params_map_to_the_openai_body_and_extensions_only_when_set(side_of, script):
    chat, comp = side_of(), side_of(api="completions")
    p = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=20, seed=3,
                       stop=["\n"], stop_token_ids=[2], ignore_eos=True, min_tokens=2)
    assert chat.body("Hi", p) == {
        "model": STUB, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
        "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "top_k": 20,
        "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [2]}
    plain = comp.body([1, 2, 3], SamplingParams())
    assert plain == {"model": STUB, "stream": True, "stream_options": {"include_usage": True},
                     "prompt": [1, 2, 3], "max_tokens": 64, "temperature": 0.0, "top_p": 1.0}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "good"}]
    results([chat.submit(messages, p), comp.submit("good day", SamplingParams(max_tokens=3))])
    sent = {json.dumps(b, sort_keys=True) for b in script.bodies}
    assert sent == {json.dumps(chat.body(messages, p), sort_keys=True),
                    json.dumps(comp.body("good day", SamplingParams(max_tokens=3)),
                               sort_keys=True)}
    for side, prompt in [(chat, [1, 2]), (comp, messages), (chat, "  "), (comp, [])]:
        with pytest.raises(ValueError, match="prompt"):
            side.submit(prompt)
        with pytest.raises(ValueError, match="prompt"):
            side.check(prompt, SamplingParams())
    assert chat.check(messages, p) is None and comp.check([1, 2], p) is None
    with pytest.raises(ValueError, match="max_tokens: 4096 does not fit the remote model "
                                         "context of 4096 tokens"):
        chat.submit("Hi", SamplingParams(max_tokens=4096))
    with pytest.raises(ValueError, match=r"^n: a remote endpoint is sent one candidate"):
        comp.submit("Hi", SamplingParams(n=2))
    assert len(script.bodies) == 2  # nothing refused here went out


def test_a_stream_is_measured_on_chunk_arrival_and_counted_from_usage(side_of):
    side = side_of()
    handle = side.submit("good", SamplingParams(max_tokens=8))
    assert list(handle) == ["Hel", "lo", " world"]
    out = handle.result(timeout=RESULT_S)
    m = out.metrics
    assert (out.text, out.finish_reason, out.error) == ("Hello world", "stop", None)
    assert out.token_ids == [PLACEHOLDER_TOKEN] * 5 and handle.num_tokens == 5
    assert out.prompt_token_ids == [PLACEHOLDER_TOKEN] * 7 == handle.prompt_token_ids
    assert out.num_cached_tokens == 3
    assert len(m.chunk_times) == 3 and m.token_times[:3] == m.chunk_times
    assert m.token_times[3:] == [m.chunk_times[-1]] * 2
    assert m.ttft == m.chunk_times[0] - m.arrival_time > 0
    assert m.e2e == m.chunk_times[-1] - m.arrival_time
    assert m.tpot == pytest.approx((m.chunk_times[-1] - m.chunk_times[0]) / 4)
    assert len(m.itls) == 2 and all(g > 0 for g in m.itls) and sum(m.itls) > 0.05
    assert m.arrival_time <= m.first_scheduled_time <= m.chunk_times[0] <= m.finish_time
    s = side.stats()
    assert (s.num_finished, s.num_output_tokens, s.running_ids) == (1, 5, ())


def test_without_usage_chunks_are_counted(side_of):
    side = side_of(api="completions")
    out = side.submit("nousage please").result(timeout=RESULT_S)
    assert (out.text, out.finish_reason, out.token_ids) == ("ab", "length", [-1, -1])
    assert out.prompt_token_ids == [] and len(out.metrics.token_times) == 2
    assert side.stats().num_output_tokens == 2


# ---- errors fail only their own request --------------------------------------------------
@pytest.mark.parametrize(("kind", "expected"), [
    ("ghost", "404 model 'stub' not found (The model `stub` does not exist.)"),
    ("garbage", "malformed stream: an event is not JSON: '{not json'"),
    ("plain", "malformed stream: expected text/event-stream, got application/json"),
    ("cut", "malformed stream: it ended before a finish_reason or [DONE]"),
    ("midstream", "error from the server mid-stream: injected failure"),
    ("stall", "timeout: nothing received for 0.6 s"),
])
def test_a_failing_request_names_the_endpoint_and_spares_the_one_in_flight(
        side_of, stub_url, kind, expected):
    side = side_of(timeout=0.6)
    bad, good = results(side.submit_many([f"{kind} now", "good too"],
                                         [SamplingParams()] * 2))
    assert (bad.finish_reason, bad.error) == ("error", f"remote datacenter {stub_url}/v1: "
                                                       f"{expected}")
    assert (good.finish_reason, good.text, good.error) == ("stop", "Hello world", None)
    assert side.stats().num_finished == 2


def test_an_endpoint_that_goes_away_fails_its_requests_and_the_other_side_finishes(
        side_of, stub_url):
    other = side_of()
    script = Script()
    with serving(stand_in(script)) as url:
        going = RemoteSide(url + "/v1", role="local", timeout=5)
    try:
        gone = going.submit("good")
        kept = other.submit("good")
        out = gone.result(timeout=RESULT_S)
        assert (out.finish_reason, out.error) == (
            "error", f"remote local {url}/v1: unreachable (connection refused)")
        assert kept.result(timeout=RESULT_S).text == "Hello world"
        assert going.stats().num_finished == 1
    finally:
        going.shutdown()


# ---- roles, cancel, shutdown ------------------------------------------------------------
def test_the_datacenter_role_sends_every_request_at_once(side_of, script):
    side = side_of()
    outs = results(side.submit_many(["slow a", "slow b", "slow c"], [SamplingParams()] * 3))
    assert script.max_in_flight == 3
    assert max(o.metrics.first_scheduled_time for o in outs) < min(
        o.metrics.token_times[0] for o in outs)


def test_the_local_role_serves_one_at_a_time_in_arrival_order(side_of, script):
    side = side_of(role="local")
    handles = side.submit_many(["slow a", "slow b", "slow c", "slow d"], [SamplingParams()] * 4)
    ids = tuple(h.request_id for h in handles)
    assert handles[0].wait_first_token(RESULT_S)
    s = side.stats()
    assert (s.running_ids, s.waiting_ids, s.num_running, s.num_waiting) == (
        ids[:1], ids[1:], 1, 3)
    handles[3].cancel()
    outs = results(handles)
    assert [o.finish_reason for o in outs] == ["stop", "stop", "stop", "cancelled"]
    assert script.max_in_flight == 1
    assert [b["messages"][0]["content"] for b in script.bodies] == ["slow a", "slow b", "slow c"]
    for first, second in zip(outs[:2], outs[1:3], strict=True):
        assert second.metrics.first_scheduled_time >= first.metrics.finish_time
        assert second.ttft > first.e2e  # the wait for the one before is in its TTFT
    assert outs[3].metrics.token_times == [] and outs[3].text == ""


def test_cancel_closes_the_stream(side_of, script):
    side = side_of()
    handle = side.submit("stall here")
    wait_for(lambda: script.in_flight == 1, timeout=10, message="the stall never arrived")
    handle.cancel()
    out = handle.result(timeout=RESULT_S)
    assert out.finish_reason == "cancelled" and out.error is None and out.text == ""
    # the stand-in saw the client leave while it still sent nothing: the cancel closed
    # the stream during the stall, not after it
    wait_for(lambda: script.gone == ["stall here"], timeout=RESULT_S,
             message="the server never saw the client go away")
    side.cancel("no-such-request")  # unknown ids are ignored


def test_shutdown_cancels_everything_and_closes(side_of, script):
    side = side_of(role="local")
    running, queued = side.submit_many(["stall", "good"], [SamplingParams()] * 2)
    wait_for(lambda: script.in_flight == 1, timeout=10)
    side.shutdown()
    assert running.result(timeout=5).finish_reason == "cancelled"
    assert queued.result(timeout=5).finish_reason == "cancelled"
    assert len(script.bodies) == 1
    with pytest.raises(RuntimeError, match="shut down"):
        side.submit("good")
    side.shutdown()
    s = side.stats()
    assert (s.num_finished, s.num_running, s.num_waiting) == (2, 0, 0)


def test_shutdown_also_ends_a_stream_still_draining_after_its_done(side_of):
    side = side_of()
    out = side.submit("linger on").result(timeout=RESULT_S)  # ends at [DONE]; drain goes on
    assert out.finish_reason == "stop"
    side.shutdown()
    # no task left pending on the stopped loop (it would be destroyed pending, and its
    # drain's read error logged from a finalizer)
    assert not asyncio.all_tasks(side._loop)


def test_request_ids_are_kept_and_must_be_unique_in_flight(side_of):
    side = side_of()
    h = side.submit("stall", request_id="mine")
    with pytest.raises(ValueError, match="'mine' is already in flight"):
        side.submit("good", request_id="mine")
    with pytest.raises(ValueError, match="already in flight"):
        side.submit_many(["good", "good"], [SamplingParams()] * 2, ["a", "a"])
    assert h.request_id == "mine" and side.stats().running_ids == ("mine",)
    h.cancel()
    assert h.result(timeout=5).finish_reason == "cancelled"


# ---- the server's own state --------------------------------------------------------------
def test_server_state_is_polled_at_most_every_half_second(side_of, script):
    script.metrics_text = None
    try:
        side = side_of()
        assert side.server_state() is None  # not exported by this server
        script.metrics_text = VLLM_METRICS
        gets = script.metrics_gets
        t0 = time.monotonic()
        wait_for(lambda: side.server_state() is not None, timeout=5, interval=0.01)
        state = side.server_state()
        assert (state.running, state.waiting, state.kv_usage, state.source) == (
            3.0, 1.0, 0.5, "vllm")
        while time.monotonic() - t0 < 1.2:
            side.stats()
            time.sleep(0.01)
        assert script.metrics_gets - gets <= 4
    finally:
        script.metrics_text = None


def test_the_servers_state_is_kept_over_time_while_requests_are_out(side_of, script):
    script.metrics_text = VLLM_METRICS
    try:
        side = side_of()
        assert len(side.server_history()) == 1  # the reading at construction
        results([side.submit("slow one")])  # five chunks 100 ms apart
        # read when the request went out, every half second while it was out, once after
        wait_for(lambda: len(side.server_history()) >= 3, timeout=5,
                 message="no readings while the request was out")
        history = side.server_history()
        times = [s.time for s in history]
        assert times == sorted(times) and times[-1] - times[1] >= STATE_POLL_S * 0.9
        assert {(s.state.running, s.state.waiting, s.state.kv_usage, s.state.source)
                for s in history} == {(3.0, 1.0, 0.5, "vllm")}
        time.sleep(2 * STATE_POLL_S)  # the reading after the last request is in
        gets = script.metrics_gets
        time.sleep(2 * STATE_POLL_S)
        assert script.metrics_gets == gets  # nothing out: no polling
    finally:
        script.metrics_text = None


def test_a_server_without_metrics_is_not_polled_and_has_no_history(side_of, script):
    script.metrics_text = None
    side = side_of()
    gets = script.metrics_gets
    results([side.submit("slow one")])
    assert script.metrics_gets == gets and side.server_history() == []
    assert side.server_state() is None


# ---- the sweep's remote path is the load generator's ----------------------------------------
def test_a_sweeps_remote_side_and_the_load_generator_send_and_count_alike(side_of, script,
                                                                          stub_url):
    """A sweep whose sides are remote and `batchlens bench serve`'s `run_load` stream each
    request with the same function (server.stream_client.stream): the same body for the
    same prompt and settings, the same tokens counted from the same stream."""
    sweep = Sweep(side_of(), side_of(role="local"), [chat("good day")],
                  SweepPlan("users", (2,), max_tokens=5), heartbeat_timeout=None).start()
    assert sweep.join(timeout=RESULT_S)
    snap = sweep.snapshot()
    assert snap.phase == "done", snap.error
    swept = [json.dumps(b, sort_keys=True) for b in script.bodies]
    script.reset()
    load = run_load(stub_url, STUB, [LoadRequest("good day", 5)] * 2, endpoint="chat",
                    ignore_eos=True, warmup=False)
    assert [json.dumps(b, sort_keys=True) for b in script.bodies] * 2 == swept
    assert len(set(swept)) == 1 and json.loads(swept[0])["ignore_eos"] is True
    counted = [len(m.token_times) for p in snap.points for m in p.metrics]
    assert counted == [r.output_tokens for r in load.results] * 2 == [5] * 4  # usage, not chunks
    assert [len(r.chunk_times) for r in load.results] == [3, 3]


# ---- real batchlens servers ---------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=16, temperature=0)
PROMPTS = ["The three primary colors are", "Write a haiku about the sea.",
           "List three fruits:"]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def dc_engine(api_engine):
    return api_engine


@pytest.fixture(scope="module")
def dc_url(url):
    return url + "/v1"


@pytest.mark.model
@pytest.mark.parametrize(("api", "prompts"), [("chat", CHATS), ("completions", PROMPTS)])
def test_remote_datacenter_text_equals_the_in_process_engine(engine, dc_url, dc_engine, api,
                                                             prompts):
    refs = engine.generate(prompts, GREEDY)
    with RemoteSide(dc_url, api=api) as side:
        assert side.model == dc_engine.loaded.name
        handles = side.submit_many(prompts, [GREEDY] * len(prompts))
        streamed = ["".join(h) for h in handles]  # the deltas as they came
        outs = results(handles, MODEL_RESULT_S)
    assert streamed == [o.text for o in outs]
    for out, ref in zip(outs, refs, strict=True):
        assert (out.text, out.finish_reason) == (ref.text, ref.finish_reason)
        assert len(out.token_ids) == len(ref.token_ids)
        assert len(out.prompt_token_ids) == len(ref.prompt_token_ids)


@pytest.mark.model
def test_remote_datacenter_is_batched_by_the_server_and_its_state_is_seen(dc_url, dc_engine):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    side = RemoteSide(dc_url, api="completions")
    try:
        assert side.server_state().source == "batchlens"
        handles = side.submit_many(PROMPTS, [params] * 3)
        seen = []

        def batched() -> bool:
            state = side.server_state()
            seen.append(state)
            return state is not None and state.running >= 2 and state.kv_usage > 0

        wait_for(batched, timeout=MODEL_RESULT_S, interval=0.05,
                 message=f"the server never ran two at once: {seen[-3:]}")
    finally:
        side.shutdown()  # cancels the three, closing their streams
    outs = results(handles, 5)
    assert [o.finish_reason for o in outs] == ["cancelled"] * 3
    wait_for(lambda: quiet(dc_engine), timeout=5,
             message="the server did not free the blocks of the streams shut down")


@pytest.mark.model
def test_cancel_frees_the_servers_blocks_and_a_bad_request_fails_alone(dc_url, dc_engine):
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with RemoteSide(dc_url, api="completions") as side:
        handle = side.submit("Tell me a long story about a dragon.", long)
        assert handle.wait_first_token(MODEL_RESULT_S)
        assert dc_engine.stats(steps_after=None).num_running == 1
        handle.cancel()
        assert handle.result(timeout=5).finish_reason == "cancelled"
        wait_for(lambda: quiet(dc_engine), timeout=3,
                 message="the server did not free the cancelled request's blocks")

        # passes our check (under the model's context) but not the server's 4096-token pool
        assert side.max_model_len > 5000
        too_long, fine = side.submit_many(
            ["Hi", PROMPTS[0]], [SamplingParams(max_tokens=5000), GREEDY])
        bad, good = too_long.result(MODEL_RESULT_S), fine.result(MODEL_RESULT_S)
    assert bad.finish_reason == "error"
    assert bad.error.startswith(f"remote datacenter {dc_url}: HTTP 400 on POST /v1/completions")
    assert "max_tokens" in bad.error
    assert good.finish_reason in ("stop", "length") and good.text


@contextlib.contextmanager
def serve_process(*flags: str, key: str | None = None) -> Iterator[str]:
    """`batchlens serve` as its own process on a free 127.0.0.1 port; the /v1 base URL."""
    port = free_port()
    env = dict(os.environ, BATCHLENS_API_KEY=key or "")
    cmd = serve_command(port, "--log-level", "warning", *flags)
    with tempfile.TemporaryDirectory() as tmp, child_server(
            cmd, health_url(port), log=Path(tmp) / "serve.log", timeout=MODEL_RESULT_S,
            env=env, cwd=ROOT):
        yield f"http://127.0.0.1:{port}/v1"


@pytest.mark.model
def test_a_separate_server_process_as_the_local_pc(engine, loaded):
    refs = engine.generate(CHATS[:2], GREEDY)
    with serve_process("--device", "cpu", "--dtype", "float32", "--max-num-seqs", "1",
                       "--num-kv-blocks", "64", key=KEY) as url, \
            RemoteSide(url, role="local", api_key=KEY, name="laptop") as side:
        assert side.model == loaded.name and side.server_state().source == "batchlens"
        outs = side.generate(CHATS[:2], GREEDY)
        assert [o.text for o in outs] == [r.text for r in refs]
        assert [len(o.token_ids) for o in outs] == [len(r.token_ids) for r in refs]
        first, second = outs
        assert second.metrics.first_scheduled_time >= first.metrics.finish_time
        assert second.ttft > first.e2e
    with pytest.raises(RemoteError, match="remote local 'laptop': unreachable"):
        RemoteSide(url, role="local", api_key=KEY, name="laptop", timeout=5)


@pytest.mark.model
def test_a_race_between_two_remote_servers_matches_the_in_process_engine(engine):
    """A race whose datacenter is a batchlens server process and whose local PC is another
    one serving one sequence at a time: both sides finish, with the in-process engine's
    float32 greedy text."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    refs = [o.text for o in engine.generate(list(CHATS), params)]
    with serve_process("--dtype", "float32") as dc_url, \
            serve_process("--dtype", "float32", "--max-num-seqs", "1") as local_url:
        race = Race(RemoteSide(dc_url, role="datacenter"), RemoteSide(local_url, role="local"),
                    list(CHATS), params, heartbeat_timeout=None, close_local=True,
                    close_engine=True).start()
        assert race.join(timeout=MODEL_RESULT_S)
    snap = race.snapshot()
    assert snap.phase == "done" and snap.error is None and snap.ratio is not None
    for side in ("datacenter", "local"):
        assert [o.text for o in race.outputs(side)] == refs
