"""The roofline of this machine for the served model (measure/roofline.py): the same figures
as measure/hardware.py, with float32 read as twice the bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from measure import hardware
from measure.calibrate import Calibration
from measure.roofline import mix_floor, model_profile_key, roofline, user_grid

# Made-up machine figures for the pure roofline helper (nothing here was measured).
FAKE_CALIBRATION = Calibration(
    device="cpu", device_name="fake test CPU", bandwidth_gbs=30.0, tflops=0.4,
    tflops_by_dtype={"float32": 0.2, "bfloat16": 0.4}, memory_gb=16.0,
    memory_available_gb=8.0)


def test_user_grid_spans_the_loads_on_a_log_scale():
    grid = user_grid((1, 2, 4, 64))
    assert grid[0] == 1 and grid[-1] == 64 and grid == sorted(set(grid))
    assert user_grid((4,)) == [4]


def test_roofline_matches_engine_hardware_for_a_2_byte_dtype():
    roof = roofline(FAKE_CALIBRATION, "smollm2-135m", torch.bfloat16, [1, 64], context=40)
    profile = hardware.this_machine_profile(FAKE_CALIBRATION)
    for row in roof.rows:
        p = hardware.decode_tokens_per_s("smollm2-135m", "fp16", profile, row["users"], 40)
        assert row["total"] == pytest.approx(p.total)  # peak: bfloat16 = the best measured
        assert row["per_user"] == pytest.approx(p.per_user)
    assert roof.precision == "fp16" and "bfloat16" in roof.note and "context 40" in roof.note


def test_roofline_for_float32_reads_twice_the_bytes():
    bf16 = roofline(FAKE_CALIBRATION, "smollm2-135m", torch.bfloat16, [1], context=40).rows[0]
    fp32 = roofline(FAKE_CALIBRATION, "smollm2-135m", torch.float32, [1], context=40)
    assert bf16["bound"] == fp32.rows[0]["bound"] == "memory"
    assert fp32.rows[0]["per_user"] == pytest.approx(bf16["per_user"] / 2)
    assert "no 4-byte precision" in fp32.note and "float32 matmul" in fp32.note


@pytest.mark.model
def test_the_bundled_model_has_a_hardware_profile(loaded):
    assert model_profile_key(loaded.model.arch) == "smollm2-135m"


def _profile(bandwidth_gbs: float, tflops: float) -> hardware.HardwareProfile:
    """A made-up device for the floor's arithmetic."""
    return dataclasses.replace(hardware.HARDWARE["h100"], bandwidth_gbs=bandwidth_gbs,
                               peak_tflops=tflops)


def _step(model: str, hw: hardware.HardwareProfile, prompt: int, kv_tokens: int) -> float:
    """The roofline step of DESIGN.md, written out again for the test: SmolLM2 ties its
    LM head to the embedding table (576 x 49152), whose matmul only the last prompt
    token (or a decode token, prompt=1) needs."""
    m = hardware.MODELS[model]
    flops = 2 * (m.params * prompt - (prompt - 1) * 576 * 49152)
    read = m.params * 2 + kv_tokens * hardware.kv_bytes_per_token(m)
    return max(read / (hw.bandwidth_gbs * 1e9), flops / (hw.peak_tflops * 1e12))


def test_mix_floor_of_one_request_is_its_prefill_step_then_its_decode_steps():
    hw = _profile(30.0, 0.4)
    floor = mix_floor([4], [3], 8, "smollm2-135m", hw)
    # prefill: 4 tokens, first token out; then 2 decode steps reading 4 and 5 tokens of KV
    want = sum(_step("smollm2-135m", hw, t, kv) for t, kv in ((4, 4), (1, 4), (1, 5)))
    assert floor.sequential_s == pytest.approx(want)
    assert floor.batched_s == pytest.approx(want)
    assert floor.ratio == pytest.approx(1.0) and floor.output_tokens == 3
    long = mix_floor([300], [2], 8, "smollm2-135m", hw)  # a compute-bound prefill step
    assert long.sequential_s == pytest.approx(
        _step("smollm2-135m", hw, 300, 300) + _step("smollm2-135m", hw, 1, 300))
    assert _step("smollm2-135m", hw, 300, 300) > 2 * _step("smollm2-135m", hw, 1, 300)


def test_mix_floor_at_concurrency_1_is_the_sequential_floor():
    prompts, outs = [5, 50, 300, 7], [16, 3, 40, 1]
    floor = mix_floor(prompts, outs, 1, "smollm2-135m", _profile(30.0, 0.4))
    assert floor.batched_s == pytest.approx(floor.sequential_s)


def test_mix_floor_ratio_is_the_batch_where_memory_bound_and_1_where_compute_bound():
    prompts, outs = [1] * 8, [200] * 8
    memory_bound = mix_floor(prompts, outs, 8, "smollm2-135m", _profile(30.0, 1000.0))
    assert 7.0 < memory_bound.ratio <= 8.0  # 8 users share each read of the weights
    compute_bound = mix_floor(prompts, outs, 8, "smollm2-135m", _profile(1e6, 0.1))
    assert compute_bound.ratio == pytest.approx(1.0, rel=1e-3)  # batching buys nothing
    capped = mix_floor(prompts, outs, 2, "smollm2-135m", _profile(30.0, 1000.0))
    assert 1.5 < capped.ratio <= 2.0  # at most 2 at once


def test_mix_floor_rejects_bad_input():
    hw = _profile(30.0, 0.4)
    with pytest.raises(ValueError, match="concurrency"):
        mix_floor([4], [3], 0, "smollm2-135m", hw)
    with pytest.raises(ValueError, match="one length"):
        mix_floor([4, 5], [3], 1, "smollm2-135m", hw)
    with pytest.raises(ValueError, match=">= 1"):
        mix_floor([0], [3], 1, "smollm2-135m", hw)
    with pytest.raises(ValueError, match="unknown"):
        mix_floor([4], [3], 1, "no-such-model", hw)
