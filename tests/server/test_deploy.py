"""deploy/: the Grafana dashboard queries only series the exporter exports, and the
Prometheus config scrapes the dashboard's and `batchlens serve`'s /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import StandInEngine, serving_stats

from server.cli import build_parser
from server.metrics import ServerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_NAME = re.compile(r"batchlens:[A-Za-z0-9_:]+")
# a sample's suffix -> the family type that has such samples
SUFFIX_TYPES = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram",
                "_total": "counter"}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "batchlens.json").read_text())


def panels(items: list[dict]) -> list[dict]:
    """Every panel, those inside rows included."""
    return [p for item in items for p in [item, *panels(item.get("panels", []))]]


def exprs() -> list[str]:
    return [t["expr"] for p in panels(dashboard()["panels"]) for t in p.get("targets", [])]


def exported_families(prefix: str = "batchlens") -> dict[str, str]:
    """Family name -> type, of everything a watched engine's exporter renders."""
    engine = StandInEngine(stats=serving_stats(running=1, waiting=1, used_blocks=1))
    metrics = ServerMetrics(lambda: engine, prefix=prefix)
    metrics.watch(engine)
    body, _ = metrics.render()
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


def family_of(sample: str, families: dict[str, str]) -> tuple[str, str]:
    """The family a queried sample name belongs to, and the type it needs that family to
    have: `x_bucket` needs a histogram `x`, `x_total` a counter `x` (a histogram named
    `iteration_tokens_total` has `..._total_bucket` samples, never a bare `..._total`),
    any other name a gauge of that name."""
    for suffix, kind in SUFFIX_TYPES.items():
        if sample.endswith(suffix) and sample.removesuffix(suffix) in families:
            return sample.removesuffix(suffix), kind
    return sample, "gauge"


def test_every_metric_the_dashboard_queries_is_exported_with_its_type():
    families = exported_families()
    queried = {name for expr in exprs() for name in METRIC_NAME.findall(expr)}
    assert len(queried) >= 20
    for sample in sorted(queried):
        family, kind = family_of(sample, families)
        assert families.get(family) == kind, f"{sample}: no {kind} {family} exported"


@pytest.mark.parametrize("needle", [
    "generation_tokens_total", "prompt_tokens_total", "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_hits_total", "num_preemptions_total",
    "spec_decode_num_accepted_tokens_total", "iteration_tokens_total_bucket"])
def test_the_dashboard_has_the_panels_it_promises(needle):
    assert any("batchlens:" + needle in expr for expr in exprs())


def test_the_dashboard_takes_its_datasource_from_a_variable():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in panels(board["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    ids = [p["id"] for p in panels(board["panels"])]
    assert len(ids) == len(set(ids))
    for expr in exprs():  # histogram_quantile over a rate of buckets, by le
        if "histogram_quantile" in expr:
            assert "sum by (le) (rate(" in expr and "_bucket" in expr, expr


def test_prometheus_scrapes_the_dashboard_and_batchlens_serve():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    serve_port = build_parser("batchlens serve").parse_args([]).port
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for job in jobs.values() for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"localhost:8501", f"localhost:{serve_port}"}
    assert {job["metrics_path"] for job in jobs.values()} == {"/metrics"}


# the series vLLM's example dashboard queries
# (examples/online_serving/prometheus_grafana/grafana.json at vLLM commit 004f771f)
VLLM_DASHBOARD = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "gpu_cache_usage_perc",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum")


def test_with_the_vllm_prefix_vllms_own_dashboard_finds_every_series_it_queries():
    families = exported_families("vllm")
    for sample in VLLM_DASHBOARD:
        family, kind = family_of("vllm:" + sample, families)
        assert families.get(family) == kind, f"{sample}: no {kind} {family} exported"
