"""The CPU decode-attention kernel (csrc/paged_attention.cpp), built once on first use.

Decode attention in plain torch has to gather every request's K/V blocks into a padded
copy before two batched matmuls can read them: on the 2-core CPU that copy plus the small
matmuls were 43% of a 64-user step. The kernel walks each block table and reads every
K/V byte once, keeping the softmax running in float32 (see the .cpp file).

It is compiled with torch's own extension builder (g++ and ninja) into kernels/ under the
user cache (`$BATCHLENS_CACHE` or ~/.cache/batchlens) the first time a bfloat16 model
loads on a CPU (about 10 s), and loaded from there afterwards. Where it cannot be built
(no compiler, no AVX-512, BATCHLENS_NATIVE=0), the torch path in `attention.py` is used
instead and `status()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models import loader

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

STALE_LOCK_S = 300  # a build lock older than this was left by a killed build

PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


@functools.cache
def _build() -> tuple[PagedDecode | None, str]:
    if os.environ.get("BATCHLENS_NATIVE", "1") == "0":
        return None, "disabled by BATCHLENS_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the kernel is written for x86-64, this CPU is {platform.machine()}"
    if "avx512" not in torch.backends.cpu.get_cpu_capability().lower():
        return None, "this CPU has no AVX-512"
    try:
        from torch.utils.cpp_extension import load

        load(name="batchlens_paged_attention", sources=[str(SOURCE)], extra_cflags=CFLAGS,
             build_directory=str(build_dir()), is_python_module=False, verbose=False)
        return torch.ops.batchlens.paged_decode_attention, "compiled AVX-512 kernel"
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
        reason = f"could not build the kernel ({type(exc).__name__}: {str(exc)[:200]})"
        log.warning("paged decode attention: %s; using the torch path", reason)
        return None, reason


def build_dir() -> Path:
    """Where the kernel is built: one folder per source, flags and torch version.

    torch's builder waits for a `lock` file while another process builds; a build killed
    midway leaves it behind, and every later start would wait forever, so an old one goes.
    """
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    folder = loader.cache_root() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    return folder


def paged_decode(device: torch.device, dtype: torch.dtype) -> PagedDecode | None:
    """The kernel for this device and dtype, or None to use the torch path.

    Only CPU bfloat16 uses it: float32 keeps the torch path, whose sums match
    transformers' bit for bit, and CUDA has its own fused kernels.
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return _build()[0]


def status() -> str:
    """One line for the UI and the bench: which decode attention the CPU runs, and why."""
    kernel, reason = _build()
    return f"decode attention: {reason}" if kernel else f"decode attention: torch ({reason})"
