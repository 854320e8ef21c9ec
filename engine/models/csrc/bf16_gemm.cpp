// y = x W^T + b in bfloat16 on a CPU with AVX512_BF16 or AVX2: every matmul of the model,
// at any row count, in place of oneDNN's packed weights.
//
// At the few rows of a decode step a matmul only has to stream its weights once; oneDNN's
// packed layout reads them at about half the bandwidth a plain sum over them reaches.
// Here each weight is laid out [N/32][K/2][32][2]: two 64-byte loads hold a pair of K for
// 32 outputs, and each row's pair of x, broadcast, feeds one VDPBF16PS per load into
// float32 accumulators, with the weights `kPrefetch` pairs ahead prefetched.
// Threads split the 32-output blocks; within a block, rows go 12 at a time (24
// accumulators of the 32 vector registers), the block's weights staying in L2 after the
// first 12: each weight byte leaves memory once whatever the row count, and from ~16 rows
// on the tile is bound by its dot products. Two output vectors per tile, not one, halve
// the broadcasts per dot product, which makes 16-64 row steps about a quarter faster than
// one vector per tile.
//
// Without AVX512_BF16 (AVX2 and FMA: most x86 CPUs) the same layout is read by 32-byte
// loads, each pair of K widened to two float32 vectors by a shift and a mask (bfloat16 is
// the top half of a float32) and summed by two FMAs, rows 2 at a time (8 accumulators and
// 4 broadcasts of the 16 vector registers). There torch has no fast bfloat16 matmul at
// all, and a float32 model streams twice the bytes: at a decode step's few rows this
// kernel reads bfloat16 weights at memory speed, which is what makes bfloat16 the faster
// dtype on such a CPU (`engine.models.probe` times both).
//
//   x        [M, K] bfloat16, unit column stride (row stride free, even)
//   w        [N/32, K/2, 32, 2] bfloat16   (`linear.pack_for_kernel` of W [N, K])
//   bias     [N] or none
//   returns  [M, N] bfloat16, rounded once from float32 (to nearest even)
//
// A row's result does not depend on the other rows or on M: the same sums, in one order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool kSupported = true;
// Pairs of K ahead whose weights are prefetched (64 x 128 B = 8 KiB): into L1 for a tile
// of a few rows, quick over each pair of K, and into L2 for more rows. A core keeps few L1
// misses in flight, and a tile long over each pair would hold them from its own loads; a
// load that hits in L2 waits little. One row is the exception: its tile, quickest of all,
// streams faster with the weights 32 pairs (4 KiB) ahead into L2 (benchmarks.md).
template <int R>
constexpr int64_t kPrefetch = R == 1 ? 32 : 64;
template <int R>
constexpr auto kPrefetchHint = R >= 4 || R == 1 ? _MM_HINT_T1 : _MM_HINT_T0;
constexpr int64_t kTileRows = 12;  // 24 accumulators of the 32 vector registers

// Rows [0, R) of x against one 32-output block wb of the packed weight: 2R accumulators.
template <int R, bool kFromMemory>
inline void tile(const uint32_t* x, int64_t x_stride, const at::BFloat16* wb, int64_t kp,
                 const __m512* init, at::BFloat16* y, int64_t y_stride) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = init[0], acc[r][1] = init[1];
  for (int64_t k = 0; k < kp; ++k) {
    const at::BFloat16* wk = wb + k * 64;
    if (kFromMemory) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch<R> * 64), kPrefetchHint<R>);
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch<R> * 64 + 32), kPrefetchHint<R>);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
}

template <bool kFromMemory>
void tile_dispatch(int64_t rows, const uint32_t* x, int64_t xs, const at::BFloat16* wb,
                   int64_t kp, const __m512* init, at::BFloat16* y, int64_t ys) {
  switch (rows) {
#define BL_ROWS(R) \
  case R: tile<R, kFromMemory>(x, xs, wb, kp, init, y, ys); break;
    BL_ROWS(1) BL_ROWS(2) BL_ROWS(3) BL_ROWS(4) BL_ROWS(5) BL_ROWS(6)
    BL_ROWS(7) BL_ROWS(8) BL_ROWS(9) BL_ROWS(10) BL_ROWS(11) BL_ROWS(12)
#undef BL_ROWS
    default: TORCH_CHECK(false, "bf16_linear: 1-", kTileRows, " rows per tile, got ", rows);
  }
}

// A 32-output block's accumulators before the first K: its biases, or zeros (b: null)
struct BlockInit {
  __m512 v[2];
};
inline BlockInit block_init(const at::BFloat16* b) {
  if (b == nullptr) return {{_mm512_setzero_ps(), _mm512_setzero_ps()}};
  return {{load16(b), load16(b + 16)}};
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// With AMX (Sapphire Rapids and later), the same layout feeds the tile unit: a B tile is 16
// pairs of K for 16 outputs, 64 bytes of each 128-byte row of the block, so one block is two
// B tiles 64 bytes apart, each loaded with a 128-byte stride; an A tile is 16 rows of 32 K
// of x. One TDPBF16PS does 16 x 16 x 32 multiply-adds, so a block of 32 rows and 32 outputs
// (four C tiles, two A, two B: all eight tiles) keeps the unit busy from ~32 rows on, where
// the VDPBF16PS tiles above run at a tenth of its speed. At a decode step's few rows the
// tile unit still reads a 2 KiB slice of the block's weights per 32 K faster than memory
// delivers it, so every row count takes this path: a row's result still does not depend on
// M. Past 16 rows, rows are padded to a multiple of 16 with zeros (a tile reads 16 rows);
// K must be a multiple of 32.
constexpr int64_t kAmxK = 32;     // K per tile step
constexpr int64_t kAmxRows = 16;  // rows per A and C tile
constexpr int64_t kLead = 4096;  // bytes of weights fetched ahead into L1, up to 16 rows
constexpr int64_t kGroupBytes = 256 * 1024;  // weights of a group of blocks, past 32 rows

// Linux hands out the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM)
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate C (row tile i, output half j in 2i + j), 4-5 hold A, 6-7 hold B;
// the A tiles and the first row tile's C hold `rows` rows (fewer than 16 only where M is).
inline void amx_configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = kAmxRows;
  c.rows[0] = c.rows[1] = c.rows[4] = c.rows[5] = static_cast<uint8_t>(rows);
  // GCC's tile intrinsics do not tell it they read or write memory: the barriers keep
  // the stores to c (and, below, the reads of the stored C tiles) where they are
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

// Weights fetched ahead while this block's products run: `lines` cache lines from `at` per
// slice of 32 K (none where at is null), clipped at `end`. Past 16 rows, the next block into
// L2; up to 16, the weights kLead bytes ahead of the tile loads into L1.
struct Ahead {
  const char* at;
  const char* end;
  int64_t lines;
  inline void step() {  // a slice's lines, into L1 (up to 16 rows)
    if (at == nullptr) return;
    for (int64_t i = 0; i < lines && at < end; ++i, at += 64) _mm_prefetch(at, _MM_HINT_T0);
  }
  inline void quarter(int i) {  // the i-th quarter (0-3) of a slice's lines, into L2
    if (at == nullptr) return;
    const int64_t n = lines * (i + 1) / 4 - lines * i / 4;
    for (int64_t j = 0; j < n && at < end; ++j, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

// C tiles for up to 16 rows of x (one row tile, from xr) against one 32-output block wb,
// stored to c [16][32] float32, with `ahead` streaming the weights into L1: the tile loads
// wait on memory whatever they do, so each slice's lines go at its start (Ahead::step).
inline void amx_tile_few(const char* xr, int64_t x_bytes, const char* wb, int64_t k, float* c,
                         Ahead& ahead) {
  _tile_zero(0);
  _tile_zero(1);
  int64_t k0 = 0;
  // one row tile leaves tiles 2, 3 and 5 free: every other 32 K loads its A and B tiles
  // into those, so the next slice's loads need not wait for this one's products
  for (; k0 + 2 * kAmxK <= k; k0 += 2 * kAmxK) {
    ahead.step();
    ahead.step();
    const char* wk = wb + k0 * 64;
    _tile_loadd(6, wk, 128);
    _tile_loadd(7, wk + 64, 128);
    _tile_loadd(4, xr + k0 * 2, x_bytes);
    _tile_loadd(2, wk + kAmxK * 64, 128);
    _tile_loadd(3, wk + kAmxK * 64 + 64, 128);
    _tile_loadd(5, xr + (k0 + kAmxK) * 2, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 2);
    _tile_dpbf16ps(1, 5, 3);
  }
  for (; k0 < k; k0 += kAmxK) {
    ahead.step();
    const char* wk = wb + k0 * 64;  // 16 rows of 128 bytes: pairs k0/2 .. k0/2 + 15
    _tile_loadd(6, wk, 128);
    _tile_loadd(7, wk + 64, 128);
    _tile_loadd(4, xr + k0 * 2, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  asm volatile("" ::: "memory");
}

// C tiles for RT row tiles of x (16 rows each, from xr) against one 32-output block wb,
// stored to c [16 RT][32] float32, past 16 rows, where `ahead` fetches into L2 while the
// products run. kStream: the block's B tiles by TILELOADDT1, which leaves them out of L1
// for the rows' A tiles to stay there. Each slice's lines go in quarters between its tile
// ops (Ahead::quarter): in one burst, the prefetches past the core's few misses in flight
// hold up the tile loads queued behind them, and the products wait on those.
// Out of line, and `lines` opaque in gemm_amx_few: a batch-1 step's speed moves with how the
// compiler builds and places the few-row fetch loop (how fast it sends its prefetches):
// the other arrangements tried streamed a batch-1 step's weights slower (benchmarks.md).
// A change here wants `scripts/bf16_matmul_bench.py --against` at 1 row.
template <int RT, bool kStream>
__attribute__((noinline)) void amx_tile(const char* xr, int64_t x_bytes, const char* wb,
                                        int64_t k, float* c, Ahead& ahead) {
  _tile_zero(0);
  _tile_zero(1);
  if (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kAmxK) {
    const char* wk = wb + k0 * 64;  // 16 rows of 128 bytes: pairs k0/2 .. k0/2 + 15
    ahead.quarter(0);
    if (kStream) {
      _tile_stream_loadd(6, wk, 128);
      _tile_stream_loadd(7, wk + 64, 128);
    } else {
      _tile_loadd(6, wk, 128);
      _tile_loadd(7, wk + 64, 128);
    }
    _tile_loadd(4, xr + k0 * 2, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    ahead.quarter(1);
    _tile_dpbf16ps(1, 4, 7);
    ahead.quarter(2);
    if (RT == 2) {
      _tile_loadd(5, xr + kAmxRows * x_bytes + k0 * 2, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
    }
    ahead.quarter(3);
    if (RT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (RT == 2) {
    _tile_stored(2, c + kAmxRows * 32, 128);
    _tile_stored(3, c + kAmxRows * 32 + 16, 128);
  }
  asm volatile("" ::: "memory");
}

// c rows [0, rows) plus the bias, rounded to bfloat16, into y (row stride ys)
inline void amx_write(const float* c, int64_t rows, const at::BFloat16* bias, at::BFloat16* y,
                      int64_t ys) {
  const BlockInit b = block_init(bias);
  for (int64_t r = 0; r < rows; ++r)
    for (int v = 0; v < 2; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(
                              _mm512_add_ps(_mm512_loadu_ps(c + r * 32 + v * 16), b.v[v])));
}

// x [m, k] (row stride xs elements; m up to 16) against every block of w. Up to 16 rows the
// tiles wait on memory whatever they do, and their loads alone keep too few reads in
// flight: each slice fetches the 32 lines kLead bytes ahead into L1, a stream across the
// thread's blocks.
void gemm_amx_few(const at::BFloat16* x, int64_t xs, const at::BFloat16* w,
                  const at::BFloat16* bias, at::BFloat16* y, int64_t m, int64_t k, int64_t n) {
  const int64_t x_bytes = xs * 2;
  at::parallel_for(0, n / 32, 1, [&](int64_t b0, int64_t b1) {
    amx_configure(static_cast<int>(m));
    alignas(64) float c[kAmxRows * 32];
    const int64_t block_bytes = k * 64;
    const char* thread_end = reinterpret_cast<const char*>(w + b1 * k * 32);
    for (int64_t i = 0; i < std::min(kLead, block_bytes); i += 64)  // the stream's first bytes
      _mm_prefetch(reinterpret_cast<const char*>(w + b0 * k * 32) + i, _MM_HINT_T0);
    const char* xr = reinterpret_cast<const char*>(x);
    int64_t lines = kAmxK;  // opaque to the compiler (see amx_tile)
    asm volatile("" : "+r"(lines));
    for (int64_t b = b0; b < b1; ++b) {
      const char* wb = reinterpret_cast<const char*>(w + b * k * 32);
      Ahead ahead{wb + kLead, thread_end, lines};
      amx_tile_few(xr, x_bytes, wb, k, c, ahead);
      amx_write(c, m, bias != nullptr ? bias + b * 32 : nullptr, y + b * 32, n);
    }
    _tile_release();
  });
}

// x [mp, k] (row stride xs elements; mp a multiple of 16, past 16 rows) against every
// block of w
void gemm_amx(const at::BFloat16* x, int64_t xs, const at::BFloat16* w,
              const at::BFloat16* bias, at::BFloat16* y, int64_t m, int64_t mp, int64_t k,
              int64_t n) {
  if (mp <= kAmxRows) return gemm_amx_few(x, xs, w, bias, y, m, k, n);
  const int64_t x_bytes = xs * 2;
  at::parallel_for(0, n / 32, 1, [&](int64_t b0, int64_t b1) {
    amx_configure(kAmxRows);
    alignas(64) float c[2 * kAmxRows * 32];
    // A block's products take as long as its weights take to arrive: the weights of the
    // blocks to come are fetched into L2 meanwhile, or each block would wait on memory
    // first and compute after. Past 32 rows (more than one pass over the rows) the blocks
    // go in groups that stay in L2, each pass over the rows running over the whole group: a
    // pass's rows (A tiles) then stay in L1 across the group's blocks, whose B tiles, from
    // L2 on every pass, load around L1 (as they do in a single pass, read once). A block
    // taking all its passes in turn would load the A tiles from L2 for every block, and
    // those tile moves cost more than the products. The first pass fetches the group's next
    // block, a whole block per block (k / 32 slices of 32 lines); the last pass fetches the
    // next group's first block, a share per block.
    const int64_t passes = (mp + 2 * kAmxRows - 1) / (2 * kAmxRows);
    const int64_t block_bytes = k * 64;
    const int64_t group = passes > 1 ? std::max<int64_t>(1, kGroupBytes / block_bytes) : 1;
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group), in_group = g1 - g0;
      const char* next_group = reinterpret_cast<const char*>(w + g1 * k * 32);
      const int64_t share = (k + in_group - 1) / in_group * 64;  // of its first block
      for (int64_t r = 0; r < mp; r += 2 * kAmxRows) {
        const char* xr = reinterpret_cast<const char*>(x + r * xs);
        const int64_t tiles = mp - r >= 2 * kAmxRows ? 2 : 1;
        const bool first = r == 0, last = r + 2 * kAmxRows >= mp;
        for (int64_t b = g0; b < g1; ++b) {
          const char* wb = reinterpret_cast<const char*>(w + b * k * 32);
          const at::BFloat16* bb = bias != nullptr ? bias + b * 32 : nullptr;
          Ahead ahead{nullptr, nullptr, 0};
          if (first && b + 1 < g1) {
            ahead = Ahead{wb + block_bytes, wb + 2 * block_bytes, kAmxK};
          } else if (last && g1 < b1) {
            const char* from = next_group + (b - g0) * share;
            ahead = Ahead{from, std::min(from + share, next_group + block_bytes),
                          (kAmxK + in_group - 1) / in_group};
          }
          if (tiles == 1)
            amx_tile<1, false>(xr, x_bytes, wb, k, c, ahead);
          else
            amx_tile<2, true>(xr, x_bytes, wb, k, c, ahead);
          const int64_t rows = m - r < tiles * kAmxRows ? m - r : tiles * kAmxRows;
          amx_write(c, rows, bb, y + r * n + b * 32, n);
        }
      }
    }
    _tile_release();
  });
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kSupported = true;
constexpr int64_t kPrefetch = 64;  // pairs of K ahead (64 x 128 B = 8 KiB)
constexpr int64_t kTileRows = 2;   // 8 accumulators + 4 broadcasts of the 16 registers

// Rows [0, R) of x against one 32-output block wb: 4R accumulators of 8 outputs.
template <int R, bool kFromMemory>
inline void tile(const uint32_t* x, int64_t x_stride, const at::BFloat16* wb, int64_t kp,
                 const __m256* init, at::BFloat16* y, int64_t y_stride) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = init[v];
  for (int64_t k = 0; k < kp; ++k) {
    const at::BFloat16* wk = wb + k * 64;
    if (kFromMemory) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * 64 + 32), _MM_HINT_T0);
    }
    __m256 xe[R], xo[R];  // x[r][2k] and x[r][2k + 1], broadcast
    for (int r = 0; r < R; ++r) {
      const __m256i xr = _mm256_set1_epi32(static_cast<int>(x[r * x_stride + k]));
      xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xr, 16));
      xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xr, high));
    }
    for (int v = 0; v < 4; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + v * 16));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm256_fmadd_ps(wo, xo[r], _mm256_fmadd_ps(we, xe[r], acc[r][v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) {  // round to nearest even, keep the top half
      __m256i bits = _mm256_castps_si256(acc[r][v]);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      bits = _mm256_srli_epi32(
          _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
      // packus works per 128-bit lane: [b0-3 b0-3 | b4-7 b4-7] -> b0-7 in the low lane
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * y_stride + v * 8),
                       _mm256_castsi256_si128(packed));
    }
}

template <bool kFromMemory>
void tile_dispatch(int64_t rows, const uint32_t* x, int64_t xs, const at::BFloat16* wb,
                   int64_t kp, const __m256* init, at::BFloat16* y, int64_t ys) {
  if (rows == 2)
    tile<2, kFromMemory>(x, xs, wb, kp, init, y, ys);
  else
    tile<1, kFromMemory>(x, xs, wb, kp, init, y, ys);
}

struct BlockInit {
  __m256 v[4];
};
inline BlockInit block_init(const at::BFloat16* b) {
  if (b == nullptr)
    return {{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}};
  return {{load8(b), load8(b + 8), load8(b + 16), load8(b + 24)}};
}
#else
constexpr bool kSupported = false;
#endif

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
// Threads split the 32-output blocks; a block's rows go a tile at a time, the first tile
// streaming the block's weights from memory, the rest reading them from cache.
void gemm(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w,
          const at::BFloat16* bias, at::BFloat16* y, int64_t m, int64_t k, int64_t n) {
  const int64_t kp = k / 2, xs = x_stride / 2;  // in pairs of K
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  at::parallel_for(0, n / 32, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const at::BFloat16* wb = w + b * kp * 64;
      const BlockInit init = block_init(bias != nullptr ? bias + b * 32 : nullptr);
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int64_t rows = m - r < kTileRows ? m - r : kTileRows;
        if (r == 0)
          tile_dispatch<true>(rows, xp, xs, wb, kp, init.v, y + b * 32, n);
        else
          tile_dispatch<false>(rows, xp + r * xs, xs, wb, kp, init.v, y + r * n + b * 32, n);
      }
    }
  });
}
#endif

}  // namespace

namespace batchlens {

bool bf16_linear_supported() { return kSupported; }

bool bf16_linear_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_ready();
#else
  return false;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
  // bf16_linear_into checks x and w (of a wrong rank, y is made empty here)
  auto y = at::empty({x.dim() == 2 ? x.size(0) : 0, w.dim() == 4 ? w.size(0) * 32 : 0},
                     x.options());
  bf16_linear_into(x, w, bias, y);
  return y;
}

void bf16_linear_into(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, const at::Tensor& y) {
  TORCH_CHECK(kSupported, "bf16_linear: built without AVX512_BF16 or AVX2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1
              && x.stride(0) % 2 == 0, "bf16_linear: x must be [M, K] bfloat16 with unit "
              "column stride and an even row stride");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 32 && w.size(3) == 2 && w.is_contiguous()
              && w.scalar_type() == at::kBFloat16, "bf16_linear: w must be packed "
              "[N/32, K/2, 32, 2] bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0) * 32;
  TORCH_CHECK(k == w.size(1) * 2, "bf16_linear: x has K=", k, ", w has K=", w.size(1) * 2);
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n
                && bias->scalar_type() == at::kBFloat16, "bf16_linear: bias must be [N]");
    b = bias->data_ptr<at::BFloat16>();
  }
  TORCH_CHECK(y.sizes() == at::IntArrayRef({m, n}) && y.is_contiguous() &&
                  y.scalar_type() == at::kBFloat16,
              "bf16_linear: the output must be a contiguous [M, N] bfloat16 tensor");
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  if (m == 0) return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready() && k % kAmxK == 0) {
    // under 16 rows the tiles hold M rows; else a tile reads 16: pad x with zero rows to a
    // multiple of 16
    const int64_t mp = m < kAmxRows ? m : (m + kAmxRows - 1) / kAmxRows * kAmxRows;
    at::Tensor xp = x;
    if (mp != m) {
      xp = at::zeros({mp, k}, x.options());
      xp.narrow(0, 0, m).copy_(x);
    }
    gemm_amx(xp.data_ptr<at::BFloat16>(), xp.stride(0), w.data_ptr<at::BFloat16>(), b,
             y.data_ptr<at::BFloat16>(), m, mp, k, n);
    return;
  }
#endif
  gemm(x.data_ptr<at::BFloat16>(), x.stride(0), w.data_ptr<at::BFloat16>(), b,
       y.data_ptr<at::BFloat16>(), m, k, n);
#endif
}

}  // namespace batchlens

TORCH_LIBRARY_FRAGMENT(batchlens, m) {
  m.def("bf16_linear_supported() -> bool", &batchlens::bf16_linear_supported);
  m.def("bf16_linear_amx() -> bool", &batchlens::bf16_linear_amx);
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchlens, CPU, m) {
  m.impl("bf16_linear", &batchlens::bf16_linear);
}
