"""`batchlens bench serve`, the HTTP load generator.

Model-free: arrival times, the report's arithmetic on hand-made results, the stream
reader and every endpoint error against small canned servers (real uvicorn on 127.0.0.1).
`model`: a run against our own API server on the bundled float32 model, checked against
`Engine.generate` and the server's own /metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
from types import SimpleNamespace

import pytest
from http_server import serving
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import Engine, EngineConfig, SamplingParams
from measure.bench import serve
from measure.bench.serve import (
    EndpointError,
    LoadRequest,
    LoadResult,
    RequestResult,
    arrival_times,
    run_load,
    summarize_load,
)
from server.metrics import ServerMetrics
from server.routes import api_routes


# ---- arrivals -----------------------------------------------------------------------------
def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_arrivals_are_seeded_and_start_at_zero():
    a = arrival_times(50, 4.0, 1.0, seed=3)
    assert a == arrival_times(50, 4.0, 1.0, seed=3) != arrival_times(50, 4.0, 1.0, seed=4)
    assert a[0] == 0.0 and all(g >= 0 for g in gaps(a)) and len(a) == 50


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, math.inf) == [0.0] * 7
    assert arrival_times(0, 2.0) == []
    for rate, b in ((0, 1), (-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="> 0"):
            arrival_times(3, rate, b)


def test_poisson_gaps_average_one_over_the_rate():
    g = gaps(arrival_times(20001, 5.0, 1.0, seed=0))
    assert statistics.fmean(g) == pytest.approx(0.2, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(g) == pytest.approx(0.2, rel=0.05)


def test_burstiness_keeps_the_mean_and_scales_the_variance():
    """Gamma gaps of shape b and mean 1/rate have variance 1 / (rate^2 b)."""
    rate = 2.0
    for b in (0.25, 1.0, 4.0):
        g = gaps(arrival_times(20001, rate, b, seed=1))
        assert statistics.fmean(g) == pytest.approx(1 / rate, rel=0.05)
        assert statistics.pvariance(g) == pytest.approx(1 / (rate**2 * b), rel=0.1)


# ---- the report on hand-made results -------------------------------------------------
def test_request_result_pads_tokens_without_a_chunk_and_keeps_chunk_gaps():
    r = RequestResult(start=10.0, chunk_times=[10.5, 10.7, 11.5], output_tokens=5,
                      prompt_tokens=3)
    m = r.metrics()
    assert m.token_times == [10.5, 10.7, 11.5, 11.5, 11.5]
    assert (m.ttft, m.e2e) == pytest.approx((0.5, 1.5))
    assert m.tpot == pytest.approx(1.0 / 4)  # (E2E - TTFT) / (tokens - 1)
    assert r.chunk_metrics().itls == pytest.approx([0.2, 0.8])
    assert RequestResult(0.0, [1.0, 2.0, 3.0], output_tokens=2).metrics().token_times == [1.0, 2.0]
    assert not RequestResult(0.0, [1.0], 1, error="boom").ok and not RequestResult(0.0).ok


def test_summary_figures_from_hand_made_results():
    results = [
        RequestResult(0.0, [0.1, 0.2, 0.3], output_tokens=3, prompt_tokens=10),   # TPOT 0.1
        RequestResult(0.0, [0.3, 0.7], output_tokens=5, prompt_tokens=20),        # TPOT 0.1
        RequestResult(1.0, [1.5, 2.0], output_tokens=2, prompt_tokens=30),        # TPOT 0.5
        RequestResult(0.0, error="http://x/v1/completions: HTTP 500: oops"),
    ]
    doc = summarize_load(LoadResult("http://x", "m", "completions", results, 4.0),
                         ttft_slo=0.2, tpot_slo=0.2)
    assert (doc["completed"], doc["failed"]) == (3, 1)
    assert (doc["total_input_tokens"], doc["total_output_tokens"]) == (60, 10)
    assert doc["request_throughput"] == pytest.approx(3 / 4)
    assert doc["output_throughput"] == pytest.approx(10 / 4)
    assert doc["total_token_throughput"] == pytest.approx(70 / 4)
    ttft = doc["ttft_ms"]
    assert ttft["mean"] == pytest.approx(1000 * (0.1 + 0.3 + 0.5) / 3)
    assert (ttft["p50"], ttft["p90"], ttft["p99"]) == pytest.approx((300, 460, 496))
    assert doc["tpot_ms"]["mean"] == pytest.approx(1000 * 0.7 / 3)
    assert doc["tpot_token_weighted_ms"] == pytest.approx(1000 * (0.2 + 0.4 + 0.5) / 7)
    assert doc["itl_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.1 + 0.4 + 0.5) / 4)
    assert doc["e2e_ms"]["mean"] == pytest.approx(1000 * (0.3 + 0.7 + 1.0) / 3)
    # only the first request meets TTFT <= 200 ms and TPOT <= 200 ms
    assert doc["goodput"] == pytest.approx(1 / 4)
    assert doc["errors"] == {"http://x/v1/completions: HTTP 500: oops": 1}
    text = serve.format_summary(doc)
    assert "goodput" in text and "ttft <= 200 ms" in text and "HTTP 500: oops" in text
    doc["server_means_ms"] = {"ttft": 250.0}
    assert "server /metrics mean TTFT     250.0 ms; client mean TTFT" in serve.format_summary(doc)
    assert "(+20.0%)" in serve.format_summary(doc)
    assert "leave out the 1 failed requests" in serve.format_summary(doc)  # 3 of 4 here
    doc["failed"] = 0
    assert "leave out" not in serve.format_summary(doc)
    assert summarize_load(LoadResult("u", "m", "chat", results, 4.0))["goodput"] is None


def test_server_means_are_the_histograms_deltas():
    before = {"ttft": (1.0, 10.0), "itl": (2.0, 100.0)}
    after = {"ttft": (3.0, 20.0), "itl": (2.0, 100.0), "e2e": (8.0, 4.0)}
    assert serve.server_means(before, after) == pytest.approx({"ttft": 0.2, "e2e": 2.0})
    assert serve.server_means(None, after) == {}


def test_flags_slos_and_urls():
    assert serve.parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("e2el:100", "ttft:", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError, match="--goodput"):
            serve.parse_slos([bad])
    a = serve.build_parser().parse_args(["--goodput", "ttft:1", "--goodput", "tpot:2"])
    assert a.goodput == ["ttft:1", "tpot:2"] and a.request_rate == math.inf
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert serve.api_root(url) == "http://h:1"
    with pytest.raises(SystemExit):
        serve.main(["--goodput", "ttft"])


def test_datasets_are_seeded_and_sized():
    a = serve.bundled_requests(30, 12, seed=1)
    assert a == serve.bundled_requests(30, 12, seed=1) != serve.bundled_requests(30, 12, seed=2)
    assert len(a) == 30 and len({r.prompt for r in a}) > 10
    assert all(isinstance(r.prompt, str) and r.max_tokens == 12 for r in a)
    vocab = list(range(100, 200))
    r = serve.random_requests(vocab, 40, 20, 8, range_ratio=0.5, seed=0)
    assert all(10 <= len(x.prompt) == x.prompt_len <= 30 and 4 <= x.max_tokens <= 12
               for x in r)
    assert all(set(x.prompt) <= set(vocab) for x in r)
    assert {len(x.prompt) for x in serve.random_requests(vocab, 5, 20, 8)} == {20}
    with pytest.raises(ValueError):
        serve.random_requests([], 1, 1, 1)


# ---- canned servers: the stream reader and the errors ----------------------------------
def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Canned:
    """/v1/completions answering by the `model` sent: `usage` (two chunks, usage 5),
    `chunks` (three chunks, no usage), `chat`-style deltas at /v1/chat/completions,
    `malformed`, `error` (an SSE error event), `empty`, `stopped` (a finish reason, no
    text), `slow` (silent 2 s), `count` (tracks requests in flight)."""

    def __init__(self) -> None:
        self.in_flight = self.peak = 0

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        return StreamingResponse(self.events(body["model"], chat=False),
                                 media_type="text/event-stream")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        return StreamingResponse(self.events(body["model"], chat=True),
                                 media_type="text/event-stream")

    async def events(self, model: str, chat: bool):
        def piece(text: str):
            key = {"delta": {"content": text}} if chat else {"text": text}
            return sse({"choices": [{"index": 0, **key}]})

        if model == "malformed":
            yield "data: {oops\n\n"
        elif model == "error":
            yield piece("a")
            yield "event: error\n" + sse({"error": {"message": "engine fell over"}})
        elif model == "stopped":  # the model's end at once: a finish reason, no text
            yield sse({"choices": [{"index": 0, "finish_reason": "stop",
                                    **({"delta": {}} if chat else {"text": ""})}]})
        elif model == "slow":
            await asyncio.sleep(2)
        elif model == "count":
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await asyncio.sleep(0.05)
            yield piece("x")
            self.in_flight -= 1
        elif model in ("chunks", "usage"):
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for text in ("a", "b", "c")[: 3 if model == "chunks" else 2]:
                await asyncio.sleep(0.01)
                yield piece(text)
            if model == "usage":
                yield sse({"choices": [], "usage": {"prompt_tokens": 7,
                                                    "completion_tokens": 5}})
        yield "data: [DONE]\n\n"

    def routes(self) -> list[Route]:
        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "usage"}, {"id": "x"}]})

        return [Route("/v1/models", models), Route("/v1/completions", self.completions,
                                                   methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"])]


@pytest.fixture(scope="module")
def canned():
    c = Canned()
    with serving(c.routes()) as url:
        yield c, url


def load(url: str, model: str, n: int = 1, **kw) -> LoadResult:
    return run_load(url, model, [LoadRequest("hi", 8, 2)] * n, warmup=False, **kw)


def test_usage_counts_tokens_and_chunks_count_without_it(canned):
    _, url = canned
    r = load(url + "/v1", "usage").results[0]
    assert r.ok and (r.output_tokens, r.prompt_tokens, r.text) == (5, 7, "ab")
    assert len(r.chunk_times) == 2 and r.chunk_times[0] > r.start
    r = load(url, "chunks").results[0]
    assert r.ok and (r.output_tokens, r.prompt_tokens, r.text) == (3, 2, "abc")
    r = load(url, "usage", endpoint="chat").results[0]  # the role-only chunk is no content
    assert r.ok and r.text == "ab" and len(r.chunk_times) == 2


def test_stream_failures_name_the_endpoint(canned):
    _, url = canned
    # the messages of the one streaming client (server.stream_client), as a remote side's
    want = {"malformed": "malformed stream: an event is not JSON: '{oops'",
            "error": "error from the server mid-stream: engine fell over",
            "empty": "the stream ended without any content",
            "stopped": "the stream ended without any content (finish_reason 'stop'); an "
                       "instruct model given a bare prompt often ends at once: --endpoint "
                       "chat or --ignore-eos makes it answer"}
    for model, message in want.items():
        r = load(url, model).results[0]
        assert not r.ok and r.error == f"{url}/v1/completions: {message}"
    r = load(url, "stopped", endpoint="chat").results[0]  # no hint where it cannot help
    assert r.error == f"{url}/v1/chat/completions: the stream ended without any content " \
        "(finish_reason 'stop')"
    r = load(url, "slow", timeout=0.3).results[0]
    assert r.error == f"{url}/v1/completions: timeout: nothing received for 0.3 s"
    with pytest.raises(EndpointError, match="malformed stream"):
        run_load(url, "malformed", [LoadRequest("hi", 4)])  # the warm-up must succeed


def test_max_concurrency_and_rate_bound_the_load(canned):
    c, url = canned
    c.peak = 0
    res = load(url, "count", n=6, max_concurrency=2)
    assert all(r.ok for r in res.results) and c.peak == 2
    c.peak = 0
    res = load(url, "count", n=6)
    assert c.peak == 6
    res = load(url, "count", n=4, rate=20.0, seed=0)
    starts = [r.start for r in res.results]
    wanted = arrival_times(4, 20.0, 1.0, seed=0)
    # sent in the order of their arrival times, the last not before its own (how late a
    # busy machine sends each one is the benchmark's to measure, not a test's to assert)
    assert starts == sorted(starts) and wanted == sorted(wanted)
    assert res.duration >= wanted[-1]


VLLM_METRICS = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 1.0
vllm:time_to_first_token_seconds_sum{model_name="a"} 0.5
vllm:time_to_first_token_seconds_count{model_name="a"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="b"} 1.5
vllm:time_to_first_token_seconds_count{model_name="b"} 3.0
vllm:time_per_output_token_seconds_sum{model_name="a"} 4.0
vllm:time_per_output_token_seconds_count{model_name="a"} 40.0
vllm:num_requests_running{model_name="a"} 1.0
"""


def test_server_histograms_are_read_in_any_family_of_names():
    async def metrics(request: Request) -> Response:
        return Response(VLLM_METRICS, media_type="text/plain")

    with serving([Route("/metrics", metrics)]) as url:
        got = serve.scrape_server_metrics(url + "/v1")
    assert got == {"ttft": (2.0, 5.0), "itl": (4.0, 40.0)}  # label sets summed; older ITL
    with serving([]) as url:
        assert serve.scrape_server_metrics(url) is None  # 404: no /metrics
    assert serve.scrape_server_metrics(f"http://127.0.0.1:{closed_port()}") is None


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def keyed():
    """Our API's routes over a stand-in engine, with an API key: 401 and 404 come from
    the real route code, before any generation."""
    stub = SimpleNamespace(max_model_len=2048, loaded=SimpleNamespace(name="stub-model"))
    with serving(api_routes(lambda: stub, model_name="stub-model", api_key="k")) as url:
        yield url


def test_command_errors_name_the_endpoint(keyed, capsys, monkeypatch):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    url = f"http://127.0.0.1:{closed_port()}"
    assert serve.main(["--base-url", url, "--num-prompts", "1"]) == 1
    assert f"error: {url}/v1/models: unreachable" in capsys.readouterr().err
    assert serve.main(["--base-url", keyed, "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert f"{keyed}/v1/models: 401 unauthorized: an API key is needed (missing API key" in err
    assert "--api-key" in err
    assert serve.main(["--base-url", keyed, "--api-key", "bad", "--num-prompts", "1"]) == 1
    assert "401 unauthorized: the API key was refused (invalid API key)" in capsys.readouterr().err
    monkeypatch.setenv(serve.API_KEY_ENV, "k")
    assert serve.main(["--base-url", keyed + "/v1", "--model", "nope", "--num-prompts",
                       "1"]) == 1
    err = capsys.readouterr().err
    assert "'nope' is not among /v1/models (stub-model)" in err
    # the bundled prompts go to the chat endpoint unless another is asked
    assert (f"{keyed}/v1/chat/completions: 404 model 'nope' not found (The model `nope` does "
            "not exist") in err


def test_command_prints_and_saves_the_figures(canned, tmp_path, capsys):
    _, url = canned
    out = tmp_path / "serve.json"
    assert serve.main(["--base-url", url, "--num-prompts", "5", "--max-concurrency", "2",
                       "--goodput", "ttft:5000", "tpot:5000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "completed requests" in text and "TPOT" in text and "goodput" in text
    doc = json.loads(out.read_text())
    assert (doc["model"], doc["completed"], doc["failed"]) == ("usage", 5, 0)
    assert doc["endpoint"] == "chat"  # the bundled prompts' default
    assert doc["total_output_tokens"] == 25 and doc["goodput"] > 0
    assert doc["request_rate"] is None and doc["server_means_ms"] == {}  # inf; no /metrics
    assert set(doc["ttft_ms"]) == {"mean", "p50", "p90", "p99"}


# ---- against our own server on the bundled model -----------------------------------------
@pytest.mark.model
def test_against_our_server_text_tokens_and_metrics(loaded):
    name = loaded.name
    with Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256),
                loaded=loaded) as eng:
        metrics = ServerMetrics(lambda: eng)
        metrics.watch(eng)
        with serving(api_routes(lambda: eng, model_name=name, metrics=metrics)) as url:
            assert serve.list_models(url) == [name]
            reqs = [LoadRequest(r.prompt, 12, r.prompt_len)
                    for r in serve.bench_mix_requests(loaded.tokenizer, 8, seed=0)]
            res = run_load(url, name, reqs, ignore_eos=True, server_metrics=True)
            chats = serve.bundled_requests(2, 10, seed=0)
            chat = run_load(url, name, chats, max_concurrency=1, endpoint="chat")
        refs = [eng.generate([list(r.prompt)], SamplingParams(max_tokens=12,
                                                              ignore_eos=True))[0]
                for r in reqs[:2]]
        chat_refs = [eng.generate([[{"role": "user", "content": r.prompt}]],
                                  SamplingParams(max_tokens=10))[0] for r in chats]
    assert all(r.ok for r in res.results + chat.results)
    assert [r.output_tokens for r in res.results] == [12] * 8
    assert [r.prompt_tokens for r in res.results] == [r.prompt_len for r in reqs]
    assert [r.text for r in res.results[:2]] == [o.text for o in refs]
    assert [r.text for r in chat.results] == [o.text for o in chat_refs]
    doc = summarize_load(res)
    assert doc["completed"] == 8 and doc["total_output_tokens"] == 96
    # the client's TTFT includes HTTP and the server's polling tick: never much below the
    # server's own (counted from the engine's arrival), and not far above it
    client, server = doc["ttft_ms"]["mean"], doc["server_means_ms"]["ttft"]
    print(f"TTFT mean: client {client:.1f} ms, server /metrics {server:.1f} ms; ITL mean: "
          f"client {doc['itl_ms']['mean']:.1f} ms, server {doc['server_means_ms']['itl']:.1f}")
    assert 0.9 * server - 5 <= client <= 2 * server + 200
