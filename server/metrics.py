"""Prometheus metrics of the shared engine, under vLLM's names with our own prefix.

Every name is vLLM's (`vllm/v1/metrics/loggers.py`) with `batchlens:` in place of
`vllm:`, labelled `model_name`, so a vLLM Grafana dashboard works after a prefix swap:

- gauges read from the current engine's `stats()` at scrape time: `num_requests_running`,
  `num_requests_waiting`, `kv_cache_usage_perc` (used blocks / blocks, 0-1);
- counters fed by each watched engine's finish listener, so every request counts (a
  browser's, the API's, a workload's) and the totals survive an engine rebuild:
  `prompt_tokens_total`, `generation_tokens_total`, `prefix_cache_queries_total` and
  `prefix_cache_hits_total` (tokens), `num_preemptions_total`,
  `request_success_total{finished_reason}`, and speculative decoding's
  `spec_decode_num_drafts_total` (verification steps with drafts),
  `spec_decode_num_draft_tokens_total` and `spec_decode_num_accepted_tokens_total`
  (vllm/v1/spec_decode/metrics.py; zero while speculation is off);
- histograms, with vLLM's bucket lists, fed by the same listener:
  `time_to_first_token_seconds`, `inter_token_latency_seconds` (every gap between two
  output tokens), `e2e_request_latency_seconds`, `request_queue_time_seconds`.

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
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine import Engine
    from engine.outputs import RequestOutput

PREFIX = "batchlens:"
LABEL = "model_name"

# vLLM's bucket lists (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# our finish reason -> vLLM's `finished_reason` label
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}

log = logging.getLogger(__name__)


class _Series:
    """The counters' and histograms' children for one model name (looked up once, so the
    finish listener does no label lookups)."""

    def __init__(self, m: ServerMetrics, name: str) -> None:
        self.prompt_tokens = m.prompt_tokens.labels(name)
        self.generation_tokens = m.generation_tokens.labels(name)
        self.prefix_queries = m.prefix_queries.labels(name)
        self.prefix_hits = m.prefix_hits.labels(name)
        self.preemptions = m.preemptions.labels(name)
        self.spec_drafts = m.spec_drafts.labels(name)
        self.spec_draft_tokens = m.spec_draft_tokens.labels(name)
        self.spec_accepted_tokens = m.spec_accepted_tokens.labels(name)
        self.success = {label: m.request_success.labels(name, label)
                        for label in dict.fromkeys(FINISHED_REASONS.values())}
        self.ttft = m.ttft.labels(name)
        self.itl = m.itl.labels(name)
        self.e2e = m.e2e.labels(name)
        self.queue_time = m.queue_time.labels(name)

    def record(self, out: RequestOutput) -> None:
        m = out.metrics
        self.success[FINISHED_REASONS.get(out.finish_reason, "error")].inc()
        self.generation_tokens.inc(len(out.token_ids))
        self.preemptions.inc(out.num_preemptions)
        if out.num_drafts:
            self.spec_drafts.inc(out.num_drafts)
            self.spec_draft_tokens.inc(out.num_draft_tokens)
            self.spec_accepted_tokens.inc(out.num_accepted_tokens)
        if m.queue_time is not None:  # scheduled: prefilled and looked up
            n_prompt = len(out.prompt_token_ids)
            self.prompt_tokens.inc(n_prompt)
            self.prefix_queries.inc(n_prompt)
            self.prefix_hits.inc(min(out.num_cached_tokens, n_prompt))
            self.queue_time.observe(m.queue_time)
        if m.token_times:
            self.ttft.observe(m.ttft)
            self.e2e.observe(m.e2e)
            for gap in m.itls:
                self.itl.observe(gap)
        elif m.finish_time is not None:  # ended without a token: its whole life
            self.e2e.observe(m.finish_time - m.arrival_time)


class _EngineGauges(Collector):
    """Running, waiting and KV usage of the current engine, read at each scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = [
            GaugeMetricFamily(PREFIX + "num_requests_running",
                              "Number of requests in model execution batches.", labels=[LABEL]),
            GaugeMetricFamily(PREFIX + "num_requests_waiting",
                              "Number of requests waiting to be processed.", labels=[LABEL]),
            GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.", labels=[LABEL]),
        ]
        try:
            engine = self._metrics.get_engine()
            stats = engine.stats(steps_after=None)  # no step records: only the counts
            name = self._metrics.model_name or engine.loaded.name
        except Exception:  # no engine yet, or one being rebuilt: no samples this scrape
            log.debug("metrics: no engine to read", exc_info=True)
        else:
            usage = stats.kv.usage if stats.kv is not None else 0.0
            for family, value in zip(families, (stats.num_running, stats.num_waiting, usage),
                                     strict=True):
                family.add_metric([name], value)
        yield from families


class ServerMetrics:
    """The /metrics exporter: `watch` every engine built, `render` on each scrape.

    `get_engine` returns the current engine (settings may rebuild it); `model_name`, if
    given, labels every series, else each engine's `loaded.name` does. Each instance has
    its own `CollectorRegistry` unless one is passed, so several never collide.
    """

    def __init__(
        self,
        get_engine: Callable[[], Engine],
        model_name: str | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.get_engine = get_engine
        self.model_name = model_name
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        labels = [LABEL]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=reg)
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", labels, registry=reg)
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.", labels, registry=reg)
        self.preemptions = Counter(PREFIX + "num_preemptions",
                                   "Cumulative number of preemption from the engine.", labels,
                                   registry=reg)
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts",
                                   "Number of spec decoding drafts.", labels, registry=reg)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens",
                                         "Number of draft tokens.", labels, registry=reg)
        self.spec_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens",
                                            "Number of accepted tokens.", labels, registry=reg)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Count of successfully processed requests.",
                                       [LABEL, "finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              registry=reg, buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             registry=reg, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels,
                             registry=reg, buckets=REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    labels, registry=reg, buckets=REQUEST_LATENCY_BUCKETS)
        reg.register(_EngineGauges(self))
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
        """Count every request `engine` finishes from now on (once per engine, however
        often it is watched). Its series appear at zero at once."""
        with self._lock:
            if engine in self._watched:
                return
            self._watched.add(engine)
        series = self._series_for(self.model_name or engine.loaded.name)
        engine.add_finish_listener(lambda out: self._record(series, out))

    def _record(self, series: _Series, out: RequestOutput) -> None:
        """The finish listener (engine thread): cheap, and never raises."""
        try:
            series.record(out)
        except Exception:
            if not self._failed:  # say it once, not once per request
                self._failed = True
                log.exception("metrics: a finished request could not be recorded")

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
