"""HTTP load generator for any OpenAI-compatible server, measured as `vllm bench serve` does.

    batchlens bench serve [--base-url URL] [--model NAME] [--endpoint completions|chat]
        [--num-prompts N] [--max-concurrency N] [--request-rate R] [--burstiness B]
        [--dataset bundled|random|bench-mix] [--max-tokens N] [--ignore-eos]
        [--goodput ttft:MS tpot:MS] [--json PATH]

Requests arrive at seeded gamma-distributed gaps (mean 1 / rate, shape `burstiness`: 1 is
Poisson, below 1 burstier; rate `inf` sends every request at t=0), at most
`max_concurrency` in flight. Each streams (`stream_options.include_usage`) through
`server.stream_client`, the one streaming client the remote serving side
(`server.remote.RemoteSide`) uses too; on arrival of each chunk with content it stamps
`time.monotonic()`:

- TTFT: request sent -> first content chunk; E2E: -> last content chunk;
- ITL: every gap between two content chunks;
- TPOT: (E2E - TTFT) / (tokens - 1), tokens from the stream's usage chunk, or the number
  of content chunks when the server sends no usage (llama.cpp's server);
- goodput: requests meeting every SLO per second of the run.

Per-request metrics come from `engine.metrics` (one definition of each). When the server
exports Prometheus histograms of TTFT and inter-token latency under vLLM's names (any
prefix: `vllm:`, `sglang:`, `batchlens:`), /metrics is scraped before and after the run and
the server's own means are printed beside the client's. `run_load` is the core, usable
from other code; `main` is the command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.config import SamplingParams
from engine.metrics import RequestMetrics, goodput, percentile, summarize
from measure.bench.requests import (
    MIX_MAX_TOKENS,
    MIX_PROMPT_LEN,
    BenchRequest,
    make_requests,
    tokenize_corpus,
)
from server import stream_client
from server.connections import async_client
from server.remote_metrics import metrics_url, samples
from server.stream_client import StreamError, StreamRecord, http_failure, transport_failure

PROG = "batchlens bench serve"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "OPENAI_API_KEY"
ENDPOINTS = {api: f"/v1/{path}" for api, path in stream_client.APIS.items()}
DATASETS = ("bundled", "random", "bench-mix")
SLO_KEYS = ("ttft", "tpot")
TIMEOUT_S = 300.0
PERCENTILES = (50, 90, 99)
# Prometheus histograms whose sum / count give the server's means, by suffix (any prefix)
# (older vLLM and SGLang call the inter-token one time_per_output_token_seconds)
SERVER_HISTOGRAMS = {"ttft": ("time_to_first_token_seconds",),
                     "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
                     "e2e": ("e2e_request_latency_seconds",)}


class EndpointError(RuntimeError):
    """The endpoint cannot be used (unreachable, 401, 404, ...); the message names it."""


# ---- requests and their results --------------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    """One request: a text prompt (or token ids, completions only) and its output cap;
    `prompt_len` is the prompt's length in tokens when known here."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    prompt_len: int | None = None


WARMUP = LoadRequest("Hello", 4)


@dataclass
class RequestResult:
    """One request as the client saw it: when it was sent, when each content chunk came,
    the token counts (the server's usage, else chunks and our own prompt count)."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    def metrics(self) -> RequestMetrics:
        """One time per output token: the chunks' times, the last one standing for tokens
        that came without a chunk of their own (TTFT, E2E and TPOT stay exact)."""
        times = list(self.chunk_times)
        times += [times[-1]] * max(0, self.output_tokens - len(times))
        return RequestMetrics(arrival_time=self.start, token_times=times[:self.output_tokens])

    def chunk_metrics(self) -> RequestMetrics:
        """The chunks' own times: their gaps are the ITLs."""
        return RequestMetrics(arrival_time=self.start, token_times=list(self.chunk_times))


@dataclass
class LoadResult:
    """A whole run: every request's result in request order and the run's duration
    (first scheduled arrival -> last request done)."""

    base_url: str
    model: str
    endpoint: str
    results: list[RequestResult]
    duration: float
    server_before: dict[str, tuple[float, float]] | None = None
    server_after: dict[str, tuple[float, float]] | None = None

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]


# ---- the endpoint ------------------------------------------------------------------------
def api_root(base_url: str) -> str:
    """The server's root from its root or its /v1 URL."""
    url = base_url.strip().rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _key_hint(message: str) -> str:
    """A 401's message with where the key goes."""
    if " unauthorized: " in message:
        return f"{message}; pass --api-key or set ${API_KEY_ENV}"
    return message


def list_models(base_url: str, api_key: str | None = None,
                timeout: float = 30.0) -> list[str]:
    """The model ids of GET /v1/models; `EndpointError` naming the URL when it fails."""
    url = f"{api_root(base_url)}/v1/models"
    try:
        resp = httpx.get(url, headers=headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {transport_failure(exc, timeout)}") from None
    if resp.status_code != 200:
        what = http_failure(resp.status_code, resp.content, "GET /v1/models",
                            keyed=bool(api_key), where=api_root(base_url))
        raise EndpointError(f"{url}: {_key_hint(what)}")
    try:
        return [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{url}: not an OpenAI model list: {resp.text[:200]!r}") from None


def scrape_server_metrics(base_url: str, api_key: str | None = None,
                          timeout: float = 10.0) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of the server's TTFT, ITL and E2E histograms (summed over label sets)
    from /metrics; None when it exports none of them."""
    try:
        resp = httpx.get(metrics_url(base_url), headers=headers(api_key), timeout=timeout)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found = samples(resp.text)
    out: dict[str, tuple[float, float]] = {}
    for key, suffixes in SERVER_HISTOGRAMS.items():
        for name in (n.removesuffix("_sum") for n in found if n.endswith("_sum")):
            if name.endswith(suffixes) and name + "_count" in found:
                out[key] = (math.fsum(found[name + "_sum"]), math.fsum(found[name + "_count"]))
                break
    return out or None


def server_means(before: dict[str, tuple[float, float]] | None,
                 after: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """The server's mean of each histogram over what it observed between two scrapes."""
    if not before or not after:
        return {}
    means = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            means[key] = (total - t0) / (count - c0)
    return means


# ---- one streamed request ------------------------------------------------------------------
def request_body(model: str, req: LoadRequest, endpoint: str, ignore_eos: bool,
                 temperature: float) -> dict[str, Any]:
    """The body the remote serving side would send for the same prompt and settings
    (`server.stream_client.request_body`); `ValueError` naming the prompt when the
    endpoint cannot take it (token ids on the chat endpoint)."""
    params = SamplingParams(max_tokens=req.max_tokens, temperature=temperature,
                            ignore_eos=ignore_eos)
    prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    return stream_client.request_body(model, endpoint, prompt, params)


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         prompt_len: int | None = None, timeout: float = TIMEOUT_S,
                         keyed: bool = False) -> RequestResult:
    """POST one streaming request to `url` with `server.stream_client.stream`; never
    raises: a failure is the result's `error`, naming `url`."""
    res = RequestResult(start=time.monotonic(), prompt_tokens=prompt_len or 0)
    record = StreamRecord(chunk_times=res.chunk_times)
    try:
        await stream_client.stream(client, url, body, record, timeout=timeout, keyed=keyed,
                                   where=url.rpartition("/v1/")[0] + "/v1")
    except StreamError as exc:
        res.error = f"{url}: {_key_hint(str(exc))}"
    except Exception as exc:  # a bug must fail this request only
        res.error = f"{url}: {type(exc).__name__}: {exc}"
    res.text = record.text
    res.output_tokens = record.output_tokens
    res.prompt_tokens = record.prompt_tokens or res.prompt_tokens
    if res.error is None and not res.chunk_times:
        res.error = f"{url}: the stream ended without any content"
        if record.finish_reason is not None:  # the model's own end: say what helps
            res.error += f" (finish_reason {record.finish_reason!r})"
            if not url.endswith(ENDPOINTS["chat"]):
                res.error += ("; an instruct model given a bare prompt often ends at once: "
                              "--endpoint chat or --ignore-eos makes it answer")
    return res


# ---- arrivals and the run --------------------------------------------------------------------
def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: the first at 0, then
    gaps drawn from a gamma distribution of shape `burstiness` and mean 1 / `rate` (shape 1:
    Poisson arrivals; below 1 burstier, above 1 more even); rate inf: all at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run_load_async(
    base_url: str, model: str, requests: Sequence[LoadRequest], rate: float = math.inf,
    burstiness: float = 1.0, max_concurrency: int | None = None, *,
    endpoint: str = "completions", api_key: str | None = None, ignore_eos: bool = False,
    temperature: float = 0.0, seed: int = 0, timeout: float = TIMEOUT_S,
    warmup: bool = True, server_metrics: bool = False,
    on_result: Callable[[RequestResult], None] | None = None,
) -> LoadResult:
    """Send `requests` at the arrival times, at most `max_concurrency` at once (None: no
    limit), over one connection pool. `warmup`: first a short request alone (a prompt of
    its own, so no request of the run finds it cached), which must succeed
    (`EndpointError` with its message otherwise) and is not counted.
    `server_metrics`: scrape /metrics before and after (after the warm-up)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    root = api_root(base_url)
    url = root + ENDPOINTS[endpoint]
    bodies = [request_body(model, r, endpoint, ignore_eos, temperature) for r in requests]
    delays = arrival_times(len(requests), rate, burstiness, seed)
    pool = max(1, min(max_concurrency or len(requests), len(requests)))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    scrape = (lambda: scrape_server_metrics(root, api_key)) if server_metrics else None

    async def one(i: int, t0: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + delays[i] - time.monotonic()))
        async with gate or contextlib.nullcontext():
            res = await stream_request(client, url, bodies[i], requests[i].prompt_len, timeout,
                                       keyed=bool(api_key))
        if on_result is not None:
            on_result(res)
        return res

    async with async_client(timeout=timeout, max_connections=pool,
                            max_keepalive_connections=pool, headers=headers(api_key)) as client:
        if warmup and requests:
            body = request_body(model, WARMUP, endpoint, ignore_eos, temperature)
            test = await stream_request(client, url, body, timeout=timeout,
                                        keyed=bool(api_key))
            if not test.ok:
                raise EndpointError(test.error or f"{url}: no content")
        before = await asyncio.to_thread(scrape) if scrape else None
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(i, t0) for i in range(len(requests))))
        duration = time.monotonic() - t0
        after = await asyncio.to_thread(scrape) if scrape else None
    return LoadResult(root, model, endpoint, list(results), duration, before, after)


def run_load(base_url: str, model: str, requests: Sequence[LoadRequest],
             rate: float = math.inf, burstiness: float = 1.0,
             max_concurrency: int | None = None, **kwargs: Any) -> LoadResult:
    """`run_load_async` in a fresh event loop (call it from a thread without one)."""
    return asyncio.run(run_load_async(base_url, model, requests, rate, burstiness,
                                      max_concurrency, **kwargs))


# ---- the report ---------------------------------------------------------------------------
def _stats(values: Sequence[float | None]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds (NaN for no values)."""
    vals = [v for v in values if v is not None]
    out = {"mean": statistics.fmean(vals) * 1000 if vals else math.nan}
    out.update({f"p{q}": percentile(vals, q) * 1000 for q in PERCENTILES})
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def summarize_load(load: LoadResult, ttft_slo: float | None = None,
                   tpot_slo: float | None = None) -> dict[str, Any]:
    """The run's figures, as `vllm bench serve` reports them (latencies in ms, SLOs in
    seconds); failed requests count only as failures."""
    done = load.completed
    ms = [r.metrics() for r in done]
    multi = [m for m in ms if m.tpot is not None]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    dur = load.duration
    summary = summarize(ms, wall_time=dur)
    errors = Counter(r.error or "no content" for r in load.results if not r.ok)
    doc: dict[str, Any] = {
        "base_url": load.base_url, "model": load.model, "endpoint": load.endpoint,
        "completed": len(done), "failed": len(load.results) - len(done),
        "duration_s": dur, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": _ratio(len(done), dur),
        "output_throughput": summary.throughput,
        "total_token_throughput": _ratio(in_tokens + out_tokens, dur),
        "ttft_ms": _stats([m.ttft for m in ms]),
        "tpot_ms": _stats([m.tpot for m in ms]),
        # every request's E2E - TTFT over all its tokens but the first: the token-weighted
        # TPOT, what a server's inter-token histogram averages
        "tpot_token_weighted_ms": 1000 * _ratio(sum(m.e2e - m.ttft for m in multi),
                                                sum(len(m.token_times) - 1 for m in multi)),
        "itl_ms": _stats([g for r in done for g in r.chunk_metrics().itls]),
        "e2e_ms": _stats([m.e2e for m in ms]),
        "slo_s": {"ttft": ttft_slo, "tpot": tpot_slo},
        "goodput": (goodput(ms, dur, ttft_slo, tpot_slo)
                    if ttft_slo is not None or tpot_slo is not None else None),
        "errors": dict(errors.most_common(5)),
    }
    means = server_means(load.server_before, load.server_after)
    doc["server_means_ms"] = {k: v * 1000 for k, v in means.items()}
    return doc


def format_summary(doc: dict[str, Any]) -> str:
    """The figures as text: counts and throughputs, then mean/p50/p90/p99 per latency."""
    lines = [
        f"completed requests      {doc['completed']:>10}",
        f"failed requests         {doc['failed']:>10}",
        f"duration (s)            {doc['duration_s']:>10.2f}",
        f"input / output tokens   {doc['total_input_tokens']:>10} / {doc['total_output_tokens']}",
        f"request throughput      {doc['request_throughput']:>10.2f} req/s",
        f"output token throughput {doc['output_throughput']:>10.1f} tok/s",
        f"total token throughput  {doc['total_token_throughput']:>10.1f} tok/s",
    ]
    if doc["goodput"] is not None:
        slos = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in doc["slo_s"].items()
                         if v is not None)
        lines.append(f"goodput                 {doc['goodput']:>10.2f} req/s ({slos})")
    head = f"{'(ms)':<6}" + "".join(f"{c:>10}" for c in ("mean", "p50", "p90", "p99"))
    lines += ["", head, "-" * len(head)]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = doc[f"{name}_ms"]
        lines.append(f"{name.upper():<6}" + "".join(f"{s[k]:>10.1f}"
                                                    for k in ("mean", "p50", "p90", "p99")))
    server = doc.get("server_means_ms") or {}
    if server:
        lines.append("")
        pairs = (("ttft", "TTFT", doc["ttft_ms"]["mean"]),
                 ("itl", "TPOT", doc["tpot_ms"]["mean"]),
                 ("itl", "TPOT token-weighted", doc["tpot_token_weighted_ms"]),
                 ("itl", "ITL", doc["itl_ms"]["mean"]), ("e2e", "E2E", doc["e2e_ms"]["mean"]))
        for key, name, c in pairs:
            if key in server:
                lines.append(f"server /metrics mean {key.upper():<4} {server[key]:>9.1f} ms; "
                             f"client mean {name:<19} {c:>9.1f} ms "
                             f"({c / server[key] - 1:+.1%})")
        if doc["failed"]:  # the server's histograms count every request it answered
            lines.append(f"(the client's means leave out the {doc['failed']} failed "
                         f"requests; the server's count every request it answered)")
    for msg, n in doc["errors"].items():
        lines.append(f"error x{n}: {msg}")
    return "\n".join(lines)


# ---- datasets ---------------------------------------------------------------------------
def bundled_requests(n: int, max_tokens: int, seed: int = 0) -> list[LoadRequest]:
    """The bundled prompt set (assets/prompts.json, presets and the varied prompts),
    shuffled by `seed` and cycled to `n` requests."""
    from workloads.prompts import load_prompts

    sets = load_prompts()
    texts = [*sets.others, *sets.presets.values()]
    random.Random(seed).shuffle(texts)
    return [LoadRequest(texts[i % len(texts)], max_tokens) for i in range(n)]


def random_requests(vocab: Sequence[int], n: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[LoadRequest]:
    """`n` prompts of token ids drawn uniformly from `vocab`; lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)], as vLLM's random dataset."""
    if not vocab or input_len < 1 or output_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError("random dataset: need a vocabulary, lengths >= 1, 0 <= ratio < 1")
    rng = random.Random(seed)

    def length(x: int) -> int:
        return rng.randint(max(1, round(x * (1 - range_ratio))), round(x * (1 + range_ratio)))

    out = []
    for _ in range(n):
        ids = tuple(rng.choice(vocab) for _ in range(length(input_len)))
        out.append(LoadRequest(ids, length(output_len), len(ids)))
    return out


def bench_mix_requests(tokenizer: Any, n: int, seed: int = 0) -> list[LoadRequest]:
    """The in-process bench's request mix (`batchlens bench`, 64 by default) as ids."""
    return from_bench(make_requests(tokenize_corpus(tokenizer), n, seed, MIX_PROMPT_LEN,
                                    MIX_MAX_TOKENS))


def from_bench(reqs: Sequence[BenchRequest]) -> list[LoadRequest]:
    """The bench's requests (token ids, exact output lengths) as load requests."""
    return [LoadRequest(r.prompt_ids, r.max_tokens, len(r.prompt_ids)) for r in reqs]


def load_tokenizer(model: str | None) -> Any:
    """A local HF folder's or .gguf's tokenizer (None: the bundled model's)."""
    from engine.models import loader

    return loader.load_tokenizer(loader.hf_folder(loader.resolve_model(model)))


def build_requests(a: argparse.Namespace) -> list[LoadRequest]:
    """The dataset the flags ask for; token-id prompts become text for the chat endpoint."""
    if a.dataset == "bundled":
        return bundled_requests(a.num_prompts, a.max_tokens or 128, a.seed)
    tok = load_tokenizer(a.tokenizer)
    if a.dataset == "random":
        special = set(tok.all_special_ids)
        vocab = [i for i in range(len(tok)) if i not in special]
        reqs = random_requests(vocab, a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.seed)
    else:
        reqs = bench_mix_requests(tok, a.num_prompts, a.seed)
    if a.max_tokens:
        reqs = [LoadRequest(r.prompt, a.max_tokens, r.prompt_len) for r in reqs]
    if a.endpoint == "chat":
        reqs = [LoadRequest(tok.decode(list(r.prompt)), r.max_tokens, None) for r in reqs]
    return reqs


def _finite(obj: Any) -> Any:
    """`obj` with inf and NaN as None (JSON has neither)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ---- the command --------------------------------------------------------------------------
def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """`ttft:MS tpot:MS` -> {"ttft": seconds, "tpot": seconds}; ValueError naming a bad one."""
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if key not in SLO_KEYS or not ms > 0:
            raise ValueError(f"--goodput: expected {' or '.join(k + ':MS' for k in SLO_KEYS)}"
                             f" with MS > 0, got {item!r}")
        out[key] = ms / 1000
    return out


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=DEFAULT_BASE_URL,
                    help="the server's root or its /v1 URL (default: %(default)s)")
    ap.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", help=f"bearer key (default: ${API_KEY_ENV}, else none)")
    ap.add_argument("--endpoint", choices=tuple(ENDPOINTS),
                    help="default: chat for the bundled prompts (questions for an "
                    "assistant, which an instruct model given them bare often ends at "
                    "once), completions for the token-id datasets")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    ap.add_argument("--max-concurrency", type=int,
                    help="requests in flight at most (default: no limit)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second; inf sends all at t=0 (default: inf)")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier "
                    "(default: 1)")
    ap.add_argument("--dataset", choices=DATASETS, default="bundled",
                    help="bundled: the bundled prompt set (text); random: random token ids "
                    "of --random-input-len; bench-mix: `batchlens bench`'s request mix "
                    "(prompts 10-300 tokens, outputs 16-256) (default: bundled)")
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="random lengths vary within +-this share (default: 0)")
    ap.add_argument("--tokenizer", help="local HF folder or .gguf whose tokenizer makes the "
                    "random and bench-mix prompts (default: the bundled model's)")
    ap.add_argument("--max-tokens", type=int,
                    help="output tokens per request (default: bundled 128, random "
                    "--random-output-len, bench-mix its own lengths)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send vLLM's ignore_eos, so every request makes max_tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goodput", nargs="+", action="extend", default=[], metavar="KEY:MS",
                    help="SLOs for goodput: ttft:MS and/or tpot:MS")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S,
                    help="seconds without a byte before a request fails (default: %(default)s)")
    ap.add_argument("--no-server-metrics", action="store_true",
                    help="do not scrape the server's /metrics before and after")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return ap


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the load against the server and print (and optionally save) the figures."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    a.endpoint = a.endpoint or ("chat" if a.dataset == "bundled" else "completions")
    if a.num_prompts < 1 or (a.max_concurrency is not None and a.max_concurrency < 1):
        ap.error("--num-prompts and --max-concurrency must be >= 1")
    if not a.request_rate > 0 or not a.burstiness > 0:
        ap.error("--request-rate and --burstiness must be > 0")
    try:
        slos = parse_slos(a.goodput)
    except ValueError as exc:
        ap.error(str(exc))
    api_key = a.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        served = list_models(a.base_url, api_key)
        if not a.model and not served:
            raise EndpointError(f"{api_root(a.base_url)}/v1/models lists no model; "
                                "pass --model")
        model = a.model or served[0]
        if model not in served:
            print(f"warning: {model!r} is not among /v1/models ({', '.join(served)})",
                  file=sys.stderr)
        reqs = build_requests(a)
        print(f"{len(reqs)} requests ({a.dataset}, seed {a.seed}) to {model} at "
              f"{api_root(a.base_url)}{ENDPOINTS[a.endpoint]}; rate {a.request_rate:g}/s, "
              f"burstiness {a.burstiness:g}, max concurrency {a.max_concurrency or 'none'}",
              file=sys.stderr, flush=True)
        load = run_load(a.base_url, model, reqs, a.request_rate, a.burstiness,
                        a.max_concurrency, endpoint=a.endpoint, api_key=api_key,
                        ignore_eos=a.ignore_eos, temperature=a.temperature, seed=a.seed,
                        timeout=a.timeout, server_metrics=not a.no_server_metrics)
    except EndpointError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    doc = summarize_load(load, slos.get("ttft"), slos.get("tpot"))
    doc.update(dataset=a.dataset, num_prompts=a.num_prompts, request_rate=a.request_rate,
               burstiness=a.burstiness, max_concurrency=a.max_concurrency, seed=a.seed,
               ignore_eos=a.ignore_eos)
    print(format_summary(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(_finite(doc), indent=1))
    return 0 if doc["completed"] else 1

