"""What this machine's memory gives a reader of scattered blocks, with no model: the ceiling
that decode attention over a paged KV cache meets before any kernel of ours.

A 512 MiB buffer on 2 MiB pages (as the engine's pool) is read whole by `torch.sum` (as
`measure.calibrate` reads), then in chunks of `--chunk` bytes (default 4 KiB: what decode
attention reads of one block for one kv head in the bundled model, its K and then its V,
16 tokens x 64 dims x 2 bytes each, one run in the pool), on every thread: in order,
shuffled, and shuffled with each chunk's lines prefetched `ahead` chunks early into L1
(T0) or L2 (T1), as `KeyWalk` does in csrc/paged_attention.cpp. Then
the same shuffled walk with arithmetic on every line read (`--work` FMA rounds per 128
bytes), against that arithmetic alone on chunks that stay in L2: where the two overlap, the
time is the larger of "memory" and "compute"; where they do not, it is their sum.

Each figure is the best of `--rounds`, in GB/s and as a share of `measure.calibrate`'s
bandwidth, measured in the same run (it moves from minute to minute on a shared host).

    PYTHONPATH=. python scripts/memory_probe.py [--rounds N] [--work N] [--ahead N]
                                                [--chunk BYTES]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from engine import compute
from engine.memory import pages
from engine.models import native
from measure.calibrate import calibrate

BUFFER = 512 << 20

SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

// a whole 64-byte line per load where the CPU has AVX-512 (as the kernels read), else half
#if defined(__AVX512F__)
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const char* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm512_store_ps(p, v); }
#else
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const char* p) {
  return _mm256_add_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(p)),
                       _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32)));
}
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm256_store_ps(p, v); }
#endif

// Reads the chunks of `buf` in `order`, the threads splitting it, prefetching the lines
// of the chunk `ahead` places on (hint 0: none, 1: T0, 2: T1), with `work` rounds of two
// FMAs (vectors of V) on each pair of 64-byte lines read. Returns a sum, so that
// nothing is optimised away.
double walk(torch::Tensor buf, torch::Tensor order, int64_t chunk, int64_t ahead,
            int64_t hint, int64_t work) {
  const char* base = static_cast<const char*>(buf.data_ptr());
  const int32_t* ord = order.data_ptr<int32_t>();
  const int64_t n = order.numel(), nt = at::get_num_threads();
  std::vector<double> sums(nt, 0.0);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
      V acc[8];
      for (auto& a : acc) a = vzero();
      for (int64_t i = lo; i < hi; ++i) {
        const char* p = base + int64_t{ord[i]} * chunk;
        if (hint != 0 && i + ahead < hi) {
          const char* f = base + int64_t{ord[i + ahead]} * chunk;
          for (int64_t b = 0; b < chunk; b += 64) {
            if (hint == 1) _mm_prefetch(f + b, _MM_HINT_T0);
            else _mm_prefetch(f + b, _MM_HINT_T1);
          }
        }
        for (int64_t b = 0; b < chunk; b += 128) {
          const V x = vload(p + b), y = vload(p + b + 64);  // two lines
          acc[0] = vadd(acc[0], x);
          acc[1] = vadd(acc[1], y);
          for (int64_t w = 0; w < work; ++w) {
            acc[2 + (2 * w) % 6] = vfma(x, y, acc[2 + (2 * w) % 6]);
            acc[3 + (2 * w) % 6] = vfma(y, x, acc[3 + (2 * w) % 6]);
          }
        }
      }
      V s = acc[0];
      for (int a = 1; a < 8; ++a) s = vadd(s, acc[a]);
      alignas(64) float lanes[sizeof(V) / 4];
      vstore(lanes, s);
      for (float v : lanes) sums[t] += v;
    }
  });
  double total = 0;
  for (double v : sums) total += v;
  return total;
}
"""


def build() -> Any:
    """The probe's module (`walk`), built once into torch's extension cache with the
    kernels' own flags: OpenMP above all, without which at::parallel_for runs one thread."""
    return load_inline("batchlens_memory_probe", cpp_sources=SOURCE, functions=["walk"],
                       extra_cflags=native.cflags(), verbose=False)


def best_s(fn: Callable[[], object], rounds: int) -> float:
    """The fastest of `rounds` calls of `fn`, after one to warm up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe(rounds: int, work: int, ahead: int, chunk: int, bandwidth: float) -> None:
    """Print each read's rate against `bandwidth` (GB/s), then the overlap figure."""
    mod = build()
    buf = pages.empty((BUFFER,), torch.uint8).fill_(1)
    n = BUFFER // chunk
    in_order = torch.arange(n, dtype=torch.int32)
    shuffled = in_order[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    in_l2 = in_order % (256 * 1024 // chunk)  # 256 KiB, read over and over: the arithmetic alone

    def gbs(order: torch.Tensor, hint: int, w: int) -> tuple[float, float]:
        secs = best_s(lambda: mod.walk(buf, order, chunk, ahead, hint, w), rounds)
        return BUFFER / secs / 1e9, secs * 1e3

    print(f"memory probe: {BUFFER >> 20} MiB in {chunk}-byte chunks, {torch.get_num_threads()} "
          f"threads, best of {rounds}; calibrated bandwidth {bandwidth:.1f} GB/s")
    as_float = buf.view(torch.float32)
    rate = BUFFER / best_s(as_float.sum, rounds) / 1e9
    print(f"  {'in order, torch.sum (calibrate)':<32} {rate:6.1f} GB/s ({rate / bandwidth:4.0%})")
    rows = [("in order", in_order, 0), ("shuffled", shuffled, 0),
            (f"shuffled, L1 prefetch {ahead} ahead", shuffled, 1),
            (f"shuffled, L2 prefetch {ahead} ahead", shuffled, 2)]
    for name, order, hint in rows:
        rate, memory_ms = gbs(order, hint, 0)  # the last row's: the walk without arithmetic
        print(f"  {name:<32} {rate:6.1f} GB/s ({rate / bandwidth:4.0%})")
    _, compute_ms = gbs(in_l2, 0, work)
    rate, both_ms = gbs(shuffled, 2, work)
    overlap = (memory_ms + compute_ms - both_ms) / min(memory_ms, compute_ms)
    print(f"  with {work} FMA rounds per 128 bytes: memory {memory_ms:.1f} ms, compute "
          f"(in L2) {compute_ms:.1f} ms, both {both_ms:.1f} ms ({rate:.1f} GB/s, "
          f"{rate / bandwidth:.0%}): {overlap:.0%} of the smaller one hidden")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=int, default=4, help="FMA rounds per 128 bytes read")
    ap.add_argument("--ahead", type=int, default=8, help="chunks ahead to prefetch")
    ap.add_argument("--chunk", type=int, default=4096,
                    help="bytes read in a run (a multiple of 128, up to 256 KiB)")
    a = ap.parse_args()
    if a.chunk < 128 or a.chunk % 128 or a.chunk > 256 * 1024:
        raise SystemExit(f"--chunk must be a multiple of 128 bytes up to 256 KiB, got {a.chunk}")
    cal = calibrate(fresh=True)
    # on the compute thread, as the engine's kernels run and as `calibrate` measured
    compute.run(probe, a.rounds, a.work, a.ahead, a.chunk, cal.bandwidth_gbs)


if __name__ == "__main__":
    main()
