"""The AMX tile unit's peak on this CPU: TDPBF16PS back to back on tile registers, nothing
loaded from memory, on 1 thread and on torch's thread count. The ceiling that the matmul
kernel's "weights in cache" column (`scripts/bf16_matmul_bench.py`) and the attention's
in-cache case (`scripts/kernel_bench.py`) can be read against: what is left between them
and it is moving tiles in and out, not the products. Needs Linux, a CPU with AMX-BF16 and
a C++ compiler (built once, like the engine's kernels).

    python scripts/tile_peak.py [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from torch.utils.cpp_extension import load_inline

from engine.models import loader

SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Seconds for `iters` rounds of four independent 16 x 16 x 32 products (C tiles 0-3, A 4-5,
// B 6-7: no product waits on the one before), longest of `threads` threads at once.
double tile_seconds(int64_t iters, int64_t threads) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
    return -1.0;
  std::vector<double> took(threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      Config c;
      for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
      _tile_loadconfig(&c);
      alignas(64) static thread_local uint16_t ones[16 * 32];
      for (auto& v : ones) v = 0x3f80;  // bfloat16 1.0
      _tile_loadd(4, ones, 64);
      _tile_loadd(5, ones, 64);
      _tile_loadd(6, ones, 64);
      _tile_loadd(7, ones, 64);
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < iters; ++i) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      alignas(64) static thread_local float out[256];
      _tile_stored(0, out, 64);  // the products' results leave the unit
      took[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      _tile_release();
    });
  for (auto& th : pool) th.join();
  double worst = 0;
  for (double s : took) worst = s > worst ? s : worst;
  return worst;
}
"""
FLOPS_PER_PRODUCT = 16 * 16 * 32 * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.5, help="about how long each run takes")
    a = ap.parse_args()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists() or " amx_bf16" not in cpuinfo.read_text():
        raise SystemExit("this CPU has no AMX-BF16 tile unit (or this OS is not Linux)")
    build = loader.cache_root() / "kernels" / "tile_peak"
    build.mkdir(parents=True, exist_ok=True)
    mod = load_inline("batchlens_tile_peak", cpp_sources=SOURCE, functions=["tile_seconds"],
                      extra_cflags=["-O2", "-mamx-tile", "-mamx-bf16"], build_directory=str(build))
    iters = 1_000_000
    mod.tile_seconds(iters, 1)  # warm-up: the tile state, the clock
    per_round = mod.tile_seconds(iters, 1) / iters
    if per_round < 0:
        raise SystemExit("Linux refused this process the tile state (arch_prctl)")
    iters = max(1, int(a.seconds / per_round))
    for threads in sorted({1, torch.get_num_threads()}):
        s = mod.tile_seconds(iters, threads)
        tflops = 4 * iters * threads * FLOPS_PER_PRODUCT / s / 1e12
        print(f"tile unit, {threads} thread{'s' if threads > 1 else ''}: {tflops:.2f} TFLOPS "
              f"bfloat16 ({s / (4 * iters) * 1e9:.1f} ns a 16 x 16 x 32 product per core)")


if __name__ == "__main__":
    main()
