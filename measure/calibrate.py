"""Measure this machine: memory bandwidth, matmul FLOP/s and memory size, in a few seconds.

The result feeds `measure.hardware.this_machine_profile`, so the roofline can place the
machine the app runs on next to the reference hardware. Cached per process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import compute
from engine.memory import pages
from engine.memory.budget import GIB
from engine.models import native
from engine.models.device import device_name
from engine.models.linear import pack_for_kernel

GB = 1e9
MATMUL_N = 2048
BUFFER_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Calibration:
    """What was measured, on which device. Memory sizes in GiB, bandwidths in GB/s."""

    device: str
    device_name: str
    bandwidth_gbs: float
    tflops: float  # best of the dtypes tried
    tflops_by_dtype: dict[str, float] = field(default_factory=dict)
    memory_gb: float = 0.0
    memory_available_gb: float = 0.0
    offload_bandwidth_gbs: float | None = None  # host -> device copy (CUDA only)
    threads: int = 1
    seconds: float = 0.0  # time the measurement took


def calibrate(seconds: float = 3.0, device: str = "cpu", fresh: bool = False) -> Calibration:
    """Measure bandwidth and FLOP/s on `device` ("cpu" or "cuda") within about `seconds`
    (once per process, unless `fresh`: measured again, and not kept).

    Runs on the compute thread (`engine.compute`), like every engine step: a CPU
    measurement from any other thread leaves a second OpenMP team behind, which slowed
    this machine's batch-1 decode steps from ~21 ms to ~35 ms for the rest of the process.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False")
    return compute.run(_measure if fresh else _calibrate_cached, float(seconds), device)


def best_of(first: Calibration, *more: Calibration) -> Calibration:
    """The highest bandwidth and FLOP/s of several measurements of one device: another
    process taking a core for a moment can only lower a figure, never raise it."""
    cals = (first, *more)
    by_dtype = {k: max(c.tflops_by_dtype.get(k, 0.0) for c in cals)
                for k in first.tflops_by_dtype}
    offload = [c.offload_bandwidth_gbs for c in cals if c.offload_bandwidth_gbs is not None]
    return dataclasses.replace(
        first, bandwidth_gbs=max(c.bandwidth_gbs for c in cals),
        tflops=max(by_dtype.values(), default=max(c.tflops for c in cals)),
        tflops_by_dtype=by_dtype,
        offload_bandwidth_gbs=max(offload) if offload else None,
        seconds=sum(c.seconds for c in cals))


def _measure(seconds: float, device: str) -> Calibration:
    start = time.perf_counter()
    dev = torch.device(device)
    total_gib, avail_gib = _memory_gib(device)
    size = int(min(BUFFER_BYTES, avail_gib * GIB / 8)) // 4 * 4
    with torch.inference_mode():
        bandwidth = _bandwidth_gbs(dev, size, 0.4 * seconds)
        dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])
        by_dtype = {
            str(dt).removeprefix("torch."): _matmul_tflops(dev, dt, 0.5 * seconds / len(dtypes))
            for dt in dtypes
        }
        offload = _host_to_device_gbs(size, 0.1 * seconds) if device == "cuda" else None
    return Calibration(
        device=device,
        device_name=device_name(device),
        bandwidth_gbs=bandwidth,
        tflops=max(by_dtype.values()),
        tflops_by_dtype=by_dtype,
        memory_gb=total_gib,
        memory_available_gb=avail_gib,
        offload_bandwidth_gbs=offload,
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - start,
    )


_calibrate_cached = functools.lru_cache(maxsize=8)(_measure)


def _best_seconds(fn: Callable[[], object], budget: float, sync: Callable[[], None]) -> float:
    """Fastest of repeated runs of `fn` (after one warm-up) within `budget` seconds; >= 2 runs."""
    fn()
    sync()
    best = float("inf")
    deadline = time.perf_counter() + budget
    runs = 0
    while runs < 2 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def _sync(dev: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def _bandwidth_gbs(dev: torch.device, nbytes: int, budget: float) -> float:
    """Best of a copy (read + write counted) and a reduction (read) over a large buffer; on
    a CPU on 2 MiB pages where the OS gives them, as the engine's weights and K/V are (on
    4 KiB pages the TLB, not the memory, sets the pace: a fifth slower on some hosts)."""
    if dev.type == "cpu":
        src = pages.empty((nbytes // 4,), torch.float32).fill_(1.0)
        dst = pages.empty((nbytes // 4,), torch.float32)
    else:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), budget / 2, _sync(dev))
    read_s = _best_seconds(lambda: src.sum(), budget / 2, _sync(dev))
    return max(2 * nbytes / copy_s, nbytes / read_s) / GB


def _matmul_tflops(dev: torch.device, dtype: torch.dtype, budget: float) -> float:
    n = MATMUL_N
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    torch_mm: Callable[[], object] = lambda: a @ b  # noqa: E731
    fns = [torch_mm]
    if native.bf16_linear(dev, dtype):
        # the matmul a bfloat16 step runs on this CPU (a x b^T, the same FLOPs): torch's own
        # bfloat16 matmul has no fast path on a CPU without AVX512_BF16, where it runs
        # orders of magnitude slower than the kernel and a calibration takes minutes. With
        # AMX, oneDNN's tiles are as fast a path, and the faster of the two is the peak
        packed = pack_for_kernel(b)
        kernel = lambda: torch.ops.batchlens.bf16_linear(a, packed, None)  # noqa: E731
        fns = [kernel, torch_mm] if native.bf16_linear_amx() else [kernel]
    secs = min(_best_seconds(fn, budget / len(fns), _sync(dev)) for fn in fns)
    return 2 * n**3 / secs / 1e12


def _host_to_device_gbs(nbytes: int, budget: float) -> float:
    host = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    secs = _best_seconds(lambda: dst.copy_(host, non_blocking=True), budget, torch.cuda.synchronize)
    return nbytes / secs / GB


def _memory_gib(device: str) -> tuple[float, float]:
    """(total, available) memory of the device in GiB: GPU memory for CUDA, else system RAM."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total / GIB, free / GIB
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024  # values are in kB (KiB)
    except (OSError, ValueError, IndexError):
        info = {}
    if "MemTotal" in info:
        return info["MemTotal"] / GIB, info.get("MemAvailable", info.get("MemFree", 0)) / GIB
    page = os.sysconf("SC_PAGE_SIZE")
    return (os.sysconf("SC_PHYS_PAGES") * page / GIB, os.sysconf("SC_AVPHYS_PAGES") * page / GIB)
