"""The CPU's "auto" dtype: measured on the first start, then the same on every start."""

from __future__ import annotations

import json

import torch

from engine.models import device


def test_auto_dtype_is_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    calls = []

    def measure(device):
        calls.append(device)
        return torch.bfloat16, "bfloat16: matmul 2.0x faster than float32 here"

    monkeypatch.setattr(device, "_measure_cpu_dtype", measure)
    first = device.pick_dtype("auto", torch.device("cpu"))
    [saved] = (tmp_path / "dtype").glob("*.json")
    assert json.loads(saved.read_text())["dtype"] == "bfloat16"

    def flipped(device):  # a noisy second measurement would say otherwise
        calls.append(device)
        return torch.float32, "float32: bfloat16 matmul is 1.0x slower here"

    monkeypatch.setattr(device, "_measure_cpu_dtype", flipped)
    second = device.pick_dtype("auto", torch.device("cpu"))
    assert first[0] == second[0] == torch.bfloat16
    assert len(calls) == 1
    assert "measured on the first start" in second[1]


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(device, "_measure_cpu_dtype",
                        lambda device: (torch.float32, "float32: measured"))
    device.pick_dtype("auto", torch.device("cpu"))
    [saved] = (tmp_path / "dtype").glob("*.json")
    saved.write_text("{not json")
    assert device.pick_dtype("auto", torch.device("cpu")) == (torch.float32, "float32: measured")


def test_an_explicit_dtype_is_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(device, "_measure_cpu_dtype", lambda device: 1 / 0)
    assert device.pick_dtype("float32", torch.device("cpu"))[0] == torch.float32
    assert not (tmp_path / "dtype").exists()
