"""Probe for issue 18: a small-row bfloat16 GEMM with software prefetch against oneDNN.

Not used by the engine yet. It times SmolLM2-135M's 120 layer matmuls (QKV, O, gate/up,
down; weights far past the caches) at 1, 4, 8 and 16 rows two ways: oneDNN's packed weights
(`engine.models.linear.Linear`, what a decode step runs today) and a ~30-line AVX512-BF16
kernel compiled here, with the weight laid out as [N/16][K/2][16][2] so that each 64-byte
load feeds one VDPBF16PS per row, 16 outputs at a time, and prefetched `--dist` pairs of K
ahead. Needs g++ and a CPU with AVX512_BF16.

    python scripts/small_m_gemm_probe.py [--dist 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LAYERS = 30
ROWS = (1, 4, 8, 16)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

template <int M>
void run(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N,
         int64_t dist) {
  const int64_t KP = K / 2;
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
    for (int64_t b = b0; b < b1; ++b) {
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      const at::BFloat16* wb = w + b * KP * 32;
      for (int64_t k = 0; k < KP; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + (k + dist) * 32), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + k * 32);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(xp[m * KP + k]), wv);
      }
      for (int m = 0; m < M; ++m)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + b * 16),
                            (__m256i)_mm512_cvtneps_pbh(acc[m]));
    }
  });
}

torch::Tensor gemm(torch::Tensor x, torch::Tensor w, int64_t n, int64_t dist) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && k % 2 == 0 && n % 16 == 0, "shape");
  auto y = torch::empty({m, n}, x.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  switch (m) {
    case 1: run<1>(xp, wp, yp, k, n, dist); break;
    case 4: run<4>(xp, wp, yp, k, n, dist); break;
    case 8: run<8>(xp, wp, yp, k, n, dist); break;
    case 16: run<16>(xp, wp, yp, k, n, dist); break;
    default: TORCH_CHECK(false, "rows must be 1, 4, 8 or 16");
  }
  return y;
}
"""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16][K/2][16][2]: 16 outputs x one pair of K per 64-byte row."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def median_ms(fn: Callable[[], object], reps: int = 15) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dist", type=int, default=64, help="prefetch distance in K pairs")
    a = ap.parse_args()
    from engine.models.linear import Linear

    mod = load_inline("batchlens_small_m_probe", cpp_sources=SOURCE, functions=["gemm"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
    gen = torch.Generator().manual_seed(0)
    raw = [[torch.randn(o, i, generator=gen).bfloat16() for o, i in SHAPES]
           for _ in range(LAYERS)]
    onednn = [[Linear(w, pack=True) for w in layer] for layer in raw]
    ours = [[pack(w) for w in layer] for layer in raw]
    x = torch.randn(4, 576, generator=gen).bfloat16()
    want = F.linear(x, raw[0][2]).float()
    err = (mod.gemm(x, ours[0][2], 3072, a.dist).float() - want).abs().max() / want.abs().max()
    print(f"{LAYERS * len(SHAPES)} layer matmuls of SmolLM2-135M, bfloat16, "
          f"{torch.get_num_threads()} threads; largest error against F.linear {err:.1e} "
          f"of the largest output")
    for m in ROWS:
        xs = {i: torch.randn(m, i, generator=gen).bfloat16() for _, i in SHAPES}
        t_onednn = median_ms(lambda xs=xs: [lin(xs[i]) for layer in onednn
                                            for lin, (_, i) in zip(layer, SHAPES, strict=True)])
        t_ours = median_ms(lambda xs=xs: [mod.gemm(xs[i], w, o, a.dist) for layer in ours
                                          for w, (o, i) in zip(layer, SHAPES, strict=True)])
        print(f"  {m:2d} rows: oneDNN packed {t_onednn:6.2f} ms, probe {t_ours:6.2f} ms "
              f"({t_onednn / t_ours:.2f}x)")


if __name__ == "__main__":
    main()
