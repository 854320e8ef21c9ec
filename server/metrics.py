"""Prometheus metrics of the shared engine, under vLLM's names with our own prefix.

Every name, label and bucket list is vLLM V1's (`vllm/v1/metrics/loggers.py`) with
`batchlens:` in place of `vllm:` (or any prefix asked: `vllm` lets a vLLM Grafana
dashboard read them unmodified), labelled `model_name` (docs/metrics.md lists them all):

- gauges read from the current engine at scrape time: `num_requests_running`,
  `num_requests_waiting`, `num_requests_waiting_by_reason{reason}`, `kv_cache_usage_perc`
  (used blocks / blocks, 0-1), also as `gpu_cache_usage_perc` (its name before vLLM
  renamed it, which vLLM's example dashboard still reads) and the info gauge
  `cache_config_info`;
- counters and histograms fed by each watched engine's finish listener, so every request
  counts (a browser's, the API's, a workload's) and the totals survive an engine rebuild:
  token, prefix-cache, preemption, request-success and speculative-decoding counters, the
  latency histograms (TTFT, ITL also as `time_per_output_token_seconds` for the same
  reason, TPOT, E2E, queue, prefill, decode, inference) and the
  request-shape histograms (prompt, generation, max_tokens, n);
- `iteration_tokens_total`, fed by each watched engine's step listener: the tokens of each
  engine step.

The histograms whose buckets depend on the engine's limits (`max_model_len`,
`max_num_batched_tokens`) take them from the first engine watched: a series keeps its
buckets for life, or `rate()` over a rebuild would mix two bucket lists.

A request counts when it ends. Its prompt tokens and prefix-cache lookup count only if it
was scheduled (a request cancelled while waiting was never prefilled nor looked up); the
lookup counted is its prompt against the hit of its latest admission, capped at the prompt
(after a preemption the engine looks the prompt and the tokens so far up again).
`finished_reason` uses vLLM's words: our "cancelled" is vLLM's "abort", and our "error"
(the request failed inside the engine) is vLLM's own "error" reason, which vLLM also
counts under `request_success`.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine import Engine
    from engine.core import StepStats
    from engine.outputs import RequestOutput
    from engine.serving import ServingStats

PREFIX = "batchlens:"
LABEL = "model_name"

# vLLM's bucket lists (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = ITL_BUCKETS  # vLLM gives request_time_per_output_token the ITL list
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# our finish reason -> vLLM's `finished_reason` label
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
# vLLM's `prompt_tokens_by_source` sources; no KV connector here, so no external transfer
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's `num_requests_waiting_by_reason` reasons: "deferred" (waiting on something other
# than engine capacity, such as a grammar or a remote KV transfer) never happens here
WAITING_REASONS = ("capacity", "deferred")
# the `cache_config_info` labels (vLLM's CacheConfig field names) this engine has
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks")

log = logging.getLogger(__name__)


def metrics_prefix(value: str) -> str:
    """The metric names' prefix as given ("vllm" or "vllm:"), with its colon; `ValueError`
    naming it where Prometheus would refuse the names."""
    name = value.strip().removesuffix(":")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError("metrics prefix: letters, digits and underscores, not starting "
                         f"with a digit (such as vllm or batchlens), got {value!r}")
    return name + ":"


def _counter(reg: CollectorRegistry, prefix: str, name: str, doc: str,
             *labels: str) -> Counter:
    return Counter(prefix + name, doc, [LABEL, *labels], registry=reg)


def _histogram(reg: CollectorRegistry, prefix: str, name: str, doc: str,
               buckets: tuple[float, ...]) -> Histogram:
    return Histogram(prefix + name, doc, [LABEL], registry=reg, buckets=buckets)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def iteration_tokens_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """vLLM's tokens-per-step list, cut after the first bound that holds the step budget
    (no step computes more than `max_num_batched_tokens` tokens)."""
    kept = [b for b in ITERATION_TOKENS_BUCKETS if b < max_num_batched_tokens]
    above = [b for b in ITERATION_TOKENS_BUCKETS if b >= max_num_batched_tokens]
    return tuple(kept + above[:1])


class _Series:
    """The counters' and histograms' children for one model name (looked up once, so the
    listeners do no label lookups)."""

    def __init__(self, m: ServerMetrics, name: str) -> None:
        def child(metric: Any) -> Any:
            return metric.labels(name)

        self.prompt_tokens = child(m.prompt_tokens)
        self.prompt_tokens_cached = child(m.prompt_tokens_cached)
        self.prompt_by_source = {s: m.prompt_tokens_by_source.labels(name, s)
                                 for s in PROMPT_SOURCES}
        self.generation_tokens = child(m.generation_tokens)
        self.prefix_queries = child(m.prefix_queries)
        self.prefix_hits = child(m.prefix_hits)
        self.preemptions = child(m.preemptions)
        self.spec_drafts = child(m.spec_drafts)
        self.spec_draft_tokens = child(m.spec_draft_tokens)
        self.spec_accepted_tokens = child(m.spec_accepted_tokens)
        self.spec_accepted_at: dict[int, Any] = {}  # draft position -> its child
        self._accepted_per_pos = lambda i: m.spec_accepted_per_pos.labels(name, str(i))
        self.success = {label: m.request_success.labels(name, label)
                        for label in dict.fromkeys(FINISHED_REASONS.values())}
        self.ttft, self.itl, self.tpot = child(m.ttft), child(m.itl), child(m.tpot)
        self.e2e, self.queue_time = child(m.e2e), child(m.queue_time)
        self.prefill_time, self.decode_time = child(m.prefill_time), child(m.decode_time)
        self.inference_time = child(m.inference_time)
        self.params_n = child(m.params_n)
        sized = m.sized
        assert sized is not None, "the limit-sized histograms exist before any series"
        self.prompt_len, self.generation_len = child(sized.prompt), child(sized.generation)
        self.max_generation_len = child(sized.max_generation)
        self.params_max_tokens = child(sized.params_max_tokens)
        self.prefill_kv_computed = child(sized.prefill_kv_computed)
        self.iteration_tokens = child(sized.iteration_tokens)

    def record(self, out: RequestOutput) -> None:
        """One finished request: its tokens, preemptions and drafts summed over its
        candidates (n > 1); its latencies are candidate 0's."""
        self.success[FINISHED_REASONS.get(out.finish_reason, "error")].inc()
        answers = out.answers
        self.generation_tokens.inc(sum(len(a.token_ids) for a in answers))
        self.preemptions.inc(sum(a.num_preemptions for a in answers))
        for a in answers:
            if a.num_drafts:
                self.spec_drafts.inc(a.num_drafts)
                self.spec_draft_tokens.inc(a.num_draft_tokens)
                self.spec_accepted_tokens.inc(a.num_accepted_tokens)
                for i, accepted in enumerate(a.accepted_per_position):
                    self.accepted_at(i).inc(accepted)
        self._record_shape(out)
        if out.metrics.queue_time is not None:  # scheduled: prefilled and looked up
            self._record_prefill(out)
        self._record_times(out)

    def _record_shape(self, out: RequestOutput) -> None:
        """Its size and parameters: every request that ends counts."""
        answers = out.answers
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.generation_len.observe(sum(len(a.token_ids) for a in answers))
        # vLLM's max over a request's n parallel samples
        self.max_generation_len.observe(max(len(a.token_ids) for a in answers))
        self.params_n.observe(len(answers))
        if out.max_tokens:
            self.params_max_tokens.observe(out.max_tokens)

    def _record_prefill(self, out: RequestOutput) -> None:
        """Its prompt and prefix-cache lookup (a scheduled request only)."""
        n_prompt = len(out.prompt_token_ids)
        cached = min(out.num_cached_tokens, n_prompt)
        self.prompt_tokens.inc(n_prompt)
        self.prompt_tokens_cached.inc(cached)
        self.prompt_by_source["local_compute"].inc(n_prompt - cached)
        self.prompt_by_source["local_cache_hit"].inc(cached)
        self.prefix_queries.inc(n_prompt)
        self.prefix_hits.inc(cached)
        self.prefill_kv_computed.observe(n_prompt - cached)
        self.queue_time.observe(out.metrics.queue_time)

    def _record_times(self, out: RequestOutput) -> None:
        """Its latencies, each where the request lived long enough to have it."""
        m = out.metrics
        if not m.token_times:
            if m.finish_time is not None:  # ended without a token: its whole life
                self.e2e.observe(m.finish_time - m.arrival_time)
            return
        first, last = m.token_times[0], m.token_times[-1]
        self.ttft.observe(m.ttft)
        self.e2e.observe(m.e2e)
        self.decode_time.observe(last - first)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.tpot is not None:  # two tokens or more
            self.tpot.observe(m.tpot)
        if m.first_scheduled_time is not None:
            self.prefill_time.observe(first - m.first_scheduled_time)
            self.inference_time.observe(last - m.first_scheduled_time)

    def accepted_at(self, position: int) -> Any:
        """The accepted-drafts counter of one draft position (made once)."""
        if position not in self.spec_accepted_at:
            self.spec_accepted_at[position] = self._accepted_per_pos(position)
        return self.spec_accepted_at[position]

    def record_step(self, step: StepStats) -> None:
        """One engine step: vLLM's prompt + generation tokens of the iteration (a
        verification generates its accepted drafts besides its sampled token)."""
        self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens
                                      + step.num_accepted_tokens)


class _SizedHistograms:
    """The histograms whose buckets follow an engine's limits, as vLLM sizes them."""

    def __init__(self, reg: CollectorRegistry, prefix: str, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        lengths = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[int, ...]) -> Histogram:
            return _histogram(reg, prefix, name, doc, buckets)

        self.prompt = histogram("request_prompt_tokens",
                                "Number of prefill tokens processed.", lengths)
        self.generation = histogram("request_generation_tokens",
                                    "Number of generation tokens processed.", lengths)
        self.max_generation = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", lengths)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            lengths)
        self.prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            lengths)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            iteration_tokens_buckets(max_num_batched_tokens))


class _EngineGauges(Collector):
    """Running, waiting, KV usage and cache config of the current engine, read at each
    scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        prefix = self._metrics.prefix
        running = GaugeMetricFamily(prefix + "num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=[LABEL])
        waiting = GaugeMetricFamily(prefix + "num_requests_waiting",
                                    "Number of requests waiting to be processed.",
                                    labels=[LABEL])
        by_reason = GaugeMetricFamily(
            prefix + "num_requests_waiting_by_reason",
            "Number of requests waiting to be processed, by reason.",
            labels=[LABEL, "reason"])
        usage = GaugeMetricFamily(prefix + "kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.",
                                  labels=[LABEL])
        usage_before = GaugeMetricFamily(
            prefix + "gpu_cache_usage_perc",
            "KV-cache usage, under its name before kv_cache_usage_perc (vLLM's example "
            "Grafana dashboard reads it). 1 means 100 percent usage.", labels=[LABEL])
        info = GaugeMetricFamily(prefix + "cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=[LABEL, *CACHE_INFO_LABELS])
        try:
            engine = self._metrics.get_engine()
            stats = engine.stats(steps_after=None)  # no step records: only the counts
            name = self._metrics.model_name or engine.loaded.name
        except Exception:  # no engine yet, or one being rebuilt: no samples this scrape
            log.debug("metrics: no engine to read", exc_info=True)
        else:
            running.add_metric([name], stats.num_running)
            waiting.add_metric([name], stats.num_waiting)
            for reason in WAITING_REASONS:  # every waiting request waits for capacity
                by_reason.add_metric([name, reason],
                                     stats.num_waiting if reason == "capacity" else 0)
            kv_usage = stats.kv.usage if stats.kv is not None else 0.0
            usage.add_metric([name], kv_usage)
            usage_before.add_metric([name], kv_usage)
            cache_info = self._cache_info(engine, stats)
            if cache_info is not None:
                info.add_metric([name, *cache_info], 1)
        yield from (running, waiting, by_reason, usage, usage_before, info)

    @staticmethod
    def _cache_info(engine: Engine, stats: ServingStats) -> tuple[str, ...] | None:
        """The `CACHE_INFO_LABELS` values, as vLLM writes them (`str()` of each); None
        where the engine has no cache config to read (the other gauges still report)."""
        kv = stats.kv
        if kv is None:
            return None
        try:
            return (str(kv.block_size), stats.dtype, str(engine.config.enable_prefix_caching),
                    str(kv.num_blocks))
        except AttributeError:  # a stand-in engine with only the counts
            log.debug("metrics: no cache config to read", exc_info=True)
            return None


class _Renamed(Collector):
    """A metric's samples again under another name, copied at scrape time (the engine
    thread observes each value once)."""

    def __init__(self, source: Collector, name: str, doc: str) -> None:
        self._source, self._name, self._doc = source, name, doc

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            renamed = Metric(self._name, self._doc, family.type)
            for sample in family.samples:
                renamed.add_sample(self._name + sample.name[len(family.name):],
                                   sample.labels, sample.value, sample.timestamp,
                                   sample.exemplar)
            yield renamed


class ServerMetrics:
    """The /metrics exporter: `watch` every engine built, `render` on each scrape.

    `get_engine` returns the current engine (settings may rebuild it); `model_name`, if
    given, labels every series, else each engine's `loaded.name` does; `prefix` starts
    every name (`metrics_prefix`: "vllm" lets vLLM's own dashboards read them unmodified).
    Each instance has its own `CollectorRegistry` unless one is passed, so several never
    collide.
    """

    def __init__(
        self,
        get_engine: Callable[[], Engine],
        model_name: str | None = None,
        registry: CollectorRegistry | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self.get_engine = get_engine
        self.model_name = model_name
        self.prefix = metrics_prefix(prefix)
        self.registry = reg = registry if registry is not None else CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return _counter(reg, self.prefix, name, doc, *labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return _histogram(reg, self.prefix, name, doc, buckets)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = counter(
            "prompt_tokens_by_source", "Number of prompt tokens by source.", "source")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", "position")
        self.request_success = counter("request_success",
                                       "Count of successfully processed requests.",
                                       "finished_reason")
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.sized: _SizedHistograms | None = None  # sized by the first engine watched
        reg.register(_EngineGauges(self))
        reg.register(_Renamed(
            self.itl, self.prefix + "time_per_output_token_seconds",
            "Histogram of inter-token latency in seconds, under its name before "
            "inter_token_latency_seconds (vLLM's example Grafana dashboard reads it)."))
        self._series: dict[str, _Series] = {}
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._failed = False

    def _series_for(self, name: str) -> _Series:
        with self._lock:
            series = self._series.get(name)
            if series is None:
                series = self._series[name] = _Series(self, name)
            return series

    def watch(self, engine: Engine) -> None:
        """Count every request `engine` finishes and every step it runs from now on (once
        per engine, however often it is watched). Its series appear at zero at once."""
        with self._lock:
            if engine in self._watched:
                return
            self._watched.add(engine)
            if self.sized is None:
                self.sized = _SizedHistograms(self.registry, self.prefix, engine.max_model_len,
                                              engine.config.max_num_batched_tokens)
        series = self._series_for(self.model_name or engine.loaded.name)
        if engine.config.speculative is not None:  # vLLM's: every position, from zero
            for i in range(engine.config.num_speculative_tokens):
                series.accepted_at(i)
        engine.add_finish_listener(lambda out: self._safely(series.record, out))
        engine.add_step_listener(lambda step: self._safely(series.record_step, step))

    def _safely(self, record: Callable[[Any], None], item: Any) -> None:
        """Run a listener's work (engine thread): cheap, and never raises."""
        try:
            record(item)
        except Exception:
            if not self._failed:  # say it once, not once per request
                self._failed = True
                log.exception("metrics: a finished request or a step could not be recorded")

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
