"""Roofline figures the product rests on, and the calibration of this machine."""

from __future__ import annotations

import dataclasses

import pytest

from engine import compute
from measure import calibrate as calibrate_module
from measure import hardware as hwm
from measure.calibrate import Calibration, best_of, calibrate
from measure.hardware import (
    GB,
    HARDWARE,
    MODELS,
    aggregate_tokens_per_s,
    compute_bound_batch,
    decode_step_seconds,
    decode_tokens_per_s,
    fits,
    kv_bytes_per_token,
    local_vs_datacenter_table,
    model_size_table,
    prefill_seconds,
    response_seconds,
    seconds_for_tokens,
    this_machine_profile,
    weights_bytes,
)


@pytest.mark.parametrize(
    ("model", "expected_gb"), [("llama-2-7b", 14), ("llama-2-13b", 26), ("llama-2-70b", 140),
                               ("llama-3-70b", 140)])
def test_fp16_weight_sizes(model: str, expected_gb: float) -> None:
    assert weights_bytes(model, "fp16") / GB == pytest.approx(expected_gb, rel=0.05)


def test_precisions_scale_weights() -> None:
    fp16 = weights_bytes("llama-3-8b", "fp16")
    assert weights_bytes("llama-3-8b", "int8") == fp16 / 2
    assert weights_bytes("llama-3-8b", "int4") == fp16 / 4


def test_seconds_and_aggregate_throughput() -> None:
    assert seconds_for_tokens(600, 8) == pytest.approx(75)
    assert seconds_for_tokens(600, 60) == pytest.approx(10)
    assert aggregate_tokens_per_s(200, 20) == pytest.approx(4000)


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token("llama-3-8b") == 128 * 1024
    assert kv_bytes_per_token("smollm2-135m") == 22.5 * 1024
    assert kv_bytes_per_token("smollm2-135m", kv_bytes=4) == 45 * 1024
    assert kv_bytes_per_token("llama-2-7b") == 512 * 1024  # no GQA: 4x Llama-3-8B


@pytest.mark.parametrize(("hw", "b_star", "tol"), [("h100", 295, 2), ("h200", 206, 2),
                                                  ("rtx4090", 164, 2)])
def test_compute_bound_batch(hw: str, b_star: float, tol: float) -> None:
    assert compute_bound_batch(hw) == pytest.approx(b_star, abs=tol)


def test_70b_fp16_offloads_on_rtx4090() -> None:
    report = fits("llama-2-70b", "fp16", "rtx4090", context=1024)
    assert not report.fits and report.headroom_bytes < 0
    assert report.total_bytes == report.weights_bytes + report.kv_bytes
    offloaded = decode_tokens_per_s("llama-2-70b", "fp16", "rtx4090", 1, 1024)
    assert offloaded.bound == "offload"
    assert "offload" in offloaded.note
    # the same card with a model that fits (70B at int4 would not: 35 GB; take 8B int8)
    assert fits("llama-3-8b", "int8", "rtx4090", context=1024).fits
    fitting = decode_tokens_per_s("llama-3-8b", "int8", "rtx4090", 1, 1024)
    assert fitting.bound == "memory"
    assert offloaded.per_user < fitting.per_user / 10
    # and 70B that fits (on an H200) is far faster than the offloaded 4090 run
    assert decode_tokens_per_s("llama-2-70b", "fp16", "h200", 1, 1024).per_user > \
        20 * offloaded.per_user
    # offload time: resident part at memory bandwidth, the rest over PCIe; the untied
    # embedding table stays resident and is only looked up, never read whole
    h, m = HARDWARE["rtx4090"], MODELS["llama-2-70b"]
    table = m.vocab_size * m.hidden_size * 2
    rest = report.total_bytes - h.memory_bytes
    expected = ((h.memory_bytes - table) / (h.bandwidth_gbs * GB)
                + rest / (h.offload_bandwidth_gbs * GB))
    assert offloaded.step_seconds == pytest.approx(expected)


def test_batch1_decode_is_bandwidth_over_weights() -> None:
    proj = decode_tokens_per_s("llama-2-7b", "fp16", "h100", batch=1, context=0)
    ceiling = 3350 * GB / weights_bytes("llama-2-7b", "fp16")
    assert proj.per_user == pytest.approx(ceiling, rel=0.10)
    assert proj.bound == "memory"
    assert proj.total == proj.per_user
    # with a context the KV read slows it a little but stays within 10% at 512 tokens
    with_kv = decode_tokens_per_s("llama-2-7b", "fp16", "h100", batch=1, context=512)
    assert with_kv.per_user < proj.per_user
    assert with_kv.per_user == pytest.approx(ceiling, rel=0.10)


@pytest.mark.parametrize("hw", ["h100", "h200", "rtx4090", "b200"])
def test_decode_turns_compute_bound_above_b_star(hw: str) -> None:
    b_star = compute_bound_batch(hw)
    below = decode_tokens_per_s("llama-3-8b", "fp16", hw, batch=int(b_star * 0.8), context=1)
    above = decode_tokens_per_s("llama-3-8b", "fp16", hw, batch=int(b_star * 1.2), context=1)
    assert below.bound == "memory"
    assert above.bound == "compute"
    assert "compute-bound" in above.note
    # memory-bound: step time barely grows with batch; compute-bound: it grows linearly
    assert above.total > below.total
    step1 = decode_step_seconds("llama-3-8b", "fp16", hw, batch=1, context=1)
    assert below.step_seconds == pytest.approx(step1, rel=0.01)
    twice = decode_step_seconds("llama-3-8b", "fp16", hw, batch=2 * above.batch, context=1)
    assert twice == pytest.approx(2 * above.step_seconds, rel=0.01)


def test_batching_multiplies_total_throughput_on_h100() -> None:
    one = decode_tokens_per_s("llama-3-8b", "fp16", "h100", batch=1, context=2048)
    many = decode_tokens_per_s("llama-3-8b", "fp16", "h100", batch=64, context=2048)
    assert many.total > 10 * one.total
    assert many.per_user < one.per_user


def test_prefill_and_response_seconds() -> None:
    secs = prefill_seconds("llama-3-8b", "fp16", "h100", 1000, efficiency=0.5)
    m = MODELS["llama-3-8b"]  # untied: the LM head's matmul only for the last prompt token
    flops = 2 * (999 * m.matmul_params(logits=False) + m.matmul_params())
    assert secs == pytest.approx(flops / (989e12 * 0.5))
    assert secs < 2 * m.params * 1000 / (989e12 * 0.5)
    # a one-token prompt is bounded by reading the weights once (all but the embedding
    # table, which is looked up) and its one token of KV
    one = prefill_seconds("llama-3-8b", "fp16", "h100", 1)
    read = m.streamed_params() * 2 + kv_bytes_per_token(m)
    assert one == pytest.approx(read / (3350 * GB))
    resp = response_seconds("llama-3-8b", "fp16", "h100", 1000, 600)
    per_user = decode_tokens_per_s("llama-3-8b", "fp16", "h100", 1, 1300).per_user
    assert resp == pytest.approx(secs + 600 / per_user)
    assert response_seconds("llama-3-8b", "fp16", "laptop_cpu", 1000, 600) > 10 * resp


def test_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"hardware: unknown profile 'x' \(known: .*h100"):
        compute_bound_batch("x")
    with pytest.raises(ValueError, match="model: unknown profile 'gpt-9'"):
        weights_bytes("gpt-9")
    with pytest.raises(ValueError, match="precision: unknown 'fp8'"):
        weights_bytes("llama-2-7b", "fp8")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        decode_tokens_per_s("llama-2-7b", "fp16", "h100", batch=0)
    with pytest.raises(ValueError, match="context must be >= 0"):
        fits("llama-2-7b", "fp16", "h100", context=-1)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        prefill_seconds("llama-2-7b", "fp16", "h100", 0)
    with pytest.raises(ValueError, match="efficiency"):
        prefill_seconds("llama-2-7b", "fp16", "h100", 10, efficiency=0)
    with pytest.raises(ValueError, match="tokens_per_s must be > 0"):
        seconds_for_tokens(10, 0)
    with pytest.raises(ValueError, match="users must be >= 1"):
        aggregate_tokens_per_s(0, 20)
    with pytest.raises(ValueError, match="kv_bytes must be > 0"):
        kv_bytes_per_token("llama-2-7b", kv_bytes=0)
    with pytest.raises(ValueError, match="output_tokens must be >= 1"):
        response_seconds("llama-2-7b", "fp16", "h100", 10, 0)
    with pytest.raises(ValueError, match=r"logits must be in \[0, tokens=2\]"):
        hwm.step_cost("llama-2-7b", "fp16", "h100", tokens=2, logits=3, kv_tokens=0)


def test_model_size_table_matches_functions() -> None:
    rows = model_size_table("fp16", context=4096)
    assert [r["key"] for r in rows] == list(MODELS)
    for row in rows:
        assert row["weights_gb"] == weights_bytes(row["key"], "fp16") / GB
        expected = [h.name for h in HARDWARE.values() if fits(row["key"], "fp16", h, 4096).fits]
        assert row["fits_on"] == expected
    by_key = {r["key"]: r for r in rows}
    assert by_key["smollm2-135m"]["difficulty"] == "easy"
    assert by_key["llama-2-7b"]["difficulty"] == "needs a big GPU"
    assert by_key["llama-2-70b"]["difficulty"] == "datacenter only"
    assert by_key["llama-3.1-405b"]["difficulty"] == "beyond one node"
    assert by_key["llama-2-7b"]["fits_on"].count("RTX 4090 24 GB") == 1
    int4 = {r["key"]: r for r in model_size_table("int4")}
    assert int4["llama-2-7b"]["difficulty"] == "easy"
    assert int4["llama-2-7b"]["weights_gb"] == pytest.approx(by_key["llama-2-7b"]["weights_gb"] / 4)


def test_local_vs_datacenter_table_matches_functions() -> None:
    rows = local_vs_datacenter_table("llama-3-8b", "fp16", context=2048, big_batch=64)
    assert [r["key"] for r in rows] == list(HARDWARE)
    for row in rows:
        one = decode_tokens_per_s("llama-3-8b", "fp16", row["key"], 1, 2048)
        assert row["tokens_per_s_user"] == one.per_user
        assert row["bound"] == one.bound
        assert row["fits"] == fits("llama-3-8b", "fp16", row["key"], 2048).fits
        if fits("llama-3-8b", "fp16", row["key"], 2048, 64).fits:
            big = decode_tokens_per_s("llama-3-8b", "fp16", row["key"], 64, 2048)
            assert row["total_tokens_per_s_big_batch"] == big.total
            assert row["bound_big_batch"] == big.bound
        else:
            assert row["total_tokens_per_s_big_batch"] is None
    by_key = {r["key"]: r for r in rows}
    assert by_key["rtx4060_laptop"]["bound"] == "offload"
    assert by_key["rtx4060_laptop"]["total_tokens_per_s_big_batch"] is None
    assert by_key["h100"]["total_tokens_per_s_big_batch"] > 50 * by_key["laptop_cpu"][
        "tokens_per_s_user"]


def test_max_batch_is_the_largest_that_fits() -> None:
    n = hwm.max_batch("llama-3-8b", "fp16", "h100", 2048)
    assert n > 64
    assert fits("llama-3-8b", "fp16", "h100", 2048, n).fits
    assert not fits("llama-3-8b", "fp16", "h100", 2048, n + 1).fits
    assert hwm.max_batch("llama-2-70b", "fp16", "rtx4090", 2048) == 0


def test_profiles_are_frozen_and_keyed() -> None:
    for key, h in HARDWARE.items():
        assert h.key == key and h.source and h.kind in ("cpu", "gpu", "apple", "node")
        assert h.offload_bandwidth_gbs < h.bandwidth_gbs
    node, h100 = HARDWARE["8xh100"], HARDWARE["h100"]
    assert (node.memory_gb, node.bandwidth_gbs, node.peak_tflops) == (
        8 * h100.memory_gb, 8 * h100.bandwidth_gbs, 8 * h100.peak_tflops)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h100.memory_gb = 1  # type: ignore[misc]


def test_calibrate_measures_this_machine() -> None:
    cal = calibrate(seconds=0.5)
    assert isinstance(cal, Calibration)
    assert cal.device == "cpu"
    assert cal.bandwidth_gbs > 0.1
    assert cal.tflops > 0.001 and cal.tflops == max(cal.tflops_by_dtype.values())
    assert set(cal.tflops_by_dtype) == {"float32", "bfloat16"}
    assert 0 < cal.memory_available_gb <= cal.memory_gb
    assert calibrate(seconds=0.5) is cal  # cached per process
    profile = this_machine_profile(cal)
    assert profile.key == "this_machine" and profile.kind == "cpu"
    assert profile.bandwidth_gbs == cal.bandwidth_gbs and profile.peak_tflops == cal.tflops
    proj = decode_tokens_per_s("smollm2-135m", "fp16", profile, 1, 128)
    assert proj.per_user > 0
    with pytest.raises(ValueError, match="seconds must be > 0"):
        calibrate(seconds=0)


def test_calibrate_runs_on_the_compute_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """From any other thread a CPU measurement would leave a second OpenMP team behind,
    which slows every later engine step of the process (see engine/compute.py)."""
    seen = []
    real = calibrate_module._bandwidth_gbs

    def spy(*args: object) -> float:
        seen.append(compute.on_compute_thread())
        return real(*args)

    monkeypatch.setattr(calibrate_module, "_bandwidth_gbs", spy)
    calibrate(seconds=0.25)  # a duration no other test uses: not served from the cache
    assert seen == [True]



def test_a_fresh_calibration_is_measured_again_and_best_of_keeps_the_highest() -> None:
    cached = calibrate(seconds=0.3)
    again = calibrate(seconds=0.3, fresh=True)
    assert again is not cached and calibrate(seconds=0.3) is cached  # fresh ones not kept
    slow = dataclasses.replace(cached, bandwidth_gbs=1.0, tflops=0.001,
                               tflops_by_dtype={"float32": 0.001, "bfloat16": 0.0005})
    best = best_of(slow, again)
    assert best.bandwidth_gbs == again.bandwidth_gbs
    assert best.tflops_by_dtype == again.tflops_by_dtype and best.tflops == again.tflops
    mixed = dataclasses.replace(again, tflops_by_dtype={"float32": 9.0, "bfloat16": 0.0})
    assert best_of(again, mixed).tflops_by_dtype == {
        "float32": 9.0, "bfloat16": again.tflops_by_dtype["bfloat16"]}

def test_matmul_params_count_the_lm_head_only_where_logits_are_needed() -> None:
    small, big = MODELS["smollm2-135m"], MODELS["llama-2-7b"]
    # SmolLM2 ties its LM head to the embedding table: every weight is read each step
    assert small.matmul_params() == small.params == small.streamed_params()
    assert small.matmul_params(logits=False) == small.params - 49152 * 576
    # Llama-2 has both a table (looked up) and an LM head (multiplied) of 32000 x 4096
    assert big.streamed_params() == big.matmul_params() == big.params - 32000 * 4096
    assert big.matmul_params(logits=False) == big.params - 2 * 32000 * 4096
