"""The /metrics exporter: vLLM's names under `batchlens:`, gauges read from the engine's
stats at scrape time, counters and histograms fed by the finish listener.

The unit tests drive a stand-in engine with hand-made outputs (no model); the last test
runs the real engine on the bundled model."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import httpx
import pytest
from http_server import serving
from polling import wait_for
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig, RequestMetrics, RequestOutput, SamplingParams
from engine.core import StepStats
from engine.kv_cache import KVCacheStats
from engine.serving import ALL_STEPS, ServingStats
from server.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    build_1_2_5_buckets,
    iteration_tokens_buckets,
)
from server.routes import api_routes

P = "batchlens:"
MODEL = "stand-in/model"
MAX_MODEL_LEN = 2048
MAX_BATCHED = 512


def serving_stats(running: int = 0, waiting: int = 0, used_blocks: int = 0,
                  num_blocks: int = 64) -> ServingStats:
    kv = KVCacheStats(num_blocks=num_blocks, block_size=16, used_blocks=used_blocks,
                      cached_blocks=0, free_blocks=num_blocks - used_blocks,
                      used_slots=used_blocks * 16, reserved_slots=used_blocks * 16,
                      prefix_queries=0, prefix_hits=0)
    return ServingStats(model=MODEL, device="cpu", dtype="float32", dtype_reason="",
                        num_running=running, num_waiting=waiting, running_ids=(),
                        waiting_ids=(), num_finished=0, num_output_tokens=0,
                        kv_bytes_per_token=1, kv_reserved_bytes=0, kv_used_bytes=0, kv=kv)


class StandInEngine:
    """A stand-in for `Engine`: `stats()` returns the `ServingStats` a test sets,
    `finish(output)` and `step(stats)` call the finish and step listeners as the engine
    thread would."""

    def __init__(self, name: str = MODEL, stats: ServingStats | None = None,
                 max_model_len: int = MAX_MODEL_LEN,
                 max_num_batched_tokens: int = MAX_BATCHED,
                 speculative_tokens: int | None = None) -> None:
        self.loaded = SimpleNamespace(name=name)
        self.max_model_len = max_model_len
        self.config = SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens,
                                      enable_prefix_caching=True,
                                      speculative="ngram" if speculative_tokens else None,
                                      num_speculative_tokens=speculative_tokens or 4)
        self.current = stats or serving_stats()
        self.listeners: list = []
        self.step_listeners: list = []
        self.stats_calls: list = []

    def stats(self, steps_after: float | None = ALL_STEPS) -> ServingStats:
        self.stats_calls.append(steps_after)
        return self.current

    def add_finish_listener(self, listener) -> None:
        self.listeners.append(listener)

    def finish(self, *outputs: RequestOutput) -> None:
        for out in outputs:
            for listener in self.listeners:
                listener(out)

    def add_step_listener(self, listener) -> None:
        self.step_listeners.append(listener)

    def step(self, *steps: StepStats) -> None:
        for step in steps:
            for listener in self.step_listeners:
                listener(step)


def output(reason: str = "stop", prompt: int = 10, tokens: int = 4, arrival: float = 100.0,
           queue: float | None = 0.5, ttft: float = 1.0, gap: float = 0.05, cached: int = 0,
           preemptions: int = 0, max_tokens: int | None = 16) -> RequestOutput:
    """A finished request: `tokens` tokens, the first `ttft` s after arrival, then one
    every `gap` s; scheduled `queue` s after arrival (None: never scheduled)."""
    times = [arrival + ttft + i * gap for i in range(tokens)]
    m = RequestMetrics(arrival_time=arrival,
                       first_scheduled_time=None if queue is None else arrival + queue,
                       token_times=times,
                       finish_time=(times[-1] if times else arrival + ttft) + 0.001)
    return RequestOutput(request_id=f"r{id(m)}", prompt_token_ids=list(range(prompt)),
                         token_ids=list(range(tokens)), text="x" * tokens, finish_reason=reason,
                         metrics=m, num_cached_tokens=cached, num_preemptions=preemptions,
                         max_tokens=max_tokens)


def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of `render()`, parsed by prometheus_client: (name, labels) -> value."""
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE_LATEST
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, model: str = MODEL, **labels: str) -> float:
    key = (P + name, tuple(sorted({"model_name": model, **labels}.items())))
    assert key in samples, f"no sample {key}"
    return samples[key]


def buckets(samples: dict, name: str, model: str = MODEL) -> list[float]:
    """The finite `le` bounds of a histogram's buckets, in order."""
    bounds = [float(dict(labels)["le"]) for (n, labels), _ in samples.items()
              if n == P + name + "_bucket" and dict(labels)["model_name"] == model]
    return sorted(b for b in bounds if not math.isinf(b))


@pytest.fixture
def engine() -> StandInEngine:
    return StandInEngine(stats=serving_stats(running=3, waiting=5, used_blocks=16))


@pytest.fixture
def metrics(engine: StandInEngine) -> ServerMetrics:
    m = ServerMetrics(lambda: engine)
    m.watch(engine)
    return m


def test_gauges_are_the_current_engines_stats_at_scrape_time(engine, metrics):
    s = scrape(metrics)
    assert value(s, "num_requests_running") == 3
    assert value(s, "num_requests_waiting") == 5
    assert value(s, "kv_cache_usage_perc") == 0.25
    assert engine.stats_calls == [None]  # counts only, no step records copied
    engine.current = serving_stats(running=1, waiting=0, used_blocks=64)
    s = scrape(metrics)
    assert (value(s, "num_requests_running"), value(s, "num_requests_waiting"),
            value(s, "kv_cache_usage_perc")) == (1, 0, 1.0)


def test_series_exist_at_zero_once_an_engine_is_watched(metrics):
    s = scrape(metrics)
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum"):
        assert value(s, name) == 0
    for reason in ("stop", "length", "abort", "error"):
        assert value(s, "request_success_total", finished_reason=reason) == 0


def test_counters_are_the_sums_of_the_finished_requests(engine, metrics):
    outs = [output("stop", prompt=10, tokens=4, cached=0),
            output("stop", prompt=20, tokens=7, cached=16, preemptions=2),
            output("length", prompt=5, tokens=9, cached=0),
            output("cancelled", prompt=8, tokens=2, cached=0, preemptions=1),
            output("error", prompt=6, tokens=0)]
    engine.finish(*outs)
    s = scrape(metrics)
    assert value(s, "generation_tokens_total") == sum(len(o.token_ids) for o in outs) == 22
    assert value(s, "prompt_tokens_total") == 49
    assert value(s, "prefix_cache_queries_total") == 49
    assert value(s, "prefix_cache_hits_total") == 16
    assert value(s, "num_preemptions_total") == 3
    reasons = {r: value(s, "request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 2, "length": 1, "abort": 1, "error": 1}
    assert not [k for k in s if dict(k[1]).get("finished_reason") == "cancelled"]


def test_speculative_decoding_counters_are_vllms_and_sum_the_requests(engine, metrics):
    assert value(scrape(metrics), "spec_decode_num_drafts_total") == 0  # at zero while off
    a, b, plain = output(tokens=9), output(tokens=5), output(tokens=3)
    a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens = 4, 16, 11
    a.accepted_per_position = (4, 4, 2, 1)
    b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens = 2, 5, 0
    engine.finish(a, b, plain)
    s = scrape(metrics)
    assert value(s, "spec_decode_num_drafts_total") == 6
    assert value(s, "spec_decode_num_draft_tokens_total") == 21
    assert value(s, "spec_decode_num_accepted_tokens_total") == 11
    assert [value(s, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(4)] == [4, 4, 2, 1]


def test_accepted_drafts_per_position_start_at_zero_for_every_position():
    engine = StandInEngine(speculative_tokens=3)
    metrics = ServerMetrics(lambda: engine)
    metrics.watch(engine)
    s = scrape(metrics)
    assert [value(s, "spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [0, 0, 0]
    assert not [k for k in s if dict(k[1]).get("position") == "3"]


def test_a_request_never_scheduled_counts_no_prompt_and_hits_never_exceed_the_prompt(
        engine, metrics):
    never_scheduled = output("cancelled", prompt=30, tokens=0, queue=None)
    readmitted = output("stop", prompt=12, tokens=3, cached=32)  # hit prompt + outputs
    engine.finish(never_scheduled, readmitted)
    s = scrape(metrics)
    assert value(s, "prompt_tokens_total") == 12
    assert value(s, "prefix_cache_queries_total") == 12
    assert value(s, "prefix_cache_hits_total") == 12
    assert value(s, "request_queue_time_seconds_count") == 1
    assert value(s, "request_success_total", finished_reason="abort") == 1


def test_histograms_count_and_sum_each_request_and_each_token_gap(engine, metrics):
    a = output(tokens=4, queue=0.5, ttft=1.0, gap=0.05)
    b = output(tokens=1, queue=2.0, ttft=3.0)
    c = output("cancelled", tokens=0, queue=None, ttft=0.2)  # cancelled while waiting
    engine.finish(a, b, c)
    s = scrape(metrics)
    assert value(s, "time_to_first_token_seconds_count") == 2
    assert value(s, "time_to_first_token_seconds_sum") == pytest.approx(4.0)
    assert value(s, "inter_token_latency_seconds_count") == 3
    assert value(s, "inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert value(s, "e2e_request_latency_seconds_count") == 3  # every request that ended
    assert value(s, "e2e_request_latency_seconds_sum") == pytest.approx(
        a.metrics.e2e + b.metrics.e2e + 0.201)
    assert value(s, "request_queue_time_seconds_count") == 2
    assert value(s, "request_queue_time_seconds_sum") == pytest.approx(2.5)
    # cumulative buckets: TTFT 1.0 and 3.0 -> le=1.0 holds one, le=5.0 both
    assert value(s, "time_to_first_token_seconds_bucket", le="1.0") == 1
    assert value(s, "time_to_first_token_seconds_bucket", le="5.0") == 2
    assert value(s, "inter_token_latency_seconds_bucket", le="0.025") == 0
    assert value(s, "inter_token_latency_seconds_bucket", le="0.075") == 3


def test_histograms_use_vllms_bucket_lists(metrics):
    s = scrape(metrics)
    assert buckets(s, "time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert buckets(s, "inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert buckets(s, "e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert buckets(s, "request_queue_time_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert (len(TTFT_BUCKETS), TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (22, 0.001, 2560.0)
    assert (len(ITL_BUCKETS), ITL_BUCKETS[0], ITL_BUCKETS[-1]) == (19, 0.01, 80.0)
    assert (len(REQUEST_LATENCY_BUCKETS), REQUEST_LATENCY_BUCKETS[0],
            REQUEST_LATENCY_BUCKETS[-1]) == (21, 0.3, 7680.0)


# vLLM's lists, written out: what a vLLM dashboard's bucket boundaries expect
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0]
LENGTHS_2048 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # 1-2-5 up to max_model_len


def step_stats(prefill: int = 0, decode: int = 0, accepted: int = 0) -> StepStats:
    return StepStats(start=0.0, duration=0.01, num_seqs=1, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_preempted=0, kv_usage=0.0,
                     kv_used_slots=0, kv_reserved_slots=0, num_accepted_tokens=accepted)


def test_vllms_bucket_builders():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000,
                                         5000)
    full = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    assert iteration_tokens_buckets(512) == full[:8]  # ends at the step budget
    assert iteration_tokens_buckets(600) == full[:9]  # the first bound that holds it
    assert iteration_tokens_buckets(10**6) == full
    assert iteration_tokens_buckets(1) == (1,)


def test_the_new_histograms_use_vllms_buckets_sized_by_the_engine(metrics):
    s = scrape(metrics)
    for name in ("request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert buckets(s, name) == VLLM_LATENCY
    assert buckets(s, "request_time_per_output_token_seconds") == VLLM_ITL
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_max_tokens",
                 "request_prefill_kv_computed_tokens"):
        assert buckets(s, name) == LENGTHS_2048
    assert buckets(s, "request_params_n") == [1, 2, 5, 10, 20]
    assert buckets(s, "iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512]


def test_request_shape_histograms_count_every_request_that_ends(engine, metrics):
    outs = [output(prompt=10, tokens=4, max_tokens=4),
            output("length", prompt=300, tokens=16, max_tokens=16),
            output("cancelled", prompt=7, tokens=0, queue=None, max_tokens=64)]
    engine.finish(*outs)
    s = scrape(metrics)
    for name, sizes in (("request_prompt_tokens", [10, 300, 7]),
                        ("request_generation_tokens", [4, 16, 0]),
                        ("request_max_num_generation_tokens", [4, 16, 0]),
                        ("request_params_max_tokens", [4, 16, 64]),
                        ("request_params_n", [1, 1, 1])):
        assert (value(s, name + "_count"), value(s, name + "_sum")) == (3, sum(sizes)), name
    assert value(s, "request_prompt_tokens_bucket", le="10.0") == 2
    assert value(s, "request_prompt_tokens_bucket", le="200.0") == 2
    assert value(s, "request_prompt_tokens_bucket", le="500.0") == 3
    assert value(s, "request_params_n_bucket", le="1.0") == 3


def test_a_request_of_n_candidates_counts_n_and_every_candidates_tokens(engine, metrics):
    cands = [output(prompt=10, tokens=t, preemptions=p) for t, p in ((4, 0), (9, 1), (2, 0))]
    parent = dataclasses.replace(cands[0], candidates=cands)
    engine.finish(parent)
    s = scrape(metrics)
    assert (value(s, "request_params_n_count"), value(s, "request_params_n_sum")) == (1, 3)
    assert value(s, "request_generation_tokens_sum") == 15
    assert value(s, "request_max_num_generation_tokens_sum") == 9
    assert value(s, "request_prompt_tokens_sum") == 10  # the prompt once
    assert value(s, "generation_tokens_total") == 15 and value(s, "num_preemptions_total") == 1


def test_prompt_tokens_split_by_source_and_kv_computed(engine, metrics):
    engine.finish(output(prompt=40, cached=32), output(prompt=10, cached=0),
                  output(prompt=12, cached=48),  # readmitted: the hit is capped
                  output("cancelled", prompt=30, tokens=0, queue=None))
    s = scrape(metrics)
    assert value(s, "prompt_tokens_cached_total") == 32 + 12
    assert value(s, "prompt_tokens_by_source_total", source="local_cache_hit") == 44
    assert value(s, "prompt_tokens_by_source_total", source="local_compute") == 8 + 10
    assert value(s, "prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert sum(value(s, "prompt_tokens_by_source_total", source=src) for src in
               ("local_compute", "local_cache_hit")) == value(s, "prompt_tokens_total")
    assert value(s, "request_prefill_kv_computed_tokens_count") == 3  # scheduled ones
    assert value(s, "request_prefill_kv_computed_tokens_sum") == 18


def test_latency_split_prefill_decode_inference_and_tpot(engine, metrics):
    a = output(tokens=5, arrival=100.0, queue=0.5, ttft=2.0, gap=0.25)  # scheduled 100.5
    one = output(tokens=1, arrival=50.0, queue=1.0, ttft=1.5)  # no TPOT: a single token
    waiting = output("cancelled", tokens=0, queue=None)
    engine.finish(a, one, waiting)
    s = scrape(metrics)
    # a: prefill 102.0 - 100.5, decode 103.0 - 102.0, inference 103.0 - 100.5; one: 0.5, 0, 0.5
    assert value(s, "request_prefill_time_seconds_count") == 2
    assert value(s, "request_prefill_time_seconds_sum") == pytest.approx(1.5 + 0.5)
    assert value(s, "request_decode_time_seconds_count") == 2
    assert value(s, "request_decode_time_seconds_sum") == pytest.approx(1.0)
    assert value(s, "request_inference_time_seconds_count") == 2
    assert value(s, "request_inference_time_seconds_sum") == pytest.approx(2.5 + 0.5)
    assert value(s, "request_time_per_output_token_seconds_count") == 1
    assert value(s, "request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(s, "request_time_per_output_token_seconds_bucket", le="0.2") == 0
    assert value(s, "request_time_per_output_token_seconds_bucket", le="0.3") == 1


def test_iteration_tokens_count_each_step_of_each_watched_engine(engine, metrics):
    engine.step(step_stats(prefill=300), step_stats(prefill=20, decode=3),
                step_stats(decode=4, accepted=5))  # a verification generates its drafts
    other = StandInEngine(max_model_len=99_999, max_num_batched_tokens=99_999)
    metrics.watch(other)
    other.step(step_stats(decode=1))
    s = scrape(metrics)
    assert value(s, "iteration_tokens_total_count") == 4
    assert value(s, "iteration_tokens_total_sum") == 300 + 23 + 9 + 1
    assert value(s, "iteration_tokens_total_bucket", le="8.0") == 1
    assert value(s, "iteration_tokens_total_bucket", le="256.0") == 3
    assert value(s, "iteration_tokens_total_bucket", le="512.0") == 4
    # the first engine sized the buckets; a series keeps them for life
    assert buckets(s, "iteration_tokens_total")[-1] == 512
    assert buckets(s, "request_prompt_tokens") == LENGTHS_2048


def test_waiting_by_reason_and_cache_config_info_read_the_current_engine(engine, metrics):
    s = scrape(metrics)
    assert value(s, "num_requests_waiting_by_reason", reason="capacity") == 5
    assert value(s, "num_requests_waiting_by_reason", reason="deferred") == 0
    info = {k: v for k, v in s.items() if k[0] == P + "cache_config_info"}
    assert list(info.values()) == [1]
    assert dict(next(iter(info))[1]) == {
        "model_name": MODEL, "block_size": "16", "cache_dtype": "float32",
        "enable_prefix_caching": "True", "num_gpu_blocks": "64"}


def test_totals_survive_a_rebuild_and_an_engine_is_counted_once(engine, metrics):
    metrics.watch(engine)  # watched twice: still one listener
    assert len(engine.listeners) == 1
    engine.finish(output(tokens=4))
    rebuilt = StandInEngine(stats=serving_stats(running=2))
    current = [rebuilt]
    metrics.get_engine = lambda: current[0]
    metrics.watch(rebuilt)
    rebuilt.finish(output(tokens=6))
    engine.finish(output(tokens=1))  # the old engine draining still counts
    s = scrape(metrics)
    assert value(s, "generation_tokens_total") == 11
    assert value(s, "request_success_total", finished_reason="stop") == 3
    assert value(s, "num_requests_running") == 2


def test_model_name_labels_every_series(engine):
    m = ServerMetrics(lambda: engine, model_name="served-name")
    m.watch(engine)
    engine.finish(output(tokens=3))
    s = scrape(m)
    assert value(s, "generation_tokens_total", model="served-name") == 3
    assert value(s, "num_requests_running", model="served-name") == 3
    assert not [k for k in s if dict(k[1]).get("model_name") == MODEL]


def test_a_prefix_of_vllm_gives_vllms_own_names_and_their_names_before_the_renames(engine):
    """What vLLM's example Grafana dashboard reads: `vllm:*`, including the KV usage and
    inter-token histogram under the names they had before vLLM renamed them."""
    m = ServerMetrics(lambda: engine, prefix="vllm")
    m.watch(engine)
    engine.finish(output(tokens=4, gap=0.05))
    s = scrape(m)
    assert not [name for name, _ in s if not name.startswith("vllm:")]

    def got(name: str, **labels: str) -> float:
        return s[("vllm:" + name, tuple(sorted({"model_name": MODEL, **labels}.items())))]

    assert got("generation_tokens_total") == 4
    assert got("gpu_cache_usage_perc") == got("kv_cache_usage_perc") == 16 / 64
    assert got("time_per_output_token_seconds_count") == got(
        "inter_token_latency_seconds_count") == 3
    assert got("time_per_output_token_seconds_sum") == pytest.approx(0.15)
    assert got("time_per_output_token_seconds_bucket", le="0.075") == 3
    with pytest.raises(ValueError, match="metrics prefix: .*got 'vllm-2'"):
        ServerMetrics(lambda: engine, prefix="vllm-2")


def test_each_instance_has_its_own_registry(engine, metrics):
    other = ServerMetrics(lambda: engine)  # same names: no "duplicated timeseries" error
    other.watch(engine)
    engine.finish(output(tokens=5))
    assert value(scrape(metrics), "generation_tokens_total") == 5
    assert value(scrape(other), "generation_tokens_total") == 5
    assert other.registry is not metrics.registry


def test_the_listener_never_raises(engine, metrics):
    broken = output(tokens=2)
    broken.metrics = None  # type: ignore[assignment]
    engine.finish(broken)  # no exception reaches the engine thread
    engine.finish(output(tokens=2))
    assert value(scrape(metrics), "generation_tokens_total") >= 2


def test_no_engine_yet_gives_gauges_without_samples():
    def no_engine():
        raise RuntimeError("the model is still loading")

    s = scrape(ServerMetrics(no_engine))
    assert not [k for k in s if k[0] == P + "num_requests_running"]


@pytest.mark.model
def test_real_engine_counts_exactly_the_tokens_received(loaded):
    engine = Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64),
                    loaded=loaded)
    try:
        metrics = ServerMetrics(lambda: engine)
        metrics.watch(engine)
        name = loaded.name
        before = value(scrape(metrics), "generation_tokens_total", model=name)
        outs = engine.generate(["Hello", "What is 2 + 2?", "Name a colour."],
                               [SamplingParams(max_tokens=n) for n in (3, 8, 5)])
        received = sum(len(o.token_ids) for o in outs)
        assert received > 0

        def counted() -> float:  # the listener runs just after each result is handed out
            s = scrape(metrics)
            return sum(value(s, "request_success_total", model=name, finished_reason=r)
                       for r in ("stop", "length"))

        wait_for(lambda: counted() == len(outs), timeout=10)
        s = scrape(metrics)
        stats = engine.stats()
        assert value(s, "generation_tokens_total", model=name) - before == received
        assert value(s, "prompt_tokens_total", model=name) == sum(
            len(o.prompt_token_ids) for o in outs)
        assert value(s, "time_to_first_token_seconds_count", model=name) == len(outs)
        assert value(s, "num_requests_running", model=name) == stats.num_running == 0
        assert value(s, "num_requests_waiting", model=name) == stats.num_waiting == 0
        assert value(s, "kv_cache_usage_perc", model=name) == stats.kv.usage
    finally:
        engine.shutdown()


@pytest.mark.model
def test_real_engine_exports_its_speculative_decoding_counters(loaded):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64,
                          speculative="ngram", prompt_lookup_min=1)
    with Engine(config, loaded=loaded) as engine:
        metrics = ServerMetrics(lambda: engine)
        metrics.watch(engine)
        text = "one two three four five six seven eight"
        outs = engine.generate([f"Repeat exactly: {text}. Again: {text}.",
                                "Count from one to twenty: one, two, three, four,"],
                               SamplingParams(max_tokens=32))
        wait_for(lambda: sum(value(scrape(metrics), "request_success_total",
                                   model=loaded.name, finished_reason=r)
                             for r in ("stop", "length")) == 2, timeout=10)
        s, spec_decode = scrape(metrics), engine.stats().spec_decode
    assert spec_decode.num_drafts > 0 and sum(o.num_drafts for o in outs) == (
        spec_decode.num_drafts)
    per_position = [value(s, "spec_decode_num_accepted_tokens_per_pos_total",
                          model=loaded.name, position=str(i))
                    for i in range(config.num_speculative_tokens)]
    assert sum(per_position) == spec_decode.num_accepted_tokens > 0
    assert per_position == sorted(per_position, reverse=True)  # a draft needs those before it
    assert (value(s, "spec_decode_num_drafts_total", model=loaded.name),
            value(s, "spec_decode_num_draft_tokens_total", model=loaded.name),
            value(s, "spec_decode_num_accepted_tokens_total", model=loaded.name)) == (
        spec_decode.num_drafts, spec_decode.num_draft_tokens, spec_decode.num_accepted_tokens)


@pytest.mark.model
def test_real_engine_over_http_exports_vllms_histograms_of_the_requests_sent(loaded):
    """/metrics over HTTP after three completions: each request-shape histogram counts the
    requests and sums their sizes, and the tokens per step sum to the tokens computed."""
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64)
    with Engine(config, loaded=loaded) as engine:
        metrics = ServerMetrics(lambda: engine)
        metrics.watch(engine)
        name = loaded.name
        with serving(api_routes(lambda: engine, model_name=name, metrics=metrics)) as url:
            max_tokens = [3, 8, 5]
            usages = [httpx.post(url + "/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": n, "temperature": 0,
            }).json()["usage"] for prompt, n in zip(
                ["Hello", "What is 2 + 2?", "Name a colour."], max_tokens, strict=True)]

            def http_scrape() -> dict:
                text = httpx.get(url + "/metrics", timeout=10).text
                return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
                        for fam in text_string_to_metric_families(text) for smp in fam.samples}

            def finished() -> float:
                s = http_scrape()
                return sum(value(s, "request_success_total", model=name, finished_reason=r)
                           for r in ("stop", "length"))

            wait_for(lambda: finished() == 3, timeout=10)
            stats = engine.stats()
            wait_for(lambda: value(http_scrape(), "iteration_tokens_total_count",
                                   model=name) == stats.num_steps, timeout=10)
            s = http_scrape()
    prompts = [u["prompt_tokens"] for u in usages]
    generated = [u["completion_tokens"] for u in usages]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages]

    def hist(metric: str) -> tuple[float, float]:
        return value(s, metric + "_count", model=name), value(s, metric + "_sum", model=name)

    assert hist("request_prompt_tokens") == (3, sum(prompts))
    assert hist("request_generation_tokens") == (3, sum(generated))
    assert hist("request_max_num_generation_tokens") == (3, sum(generated))
    assert hist("request_params_max_tokens") == (3, sum(max_tokens))
    assert hist("request_params_n") == (3, 3)
    assert hist("request_prefill_kv_computed_tokens") == (3, sum(prompts) - sum(cached))
    for metric in ("request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_inference_time_seconds", "request_queue_time_seconds"):
        assert hist(metric)[0] == 3, metric
    assert hist("request_time_per_output_token_seconds")[0] == sum(g > 1 for g in generated)
    # each request computes its uncached prompt, then every output token but the last
    computed = sum(p - c + g - 1 for p, c, g in zip(prompts, cached, generated, strict=True))
    steps = stats.recent_steps
    assert hist("iteration_tokens_total") == (len(steps), computed)
    assert computed == sum(st.num_prefill_tokens + st.num_decode_tokens for st in steps)
    assert buckets(s, "iteration_tokens_total", model=name) == [
        1, 8, 16, 32, 64, 128, 256, 512]  # the default step budget, 512
    lengths = list(build_1_2_5_buckets(engine.max_model_len))
    assert lengths[:4] == [1, 2, 5, 10] and lengths[-1] <= engine.max_model_len
    for metric in ("request_prompt_tokens", "request_generation_tokens",
                   "request_max_num_generation_tokens", "request_params_max_tokens"):
        assert buckets(s, metric, model=name) == lengths, metric
    assert buckets(s, "request_prefill_time_seconds", model=name) == VLLM_LATENCY
    assert buckets(s, "request_time_per_output_token_seconds", model=name) == VLLM_ITL
    info = [dict(k[1]) for k in s if k[0] == P + "cache_config_info"]
    assert info == [{"model_name": name, "block_size": "16", "cache_dtype": "float32",
                     "enable_prefix_caching": "True", "num_gpu_blocks": "64"}]
