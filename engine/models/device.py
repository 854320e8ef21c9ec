"""Which device and dtype a model runs in: "auto" picks CUDA when present, and on a CPU
times bfloat16 against float32 once per machine and keeps the answer."""

from __future__ import annotations

import hashlib
import json
import platform
import time

import torch
import torch.nn.functional as F

from engine.models import loader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def _time_matmul(device: torch.device, dtype: torch.dtype, m: int = 64, k: int = 576,
                 n: int = 1536, reps: int = 20) -> float:
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    for _ in range(3):
        F.linear(x, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / reps


def pick_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in and why. On a CPU, "auto" measures float32 against bfloat16 on
    the first start and keeps the answer per machine (CPU model, threads, torch version),
    so every later start runs the same dtype and prints the same text."""
    if dtype != "auto":
        return DTYPES[dtype], f"{dtype}: chosen in the settings"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bfloat16: native on this GPU"
        return torch.float16, "float16: this GPU has no bfloat16"
    machine = f"{device_name('cpu')}|torch {torch.__version__}"
    path = loader.cache_root() / "dtype" / f"{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(path.read_text())
        return DTYPES[saved["dtype"]], saved["reason"]
    except (OSError, ValueError, KeyError):
        pass
    picked, reason = _measure_cpu_dtype(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine, "dtype": str(picked).split(".")[-1],
                                    "reason": f"{reason}, measured on the first start"}))
    except OSError:
        pass  # a read-only cache: measure again next start
    return picked, reason


def _measure_cpu_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    # interleaved, best of 5 each: robust to another process taking the cores for a moment
    t32 = t16 = float("inf")
    for _ in range(5):
        t32 = min(t32, _time_matmul(device, torch.float32))
        t16 = min(t16, _time_matmul(device, torch.bfloat16))
    if t16 < t32:
        return torch.bfloat16, f"bfloat16: matmul {t32 / t16:.1f}x faster than float32 here"
    return torch.float32, f"float32: bfloat16 matmul is {t16 / t32:.1f}x slower here"


def device_name(device: str) -> str:
    """The GPU model, or the CPU model name and the torch thread count."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
