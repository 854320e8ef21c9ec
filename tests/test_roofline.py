"""The roofline of this machine for the served model (engine/roofline.py): the same figures
as engine/hardware.py, with float32 read as twice the bytes."""

from __future__ import annotations

import pytest
import torch

from engine import hardware
from engine.calibrate import Calibration
from engine.roofline import model_profile_key, roofline, user_grid

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
def test_the_bundled_model_has_a_hardware_profile(session):
    assert model_profile_key(session.model.spec) == "smollm2-135m"


