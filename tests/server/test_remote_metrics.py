"""A remote server's live state from its Prometheus text: vLLM's, SGLang's, llama.cpp's and
our own names, summed over label sets; None for a server that exports none of them. The
samples are written here from each server's metric names; one test reads our own server's
real /metrics over HTTP (a stand-in engine, no model)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import httpx
import pytest
from http_server import serving

from server.metrics import ServerMetrics
from server.remote_metrics import (
    ServerState,
    fetch_server_state,
    metrics_url,
    parse_server_state,
    samples,
)
from server.routes import api_routes

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 5.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 12345.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B"} 42.0
"""

VLLM_V0 = """\
vllm:num_requests_running{model_name="mistral"} 1.0
vllm:num_requests_swapped{model_name="mistral"} 0.0
vllm:num_requests_waiting{model_name="mistral"} 4.0
vllm:gpu_cache_usage_perc{model_name="mistral"} 0.75
vllm:cpu_cache_usage_perc{model_name="mistral"} 0.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen/Qwen2.5-7B",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen/Qwen2.5-7B",tp_rank="0"} 11.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen/Qwen2.5-7B",tp_rank="0"} 0.31
sglang:gen_throughput{model_name="qwen/Qwen2.5-7B",tp_rank="0"} 812.5
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1024
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""

BATCHLENS = """\
# TYPE batchlens:num_requests_running gauge
batchlens:num_requests_running{model_name="SmolLM2-135M-Instruct"} 2.0
# TYPE batchlens:num_requests_waiting gauge
batchlens:num_requests_waiting{model_name="SmolLM2-135M-Instruct"} 1.0
# TYPE batchlens:kv_cache_usage_perc gauge
batchlens:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.0625
"""

# what a server without any of the names exports (Go runtime metrics, as Ollama-style
# servers behind a Prometheus middleware do)
NONE_OF_THEM = """\
# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 42
process_resident_memory_bytes 1.2e+08
http_requests_total{code="200",path="/v1/chat/completions"} 7
"""


@pytest.mark.parametrize(("text", "expected"), [
    (VLLM, ServerState(8.0, 2.0, 0.375, "vllm")),
    (VLLM_V0, ServerState(1.0, 4.0, 0.75, "vllm")),
    (SGLANG, ServerState(7.0, 11.0, 0.31, "sglang")),
    (LLAMACPP, ServerState(1.0, 3.0, 0.125, "llamacpp")),
    (BATCHLENS, ServerState(2.0, 1.0, 0.0625, "batchlens")),
], ids=["vllm", "vllm-v0", "sglang", "llamacpp", "batchlens"])
def test_each_server_familys_names_are_read(text, expected):
    assert parse_server_state(text) == expected


@pytest.mark.parametrize("text", [NONE_OF_THEM, "", "not prometheus at all\n{}\n",
                                  "<html><body>404</body></html>"])
def test_a_server_without_the_names_gives_none(text):
    assert parse_server_state(text) is None


def test_counts_sum_over_label_sets_and_kv_usage_is_their_mean():
    text = ('vllm:num_requests_running{model_name="a"} 2\n'
            'vllm:num_requests_running{model_name="b"} 3\n'
            'vllm:num_requests_waiting{model_name="a"} 1\n'
            'vllm:num_requests_waiting{model_name="b"} 4\n'
            'vllm:kv_cache_usage_perc{model_name="a"} 0.5\n'
            'vllm:kv_cache_usage_perc{model_name="b"} 0.5\n')
    assert parse_server_state(text) == ServerState(5.0, 5.0, 0.5, "vllm")


def test_kv_usage_is_optional_and_a_family_needs_running_and_waiting():
    only_counts = ("sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n")
    assert parse_server_state(only_counts) == ServerState(1.0, 0.0, None, "sglang")
    assert parse_server_state("llamacpp:requests_processing 1\n") is None
    assert parse_server_state("vllm:kv_cache_usage_perc 0.9\n") is None


def test_the_newer_vllm_kv_name_wins_over_the_older_one():
    text = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n")
    assert parse_server_state(text).kv_usage == 0.1


def test_odd_lines_are_skipped_not_fatal():
    text = ('# EOF-less exposition with odd lines\n'
            'vllm:num_requests_running{model_name="a b {c}",path="x=\\"y\\""} 2 1700000000000\n'
            'vllm:num_requests_running{model_name="nan"} NaN\n'
            'this line is broken\n'
            'vllm:num_requests_waiting{model_name="a"} not-a-number\n'
            'vllm:num_requests_waiting{model_name="a b {c}"} +Inf\n'
            'vllm:num_requests_waiting{model_name="c"} 1e0\n'
            '# EOF\n')
    state = parse_server_state(text)
    assert state is not None and state.running == 2.0 and math.isinf(state.waiting)
    assert samples("a 1\na{x=\"1\"} 2\n\n#c\nb 3 123\n") == {"a": [1.0, 2.0], "b": [3.0]}


@pytest.mark.parametrize(("base", "url"), [
    ("http://gpu:8000/v1", "http://gpu:8000/metrics"),
    ("http://gpu:8000/v1/", "http://gpu:8000/metrics"),
    ("https://host/openai/v1", "https://host/openai/metrics"),
    ("http://laptop:8080", "http://laptop:8080/metrics"),
])
def test_the_metrics_url_is_the_base_without_v1(base, url):
    assert metrics_url(base) == url


def test_fetch_gives_none_for_404_unparsable_and_unreachable():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/vllm/metrics":
            return httpx.Response(200, text=VLLM)
        if request.url.path == "/ollama/metrics":
            return httpx.Response(200, text="404 page not found\n")
        if request.url.path == "/down/metrics":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(404, text="Not Found")

    with httpx.Client(transport=httpx.MockTransport(answer), base_url="http://x") as client:
        assert fetch_server_state(client, "http://x/vllm/metrics").source == "vllm"
        assert fetch_server_state(client, "http://x/ollama/metrics") is None
        assert fetch_server_state(client, "http://x/none/metrics") is None
        assert fetch_server_state(client, "http://x/down/metrics") is None


class GaugeEngine:
    """Just what our exporter's gauges read from an engine."""

    loaded = SimpleNamespace(name="stub-model")

    def stats(self, steps_after=None):
        return SimpleNamespace(num_running=3, num_waiting=2, kv=SimpleNamespace(usage=0.25))


def test_our_servers_real_metrics_over_http():
    engine = GaugeEngine()
    routes = api_routes(lambda: engine, model_name="stub-model",
                        metrics=ServerMetrics(lambda: engine))
    with serving(routes) as url, httpx.Client(timeout=10) as client:
        state = fetch_server_state(client, metrics_url(url + "/v1"))
        assert fetch_server_state(client, url + "/nothing-here") is None
    assert state == ServerState(3.0, 2.0, 0.25, "batchlens")
