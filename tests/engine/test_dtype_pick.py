"""The CPU's "auto" dtype: measured on the first start, then the same on every start."""

from __future__ import annotations

import json

import torch

from engine.models import device


def test_auto_dtype_is_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    calls = []

    def measure(device, folder):
        calls.append(device)
        return torch.bfloat16, "bfloat16: matmul 2.0x faster than float32 here"

    monkeypatch.setattr(device, "_measure_cpu_dtype", measure)
    first = device.pick_dtype("auto", torch.device("cpu"), tmp_path)
    [saved] = (tmp_path / "dtype").glob("*.json")
    assert json.loads(saved.read_text())["dtype"] == "bfloat16"

    def flipped(device, folder):  # a noisy second measurement would say otherwise
        calls.append(device)
        return torch.float32, "float32: bfloat16 matmul is 1.0x slower here"

    monkeypatch.setattr(device, "_measure_cpu_dtype", flipped)
    second = device.pick_dtype("auto", torch.device("cpu"), tmp_path)
    assert first[0] == second[0] == torch.bfloat16
    assert len(calls) == 1
    assert "measured on the first start" in second[1]


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(device, "_measure_cpu_dtype",
                        lambda device, folder: (torch.float32, "float32: measured"))
    device.pick_dtype("auto", torch.device("cpu"), tmp_path)
    [saved] = (tmp_path / "dtype").glob("*.json")
    saved.write_text("{not json")
    assert device.pick_dtype("auto", torch.device("cpu"), tmp_path) == (torch.float32, "float32: measured")


def test_an_explicit_dtype_is_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(device, "_measure_cpu_dtype", lambda device, folder: 1 / 0)
    assert device.pick_dtype("float32", torch.device("cpu"), tmp_path)[0] == torch.float32
    assert not (tmp_path / "dtype").exists()


def test_the_dtype_faster_over_both_steps_wins_and_the_reason_gives_both():
    from engine.models import probe

    dtype, why = probe.pick(bf16_batched=0.05, bf16_single=0.02, f32_batched=0.10,
                            f32_single=0.018)
    assert dtype == torch.bfloat16
    assert why == ("bfloat16: decode steps 2.0x (64 sequences) and 0.9x (1) as fast as "
                   "float32 on one core here")
    dtype, why = probe.pick(0.10, 0.03, 0.09, 0.02)  # float32 faster at both
    assert dtype == torch.float32
    assert why.startswith("float32: decode steps 1.1x (64 sequences) and 1.5x (1)")


def test_the_probe_times_engine_steps_of_the_model_in_both_dtypes(tiny_models, monkeypatch):
    """On a tiny random Llama: the four steps run (bfloat16 and float32, batched and
    single), through the runner, and a dtype comes back with the reason."""
    from engine.models import probe

    timed = []
    real = probe.fastest_seconds

    def spy(steps, reps=probe.REPS):
        timed.extend(steps)
        return real(steps, reps=1)

    monkeypatch.setattr(probe, "fastest_seconds", spy)
    dtype, why = probe.measure_cpu_dtype(tiny_models["llama"], torch.device("cpu"))
    assert sorted(timed) == ["bfloat16@1", "bfloat16@64", "float32@1", "float32@64"]
    assert dtype in (torch.bfloat16, torch.float32)
    assert why.startswith(f"{str(dtype).split('.')[-1]}: decode steps ")
