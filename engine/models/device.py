"""Which device and dtype a model runs in: "auto" picks CUDA when present, and on a CPU
times the engine's decode steps in bfloat16 and float32 once per machine and model
(`engine.models.probe`) and keeps the answer."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from engine.models import loader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device,
               folder: Path | None = None) -> tuple[torch.dtype, str]:
    """The dtype to run in and why. On a CPU, "auto" times the model in `folder` in float32
    and bfloat16 on the first start and keeps the answer per machine and model (CPU model,
    threads, torch version, kernels, model folder), so every later start runs the same
    dtype and prints the same text. Without a folder: bfloat16 where the CPU has AVX-512
    with bfloat16 dot products, else float32, unmeasured."""
    if dtype != "auto":
        return DTYPES[dtype], f"{dtype}: chosen in the settings"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bfloat16: native on this GPU"
        return torch.float16, "float16: this GPU has no bfloat16"
    if folder is None:
        return _guess_cpu_dtype()
    # what the steps run on: our kernels' build, and the ISA torch and oneDNN may use
    kernels = "|".join(os.environ.get(k, "") for k in (
        "BATCHLENS_NATIVE", "BATCHLENS_NATIVE_ISA", "BATCHLENS_BF16_KERNEL", "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA"))
    machine = (f"{device_name('cpu')}|torch {torch.__version__}|steps v4|kernels {kernels}|"
               f"{folder.resolve()}")
    path = loader.cache_root() / "dtype" / f"{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(path.read_text())
        return DTYPES[saved["dtype"]], saved["reason"]
    except (OSError, ValueError, KeyError):
        pass
    picked, reason = _measure_cpu_dtype(device, folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine, "dtype": str(picked).split(".")[-1],
                                    "reason": f"{reason}, measured on the first start"}))
    except OSError:
        pass  # a read-only cache: measure again next start
    return picked, reason


def _measure_cpu_dtype(device: torch.device, folder: Path) -> tuple[torch.dtype, str]:
    from engine.models import probe

    return probe.measure_cpu_dtype(folder, device)


def _guess_cpu_dtype() -> tuple[torch.dtype, str]:
    if "avx512_bf16" in _cpu_flags():
        return torch.bfloat16, "bfloat16: this CPU has AVX-512 bfloat16 dot products (not timed)"
    return torch.float32, "float32: this CPU has no AVX-512 bfloat16 dot products (not timed)"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
