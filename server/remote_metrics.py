"""Live state of a remote server from its Prometheus /metrics: running and waiting
requests and KV-cache usage, in whichever family of names the server exports.

    family     running                       waiting                       KV usage (0-1)
    vllm       vllm:num_requests_running     vllm:num_requests_waiting     vllm:kv_cache_usage_perc
                                                                           (older: gpu_cache_usage_perc)
    sglang     sglang:num_running_reqs       sglang:num_queue_reqs         sglang:token_usage
    llamacpp   llamacpp:requests_processing  llamacpp:requests_deferred    llamacpp:kv_cache_usage_ratio
    batchlens  batchlens:num_requests_running  batchlens:num_requests_waiting  batchlens:kv_cache_usage_perc

A family counts when the server exports both its running and its waiting gauge; its KV
usage is optional (None when absent). The counts are summed over label sets (several
models, vLLM's data-parallel engines); the KV usage, a fraction of each pool, is their
mean, so two half-full pools read 0.5, not 1.0. A server exporting none of these (Ollama,
or SGLang without `--enable-metrics`, llama.cpp without `--metrics`) gives None: "not
exported by this server".

The text is read line by line and a line that does not parse is skipped, so one odd
series (an exotic label value, a newer exposition feature) never hides the rest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx

# family -> (running, waiting, KV-usage names in order of preference)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 ("llamacpp:kv_cache_usage_ratio",)),
    "batchlens": ("batchlens:num_requests_running", "batchlens:num_requests_waiting",
                  ("batchlens:kv_cache_usage_perc",)),
}
NOT_EXPORTED = "not exported by this server"

# `name{labels} value [timestamp]`; label values may hold spaces and braces, so the label
# block runs to the last `}` on the line
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")


@dataclass(frozen=True)
class ServerState:
    """One reading of a server's own gauges: requests running (in its batch) and waiting
    (queued), KV-cache usage as a fraction (None when not exported), and the family of
    names it came from ("vllm", "sglang", "llamacpp", "batchlens")."""

    running: float
    waiting: float
    kv_usage: float | None
    source: str


@dataclass(frozen=True)
class StateSample:
    """One reading of a server's state and when it was taken (`time.monotonic()`)."""

    time: float
    state: ServerState


def samples(text: str) -> dict[str, list[float]]:
    """Every sample's value by metric name (one entry per label set); comments, blank and
    unparsable lines are skipped."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append(value)
    return out


def parse_server_state(text: str) -> ServerState | None:
    """The server's running / waiting / KV usage from Prometheus text, in the first family
    of `FAMILIES` it exports; None when it exports none."""
    found = samples(text)
    for source, (running, waiting, kv_names) in FAMILIES.items():
        if running not in found or waiting not in found:
            continue
        kv = next((_mean(found[n]) for n in kv_names if n in found), None)
        return ServerState(_sum(found[running]), _sum(found[waiting]), kv, source)
    return None


def state_from_response(resp: httpx.Response) -> ServerState | None:
    """The state in a /metrics answer; None for any status but 200 (404: no /metrics)."""
    if resp.status_code != 200:
        return None
    return parse_server_state(resp.text)


def fetch_server_state(client: httpx.Client, metrics_url: str) -> ServerState | None:
    """GET `metrics_url` and parse it; None when the server has no /metrics, exports none
    of the known names, or cannot be reached (metrics are best effort: the requests
    themselves say when an endpoint is down)."""
    try:
        resp = client.get(metrics_url)
    except httpx.HTTPError:
        return None
    return state_from_response(resp)


def metrics_url(base_url: str) -> str:
    """The /metrics URL of an OpenAI-compatible server from its /v1 base URL."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") + "/metrics"


def _sum(values: list[float]) -> float:
    return math.fsum(v for v in values if not math.isnan(v))


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if not math.isnan(v)]
    return math.fsum(vals) / len(vals) if vals else None
