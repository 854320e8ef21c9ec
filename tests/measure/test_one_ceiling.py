"""One decode ceiling: the Sweep page, the Hardware page and the bench, each through the
function it calls, give the same tokens/s for the same model, hardware and batch (all three
rest on `measure.hardware.step_cost`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from measure import hardware
from measure.bench import report as bench_report
from measure.bench.requests import BenchRequest
from measure.calibrate import Calibration
from measure.roofline import mix_floor, roofline

# Made-up figures (nothing measured); 8 GiB free, so Llama-3-8B in fp16 is offloaded.
CALIBRATION = Calibration(
    device="cpu", device_name="fake test CPU", bandwidth_gbs=40.0, tflops=0.5,
    tflops_by_dtype={"float32": 0.25, "bfloat16": 0.5}, memory_gb=16.0,
    memory_available_gb=8.0)
CASES = [(model, batch, context) for model in ("smollm2-135m", "llama-3-8b")
         for batch in (1, 8, 64, 1024) for context in (1, 300)]


def sweep_page(model: str, batch: int, context: int) -> float:
    """ui/sweep_view._roofline: `roofline` of this machine in the served model's dtype."""
    return roofline(CALIBRATION, model, torch.bfloat16, [batch], context).rows[0]["total"]


def hardware_page(model: str, hw: hardware.HardwareProfile | str, batch: int,
                  context: int) -> float:
    """ui/hardware_view.decode_frame: `decode_tokens_per_s` at the chosen precision."""
    return hardware.decode_tokens_per_s(model, "fp16", hw, batch, context).total


def decode_from_floors(floor_s: list[float], batch: int) -> float:
    """`batch` requests of one prompt length with 1, then 2 output tokens: the second
    floor is one decode step (batch sequences, context = the prompt) longer."""
    return batch / (floor_s[1] - floor_s[0])


def bench_here(model: str, batch: int, context: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """measure.bench.report.roofline_floor, on this (made-up) machine."""
    monkeypatch.setattr(bench_report, "calibrate", lambda device: CALIBRATION)
    m = hardware.MODELS[model]
    arch = SimpleNamespace(num_layers=m.layers, hidden_size=m.hidden_size,
                           num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    loaded = SimpleNamespace(model=SimpleNamespace(arch=arch, device=torch.device("cpu"),
                                                   dtype=torch.bfloat16))
    floors = []
    for out in (1, 2):
        reqs = [BenchRequest(tuple(range(context)), out)] * batch
        floors.append(bench_report.roofline_floor(loaded, reqs, batch)["batched_s"])
    return decode_from_floors(floors, batch)


@pytest.mark.parametrize(("model", "batch", "context"), CASES)
def test_sweep_hardware_page_and_bench_agree_on_this_machine(
        model: str, batch: int, context: int, monkeypatch: pytest.MonkeyPatch) -> None:
    here = hardware.this_machine_profile(CALIBRATION)  # the Hardware page's "this machine"
    page = hardware_page(model, here, batch, context)
    assert sweep_page(model, batch, context) == pytest.approx(page, rel=1e-9)
    assert bench_here(model, batch, context, monkeypatch) == pytest.approx(page, rel=1e-9)


@pytest.mark.parametrize(("model", "batch", "context"), CASES)
@pytest.mark.parametrize("hw", ["h100", "rtx4090", "laptop_cpu"])
def test_hardware_page_and_bench_agree_on_reference_hardware(
        model: str, batch: int, context: int, hw: str) -> None:
    """The bench's floor ratios elsewhere (`FLOOR_ELSEWHERE`) are `mix_floor` on a profile."""
    floors = [mix_floor([context] * batch, [out] * batch, batch, model, hw).batched_s
              for out in (1, 2)]
    page = hardware_page(model, hw, batch, context)
    assert decode_from_floors(floors, batch) == pytest.approx(page, rel=1e-9)


def test_the_cases_cover_every_bound() -> None:
    here = hardware.this_machine_profile(CALIBRATION)
    bounds = {hardware.decode_tokens_per_s(m, "fp16", here, b, c).bound for m, b, c in CASES}
    assert bounds == {"memory", "compute", "offload"}
