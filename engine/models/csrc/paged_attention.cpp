// Decode attention that reads the paged KV cache in place, one pass over each block.
//
// For every (request, kv head) pair, in parallel: walk the request's block table, score
// the block's keys against the query heads that share this kv head, and fold the block
// into a running softmax (max, sum, weighted V) kept in float32. Each K/V byte is read
// once; nothing is gathered into a padded copy first. The AVX-512 path scores 16 keys at a
// time and sums the 16 dot products across lanes together (hsum16), by bfloat16 dot
// instructions where the CPU has them (AVX512_BF16).
//
//   q        [S, H, D]                  one new token per request
//   k_cache  [KVH, NUM_BLOCKS, BS, D]   v_cache alike
//   tables   [S, MAX_BLOCKS] int32      block table per request (padding unused)
//   lens     [S] int32                  context length per request (incl. the new token)
//   returns  [S, H, D]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename scalar_t>
void decode(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* tables,
            const int32_t* lens, scalar_t* out, int64_t S, int64_t H, int64_t KVH,
            int64_t NB, int64_t BS, int64_t D, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  // finite, so the running max never meets inf - inf
  constexpr float kLowest = -std::numeric_limits<float>::max();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(BS * D), score(BS), m(G), l(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / KVH, h = w % KVH;
      const scalar_t* qs = q + (s * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(qs[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kLowest);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[s];
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t blk = tables[s * max_blocks + b];
        const int64_t n = std::min(BS, len - b * BS);
        const int64_t off = ((h * NB + blk) * BS) * D;
        const scalar_t* kb = kc + off;
        const scalar_t* vb = vc + off;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sc = score.data();
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* kt = kb + t * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kt[d]);
            sc[t] = dot;
          }
          float bmax = m[g];
#pragma omp simd reduction(max : bmax)
          for (int64_t t = 0; t < n; ++t) bmax = std::max(bmax, sc[t]);
          const float corr = std::exp(m[g] - bmax);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sc[t] = std::exp(sc[t] - bmax);
            sum += sc[t];
          }
          m[g] = bmax;
          l[g] = l[g] * corr + sum;
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sc[t];
            const scalar_t* vt = vb + t * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vt[d]);
          }
        }
      }
      scalar_t* os = out + (s * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) os[g * D + d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 bfloat16 values -> 16 floats (bfloat16 is the top half of a float32)
inline __m512 load_bf16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0: 2^(x log2 e) = 2^k * 2^f with |f| <= 1/2, 2^f by its Taylor series to
// degree 7 (relative error < 1e-8, below float32 rounding), 2^k applied by scalef.
inline __m512 exp_ps(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, k), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// Lane t of the result is the sum of v[t]'s 16 lanes: 16 horizontal sums in 15 adds
// (one _mm512_reduce_add_ps per vector costs about as many instructions for each one).
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // pairs of vectors: two partial sums of each per 128-bit lane
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // x[i]: per 128-bit lane, one sum each of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // add the four 128-bit lanes of x[i] into lane group i of the result
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44),
                                   _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44),
                                   _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                       _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

#if defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;  // q·k by VDPBF16PS: bfloat16 pairs, summed in float32
#else
constexpr bool kDotBf16 = false;
#endif

constexpr int kMaxG = 8;    // query heads per kv head handled in registers
constexpr int kMaxDV = 16;  // head_dim / 16 handled in registers (head_dim <= 256)

// The bfloat16 kernel for head_dim % 16 == 0: one pass per block of up to 16 keys.
bool decode_bf16_avx512(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                        const int32_t* tables, const int32_t* lens, at::BFloat16* out, int64_t S,
                        int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t D,
                        int64_t max_blocks, float scale) {
  const int64_t G = H / KVH, DV = D / 16;
  if (D % 16 != 0 || DV > kMaxDV || G > kMaxG) return false;
  const bool dot_bf16 = kDotBf16 && D % 32 == 0;
  // parallel_for hands each thread one contiguous range; decode rows arrive sorted by
  // length, so deal the (request, kv head) pairs out round-robin to balance the work
  const int64_t N = S * KVH, nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N));
  const int64_t per = (N + nt - 1) / nt;
  at::parallel_for(0, per * nt, per, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[kMaxG][kMaxDV * 16];
    alignas(64) float acc[kMaxG][kMaxDV * 16];
    alignas(64) float prob[kMaxG][16];
    float m[kMaxG], l[kMaxG];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t w = (i % per) * nt + i / per;
      if (w >= N) continue;
      const int64_t s = w / KVH, h = w % KVH;
#if defined(__AVX512BF16__)
      __m512bh qb[kMaxG][kMaxDV / 2];
      if (dot_bf16)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < D / 32; ++j)
            qb[g][j] = (__m512bh)_mm512_loadu_si512(q + (s * H + h * G + g) * D + 32 * j);
#endif
      for (int64_t g = 0; g < G; ++g) {
        const at::BFloat16* qs = q + (s * H + h * G + g) * D;
        for (int64_t j = 0; j < DV; ++j) {
          _mm512_store_ps(qf[g] + 16 * j, _mm512_mul_ps(load_bf16(qs + 16 * j), _mm512_set1_ps(scale)));
          _mm512_store_ps(acc[g] + 16 * j, _mm512_setzero_ps());
        }
        m[g] = -std::numeric_limits<float>::max();
        l[g] = 0.f;
      }
      const int64_t len = lens[s];
      const int32_t* table = tables + s * max_blocks;
      // cache row offsets of 16 keys at a time (this chunk's and the next one's), walking
      // the block table with counters rather than dividing by the block size per key
      int64_t rows[2][16];
      int64_t blk_i = 0, in_blk = 0;
      auto fill = [&](int64_t* r, int64_t count) {
        for (int64_t t = 0; t < count; ++t) {
          r[t] = ((h * NB + table[blk_i]) * BS + in_blk) * D;
          if (++in_blk == BS) in_blk = 0, ++blk_i;
        }
      };
      fill(rows[0], std::min<int64_t>(16, len));
      for (int64_t start = 0, cur = 0; start < len; start += 16, cur ^= 1) {
        const int64_t n = std::min<int64_t>(16, len - start);
        const int64_t* row = rows[cur];
        if (start + 16 < len) {  // fetch the next 16 keys and values while these are scored
          int64_t* next = rows[cur ^ 1];
          const int64_t count = std::min<int64_t>(16, len - start - 16);
          fill(next, count);
          for (int64_t t = 0; t < count; ++t)
            for (int64_t c = 0; c < D; c += 32) {
              _mm_prefetch(reinterpret_cast<const char*>(kc + next[t] + c), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(vc + next[t] + c), _MM_HINT_T0);
            }
        }
        // scores of these keys for every query head: lane t of x[g] is q_g · k_t * scale
        __m512 x[kMaxG];
        for (int64_t g = 0; g < G; ++g) {
          __m512 dots[16];
          for (int64_t t = 0; t < 16; ++t) {
            __m512 a = _mm512_setzero_ps();
            if (t < n) {
              const at::BFloat16* kt = kc + row[t];
#if defined(__AVX512BF16__)
              if (dot_bf16) {
                for (int64_t j = 0; j < D / 32; ++j)
                  a = _mm512_dpbf16_ps(a, qb[g][j], (__m512bh)_mm512_loadu_si512(kt + 32 * j));
                dots[t] = a;
                continue;
              }
#endif
              for (int64_t j = 0; j < DV; ++j)
                a = _mm512_fmadd_ps(_mm512_load_ps(qf[g] + 16 * j), load_bf16(kt + 16 * j), a);
            }
            dots[t] = a;
          }
          x[g] = dot_bf16 ? _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)) : hsum16(dots);
        }
        const __mmask16 valid = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
        float corr[kMaxG];
        for (int64_t g = 0; g < G; ++g) {
          const float bmax = std::max(m[g], _mm512_mask_reduce_max_ps(valid, x[g]));
          const __m512 p =
              _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(x[g], _mm512_set1_ps(bmax))));
          _mm512_store_ps(prob[g], p);
          corr[g] = std::exp(m[g] - bmax);
          l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(p);
          m[g] = bmax;
        }
        __m512 av[kMaxG][kMaxDV];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < DV; ++j)
            av[g][j] = _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * j), _mm512_set1_ps(corr[g]));
        for (int64_t t = 0; t < n; ++t) {
          const at::BFloat16* vt = vc + row[t];
          for (int64_t j = 0; j < DV; ++j) {
            const __m512 v = load_bf16(vt + 16 * j);
            for (int64_t g = 0; g < G; ++g)
              av[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(prob[g][t]), v, av[g][j]);
          }
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < DV; ++j) _mm512_store_ps(acc[g] + 16 * j, av[g][j]);
      }
      for (int64_t g = 0; g < G; ++g) {
        at::BFloat16* os = out + (s * H + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) os[d] = static_cast<at::BFloat16>(acc[g][d] * inv);
      }
    }
  });
  return true;
}
#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [S, H, D], caches [KVH, NB, BS, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && context_lens.numel() == S,
              "block_tables must be [S, max_blocks] and context_lens [S]");
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  const int64_t max_blocks = bt.size(1);
  // a wrong table or length would read outside the cache: check them all (cheap next to
  // the attention itself)
  const int32_t* tp = bt.data_ptr<int32_t>();
  const int32_t* lp = cl.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= max_blocks * BS, "context_lens[", s, "] = ", lp[s],
                " is outside [1, max_blocks * block_size]");
    for (int64_t b = 0; b * BS < lp[s]; ++b)
      TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < NB,
                  "block_tables[", s, "][", b, "] is not a block of the cache");
  }
  auto out = at::empty_like(qc);
#if defined(__AVX512F__)
  if (qc.scalar_type() == at::kBFloat16 &&
      decode_bf16_avx512(qc.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(),
                         vc.data_ptr<at::BFloat16>(), bt.data_ptr<int32_t>(),
                         cl.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), S, H, KVH, NB, BS,
                         D, max_blocks, static_cast<float>(scale)))
    return out;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(qc.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                     bt.data_ptr<int32_t>(), cl.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), S,
                     H, KVH, NB, BS, D, max_blocks, static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(batchlens, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchlens, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
