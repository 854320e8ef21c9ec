"""The native CPU kernels (csrc/), built once on first use: the decode-attention kernel, the
decoder layer's fused elementwise ops and the bfloat16 matmuls (AMX, AVX512_BF16 or AVX2).

Decode attention in plain torch has to gather every request's K/V blocks into a padded
copy before two batched matmuls can read them: on a small CPU that copy plus the small
matmuls are 43% of a 64-user step. The kernel (paged_attention.cpp) walks each block table
and reads every K/V byte once, keeping the softmax running in float32. The layer ops
(layer_ops.cpp) replace the dozen small torch ops around the matmuls of each layer
(residual add + RMSNorm, RoPE + the K/V write, SiLU x up) by three calls. The matmul
kernel (bf16_gemm.cpp, `engine.models.linear`) streams weights faster than oneDNN at the
few rows of a decode step, and is about as fast at a prompt's hundreds. Where all of these serve
a step, the decoder stack (decoder.cpp) runs every layer of it in one call.

All are compiled with torch's own extension builder (g++ and ninja) into kernels/ under
the user cache (`$BATCHLENS_CACHE` or ~/.cache/batchlens) the first time a model loads on a
machine (under a minute on two cores; a presenter starts the app once before the talk), and
loaded from there afterwards (well under a second). `-march=native` picks the CPU's vector
instructions: the attention kernel has AVX-512 (with AVX512_BF16 dot products where the
CPU has them), AVX2 and portable paths. BATCHLENS_NATIVE_ISA=avx2 builds without AVX-512,
and BATCHLENS_KERNEL_PATH=avx2|portable makes a build take a slower path, to measure the
fallbacks on an AVX-512 machine. Where nothing can be built (no compiler,
BATCHLENS_NATIVE=0) the torch paths run instead and `status()` says why.
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

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention.cpp", "layer_ops.cpp", "bf16_gemm.cpp", "decoder.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name  # included by the sources
           for name in ("simd.h", "kernels.h")]
# Every function starts on a cache line: a batch-1 step's speed moves with where the
# matmul's few-row loop lands, and without this a change in any source linked before it
# moves it (csrc/bf16_gemm.cpp, amx_tile).
BASE_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
               "-falign-functions=64"]
# BATCHLENS_NATIVE_ISA; the tile code sits inside the AVX-512 code, so AMX goes with it
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16"]}

STALE_LOCK_S = 300  # a build lock older than this was left by a killed build

PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def isa() -> str:
    """The instruction set the kernels are built for: "native" (all this CPU has) or "avx2"
    (AVX-512 left out, to measure the fallback), from BATCHLENS_NATIVE_ISA."""
    name = os.environ.get("BATCHLENS_NATIVE_ISA", "native")
    if name not in ISA_FLAGS:
        raise ValueError(f"BATCHLENS_NATIVE_ISA must be one of {sorted(ISA_FLAGS)}, got {name!r}")
    return name


def cflags() -> list[str]:
    return BASE_CFLAGS + ISA_FLAGS[isa()]


@functools.cache
def _build() -> tuple[bool, str]:
    """Build (or load the cached build of) the kernels; (built, what runs and why)."""
    if os.environ.get("BATCHLENS_NATIVE", "1") == "0":
        return False, "disabled by BATCHLENS_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"the kernels are written for x86-64, this CPU is {platform.machine()}"
    try:
        from torch.utils.cpp_extension import load

        load(name="batchlens_native", sources=[str(s) for s in SOURCES], extra_cflags=cflags(),
             build_directory=str(build_dir()), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why
        reason = f"could not build the kernels ({type(exc).__name__}: {str(exc)[:200]})"
        log.warning("native CPU kernels: %s; using the torch paths", reason)
        return False, reason
    if avx512():
        return True, "compiled AVX-512 kernels"
    note = " (BATCHLENS_NATIVE_ISA=avx2)" if isa() == "avx2" else ""
    if "avx2" in _cpu_flags():
        return True, f"compiled AVX2 kernels{note}"
    return True, "compiled portable kernels (no AVX2 or AVX-512)"


def build_dir() -> Path:
    """Where the kernel is built: one folder per source, flags and torch version.

    torch's builder waits for a `lock` file while another process builds; a build killed
    midway leaves it behind, and every later start would wait forever, so an old one goes.
    """
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)
                         + " ".join(cflags()).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    folder = loader.cache_root() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    return folder


def paged_decode(device: torch.device, dtype: torch.dtype) -> PagedDecode | None:
    """The decode-attention kernel for this device and dtype, or None to use the torch path.

    On a CPU where the kernels are built, for bfloat16 and float32: AVX-512 (and
    AVX512_BF16) instances, AVX2 ones, and a portable one for other shapes and CPUs; all of
    them beat the torch path's gather and batched matmuls (measured with AVX-512 turned
    off, one 64-sequence layer on one core: float32 2.6 ms by AVX2, 3.0 portable, 10.5
    torch). CUDA has its own kernel.
    """
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or not _build()[0]:
        return None
    return torch.ops.batchlens.paged_decode_attention


def packed_kv(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int,
              group: int) -> bool:
    """Whether the KV cache is packed (engine/models/attention.py) for the decode kernel's
    packed paths: bfloat16 on a CPU whose AMX tiles the kernels drive or with AVX512_BF16,
    blocks of a multiple of 16 tokens, head_dim 64 or 128, 1-8 query heads per kv head.
    BATCHLENS_KV_PACKED=0 keeps rows, to compare."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and os.environ.get("BATCHLENS_KV_PACKED", "1") != "0" and _build()[0]
            and bool(torch.ops.batchlens.paged_packed_supported(head_dim, group, block_size)))


def bf16_linear_built() -> bool:
    """Whether the bfloat16 matmul kernel (csrc/bf16_gemm.cpp,
    `torch.ops.batchlens.bf16_linear`) is built: the CPU has AVX512_BF16, or AVX2 and FMA,
    and the kernels were built with it."""
    return _build()[0] and bool(torch.ops.batchlens.bf16_linear_supported())


def bf16_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's matmuls run in that kernel: bfloat16 on a CPU where it is built
    (with AMX it drives the tile unit); BATCHLENS_BF16_KERNEL=0 keeps oneDNN's packed
    weights, to compare. A CPU with AMX whose tiles the kernel cannot use (Linux refused
    the tile state) keeps oneDNN: there the kernel's vector path runs prompts at a tenth
    of the tiles' speed."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and os.environ.get("BATCHLENS_BF16_KERNEL", "1") != "0"
            and bf16_linear_built()
            and (bf16_linear_amx() or "amx_bf16" not in _cpu_flags()))


def bf16_linear_amx() -> bool:
    """Whether the matmul kernel drives AMX tiles (built for a CPU with AMX-BF16 and the
    tile state granted by Linux) for every K that is a multiple of 32."""
    return bf16_linear_built() and bool(torch.ops.batchlens.bf16_linear_amx())


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@functools.cache
def avx512() -> bool:
    """The kernels were built with AVX-512 (the CPU has it and BATCHLENS_NATIVE_ISA allows);
    asked once, as the build is made once (each greedy step asks)."""
    return isa() == "native" and "avx512" in torch.backends.cpu.get_cpu_capability().lower()


def cpu_kernels(device: torch.device) -> bool:
    """Whether the kernels are built and `device` is the CPU they run on: the ops of any
    dtype (`argmax_rows`; `bar_tokens`, a structured output's mask on float32 logits)."""
    return device.type == "cpu" and _build()[0]


def layer_ops(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused layer ops (`torch.ops.batchlens.add_rms_norm`, `rope_write_kv`,
    `silu_mul`) serve this device and dtype: CPU bfloat16 and float16 with the kernels built.
    float32 keeps torch's ops, whose results match transformers' bit for bit."""
    return device.type == "cpu" and dtype != torch.float32 and _build()[0]


def status(dtype: torch.dtype = torch.bfloat16) -> str:
    """One line for the UI and the bench: what the CPU kernels are, and which decode
    attention a model in `dtype` runs."""
    built, reason = _build()
    if not built:
        return f"native kernels: none, torch paths ({reason})"
    cpu = torch.device("cpu")
    attention = "the kernel" if paged_decode(cpu, dtype) else "torch"
    if attention == "the kernel" and packed_kv(cpu, dtype, 16, 64, 3):
        # SmolLM2's shapes, the default block
        attention += " (AMX tiles, packed K/V)" if bf16_linear_amx() else " (packed K/V)"
    matmuls = ""
    if dtype == torch.bfloat16:
        matmuls = "; matmuls: " + (("the bfloat16 kernel (AMX tiles)" if bf16_linear_amx()
                                    else "the bfloat16 kernel") if bf16_linear(cpu, dtype)
                                   else "oneDNN")
    return f"native kernels: {reason}{matmuls}; decode attention: {attention}"
