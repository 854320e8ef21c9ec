"""The hardware page (AppTest, run on its own: no model, no shared engine) and its chart
builders (`chart.to_dict()`): every figure shown equals `measure.hardware`'s."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from apptest import metric, pick
from streamlit.testing.v1 import AppTest

from engine.memory.budget import GIB
from measure.calibrate import Calibration
from measure.hardware import (
    HARDWARE,
    compute_bound_batch,
    decode_tokens_per_s,
    fits,
    local_vs_datacenter_table,
    max_batch,
    model_size_table,
    prefill_seconds,
    response_seconds,
    this_machine_profile,
)
from ui import hardware_charts as charts
from ui import hardware_view as view

PAGE = str(Path(__file__).resolve().parents[2] / "pages" / "hardware.py")
UNITS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def page(**picks) -> AppTest:
    """The page, run once, then once more with the widgets (by key) set to `picks`."""
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    return pick(at, **picks) if picks else at


def number(text: str) -> float:
    return float(text.replace(",", ""))


def seconds(text: str) -> float:
    value, unit = text.split()
    return number(value) * UNITS[unit]


def records(df: pd.DataFrame) -> list[dict]:
    """Rows as plain Python values: lists for list cells, None for missing ones."""
    def plain(v):
        if hasattr(v, "tolist"):
            return v.tolist()
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v
    return [{k: plain(v) for k, v in row.items()} for row in df.to_dict("records")]


# ---- the page --------------------------------------------------------------------------
def shown(table: list[dict]) -> list[dict]:
    """`local_vs_datacenter_table` as the page shows it: no bound where batch 64 won't fit
    reads "does not fit"."""
    return [{**r, "bound_big_batch": r["bound_big_batch"] or "does not fit"} for r in table]


def test_reference_tables_equal_the_functions():
    at = page()
    assert records(at.dataframe[0].value) == model_size_table("fp16", 2048)
    table = local_vs_datacenter_table("llama-3-8b", "fp16", 2048)
    assert records(at.dataframe[1].value) == shown(table)
    # an RTX 4090 holds batch 36 of Llama-3-8B at 2,048 tokens, not 64
    row = next(r for r in records(at.dataframe[1].value) if r["key"] == "rtx4090")
    assert row["bound_big_batch"] == "does not fit" and row["max_batch"] < 64
    # a long context changes where models fit, so the tables must follow the inputs
    assert model_size_table("int4", 65536) != model_size_table("int4", 2048)
    at = page(hw_model="llama-2-7b", hw_precision="int4", hw_context=65536)
    assert records(at.dataframe[0].value) == model_size_table("int4", 65536)
    assert records(at.dataframe[1].value) == shown(local_vs_datacenter_table("llama-2-7b",
                                                                             "int4", 65536))
    assert "4,096 tokens" in at.warning[0].value  # beyond Llama-2-7B's native context


def test_70b_fp16_on_rtx4090_does_not_fit_and_is_offload_bound():
    at = page(hw_model="llama-2-70b", hw_precision="fp16", hw_hardware="rtx4090")
    assert not at.success and len(at.error) == 1
    verdict = at.error[0].value
    assert verdict.startswith("Does not fit") and "Offload-bound" in verdict
    assert metric(at, "Fits in 24 GiB") == "No"
    assert metric(at, "Bound by") == "offload"
    at = page(hw_model="llama-2-70b", hw_precision="int4", hw_hardware="h100")
    assert not at.error and at.success[0].value.startswith("Fits")
    assert metric(at, "Fits in 80 GiB") == "Yes" and metric(at, "Bound by") == "memory"


def test_metrics_equal_the_projection_functions():
    model, prec, hw, ctx, batch, answer = "llama-3-8b", "int8", "h100", 4096, 64, 1024
    at = page(hw_model=model, hw_precision=prec, hw_hardware=hw, hw_context=ctx,
              hw_batch=batch, hw_answer=answer)
    p = decode_tokens_per_s(model, prec, hw, batch, ctx)
    report = fits(model, prec, hw, ctx, batch)
    approx = pytest.approx
    assert number(metric(at, "Tokens/s per user")) == approx(p.per_user, rel=5e-3)
    assert number(metric(at, f"Tokens/s total at batch {batch}")) == approx(p.total, rel=5e-3)
    assert metric(at, "Bound by") == p.bound
    assert number(metric(at, "Compute-bound batch B*")) == approx(compute_bound_batch(hw),
                                                                  rel=5e-3)
    assert number(metric(at, "Needs (GiB)")) == approx(report.total_bytes / GIB,
                                                              rel=5e-3)
    assert int(metric(at, "Max batch")) == max_batch(model, prec, hw, ctx)
    assert seconds(metric(at, "Prefill (TTFT)")) == approx(
        prefill_seconds(model, prec, hw, ctx), rel=5e-3)
    assert seconds(metric(at, "Response")) == approx(
        response_seconds(model, prec, hw, ctx, answer, batch), rel=5e-3)
    assert HARDWARE[hw].source in at.caption[1].value  # the datasheet is cited
    assert len(at.get("vega_lite_chart")) == 2 and len(at.latex) == 3


def test_this_machine_is_measured_once_and_projected(monkeypatch):
    calls = []
    fake = Calibration("cpu", "Test CPU, 2 threads", bandwidth_gbs=20.0, tflops=0.5,
                       tflops_by_dtype={"float32": 0.25, "bfloat16": 0.5}, memory_gb=16.0,
                       memory_available_gb=12.0, threads=2, seconds=2.0)

    def calibrate(seconds: float, device: str) -> Calibration:
        calls.append((seconds, device))
        return fake

    monkeypatch.setattr(view, "calibrate", calibrate)
    view.this_machine.clear()
    try:
        at = page(hw_model="llama-3-8b", hw_precision="int4", hw_hardware="this_machine:cpu")
        at.select_slider(key="hw_batch").set_value(4).run()
    finally:
        view.this_machine.clear()
    assert calls == [(2.0, "cpu")]
    hw = this_machine_profile(fake)
    p = decode_tokens_per_s("llama-3-8b", "int4", hw, 4, 2048)
    assert number(metric(at, "Tokens/s per user")) == pytest.approx(p.per_user, rel=5e-3)
    assert metric(at, "Fits in 12 GiB") == "Yes"
    assert metric(at, "Measured bandwidth (GB/s)") == "20.0"
    assert "Test CPU, 2 threads" in at.caption[1].value
    assert "measured by measure.calibrate" in at.caption[1].value


# ---- chart builders and frames (no Streamlit) -----------------------------------------
def layers(vega: dict) -> dict[str, list[dict]]:
    """The rows drawn by each mark type, over all layers of that type."""
    out: dict[str, list[dict]] = {}
    for layer in vega["layer"]:
        mark = layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"]
        out.setdefault(mark, []).extend(vega["datasets"][layer["data"]["name"]])
    return out


def choice(model: str, prec: str, hw: str, ctx: int = 2048, batch: int = 1) -> view.Choice:
    return view.Choice(view.MODELS[model], prec, HARDWARE[hw], ctx, batch)


def test_decode_chart_marks_b_star_at_compute_bound_batch():
    c = choice("llama-3-8b", "fp16", "rtx4090")
    vega = charts.decode_chart(view.decode_frame(c), compute_bound_batch("rtx4090")).to_dict()
    rows = layers(vega)
    assert [r["batch"] for r in rows["rule"]] == [compute_bound_batch("rtx4090")]
    b_star = f"B* ≈ {compute_bound_batch('rtx4090'):.0f}: compute-bound →"
    assert b_star in [r["label"] for r in rows["text"]]
    x = vega["layer"][2]["encoding"]["x"]
    assert x["scale"]["type"] == "log" and x["scale"]["domain"] == [1, 1024]
    line = rows["line"]
    assert {r["series"] for r in line} == {"per user", "total"}
    at_8 = {r["series"]: r["tokens_per_s"] for r in line if r["batch"] == 8}
    p = decode_tokens_per_s("llama-3-8b", "fp16", "rtx4090", 8, 2048)
    assert at_8 == {"per user": p.per_user, "total": p.total}


def test_decode_chart_shades_the_offload_bound_batches():
    vega = charts.decode_chart(view.decode_frame(choice("llama-2-70b", "fp16", "rtx4090")),
                               164.0).to_dict()
    assert layers(vega)["rect"] == [{"start": 1, "end": 1024,
                                     "label": "offload-bound: does not fit"}]
    frame = view.decode_frame(choice("llama-3-8b", "fp16", "h100"))
    first_beyond = min(b for b in view.BATCH_GRID if b > max_batch("llama-3-8b", "fp16",
                                                                   "h100", 2048))
    assert charts.offload_regions(frame).to_dict("records") == [{"start": first_beyond,
                                                                 "end": 1024}]
    small = view.decode_frame(choice("smollm2-135m", "fp16", "h100"))
    vega = charts.decode_chart(small, compute_bound_batch("h100")).to_dict()
    assert layers(vega)["rect"] == []


def test_decode_frame_covers_batch_1_to_1024():
    assert view.BATCH_GRID[0] == 1 and view.BATCH_GRID[-1] == 1024
    assert set(view.BATCHES) <= set(view.BATCH_GRID)
    frame = view.decode_frame(choice("llama-3-8b", "int4", "m2_max", 1024))
    total = frame[frame.series == "total"].set_index("batch")["tokens_per_s"]
    assert total[1024] == decode_tokens_per_s("llama-3-8b", "int4", "m2_max", 1024, 1024).total


def test_fit_chart_stacks_weights_and_kv_against_device_memory():
    report = fits("llama-2-70b", "fp16", "rtx4090", 2048, 4)
    vega = charts.fit_chart(view.fit_frame(report), 24.0, "RTX 4090 24 GB").to_dict()
    rows = layers(vega)
    assert [(r["part"], r["gib"]) for r in rows["bar"]] == [
        ("weights", report.weights_bytes / GIB), ("KV cache", report.kv_bytes / GIB)]
    assert vega["layer"][0]["encoding"]["x"]["stack"] == "zero"
    assert [r["gib"] for r in rows["rule"]] == [24.0]
    assert rows["text"][0]["label"] == "RTX 4090 24 GB: 24 GiB"
