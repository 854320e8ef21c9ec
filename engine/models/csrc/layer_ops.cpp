// The decoder layer's elementwise work, fused: one pass over the rows instead of a chain of
// small torch ops (each of which reads and writes the whole activation and, on a CPU, pays
// for starting its own thread team).
//
//   add_rms_norm   x += delta (the residual stream, in place), then RMSNorm(x) * weight
//   rope_write_kv  RoPE on the q and k heads of the fused QKV output (in place), and this
//                  step's K and V stored in the paged cache at their slots
//   silu_mul       SiLU(gate) * up from the fused gate/up output
//
// Sums, squares and products are taken in float32 and rounded once to the tensor's dtype
// (torch's bfloat16 ops round after every op, so results differ from them in the last bit
// now and then). Rows are split across threads only when there is enough work: a decode
// step's rows run on the calling thread, with no OpenMP region at all.
//
//   qkv row   [ q: H x D | k: KVH x D | v: KVH x D ]
//   k_cache   [KVH, NUM_BLOCKS, BS, D]   slot = block * BS + offset; v_cache alike
//             packed (5-dim, see attention.py): K [KVH, NB, D/2, BS, 2], V [KVH, NB, BS/2, D, 2],
//             blocks contiguous, heads and blocks at any strides (views of one pool)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMinElemsPerThread = 32768;  // below this a row range runs unsplit

template <typename T>
inline T from_f(float f) { return static_cast<T>(f); }
template <>
inline at::BFloat16 from_f<at::BFloat16>(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(u >> 16), at::BFloat16::from_bits());
}

// e^x, |relative error| < 2e-7: 2^(x log2 e) = 2^k * 2^f, |f| <= 1/2, 2^f by its Taylor
// series; written with plain arithmetic so that loops over it vectorise
inline float exp_f(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float y = x * 1.44269504088896341f;
  const float k = (y + 12582912.f) - 12582912.f;  // y rounded to the nearest integer
  const float f = (y - k) * 0.693147180559945309f;
  float p = 1.f / 5040;
  p = p * f + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(1, row_elems));
}

#if defined(__AVX512F__)
// add_rms_norm_impl's row for bfloat16, 16 lanes at a time (n a multiple of 16): the
// scalar loops below leave the compiler a rounding per element it does not vectorise.
// The sum of squares in 16 partial sums.
inline void add_rms_norm_bf16x16(at::BFloat16* xr, const at::BFloat16* dr, const at::BFloat16* w,
                                 at::BFloat16* o, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load16(xr + i);
    if (dr != nullptr) v = store16(xr + i, _mm512_add_ps(v, load16(dr + i)));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(
      1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16)
    store16(o + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i), inv), load16(w + i)));
}
#endif

template <typename T>
void add_rms_norm_impl(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t n,
                       int64_t x_stride, int64_t d_stride, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>)
        if (n % 16 == 0) {
          add_rms_norm_bf16x16(xr, delta != nullptr ? delta + r * d_stride : nullptr, w,
                               out + r * n, n, eps);
          continue;
        }
#endif
      float ss = 0.f;
      if (delta != nullptr) {
        const T* dr = delta + r * d_stride;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          const float v = to_f(from_f<T>(to_f(xr[i]) + to_f(dr[i])));
          xr[i] = from_f<T>(v);
          ss += v * v;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          const float v = to_f(xr[i]);
          ss += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(to_f(xr[i]) * inv * to_f(w[i]));
    }
  });
}

}  // namespace

namespace batchlens {

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  // add_rms_norm_into checks x (of a wrong rank, out is made empty here)
  auto out = at::empty({x.dim() == 2 ? x.size(0) : 0, x.dim() == 2 ? x.size(1) : 0},
                       x.options());
  add_rms_norm_into(x, delta, weight, eps, out);
  return out;
}

void add_rms_norm_into(at::Tensor x, const c10::optional<at::Tensor>& delta,
                       const at::Tensor& weight, double eps, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "add_rms_norm: x must be a CPU [rows, hidden] tensor with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "add_rms_norm: the output must be a contiguous [rows, hidden] tensor in x's dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [hidden] in x's dtype");
  auto w = weight.contiguous();
  at::Tensor d;
  if (delta.has_value()) {
    d = *delta;
    TORCH_CHECK(d.sizes() == x.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
                "add_rms_norm: delta must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(),
                                d.defined() ? d.data_ptr<scalar_t>() : nullptr,
                                w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                                x.stride(0), d.defined() ? d.stride(0) : 0,
                                static_cast<float>(eps));
  });
}

}  // namespace batchlens

namespace {

// RoPE as transformers applies it (rotate_half): for i < D/2
//   out[i]       = x[i] cos[i] - x[i + D/2] sin[i]
//   out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
template <typename T>
inline void rope_head(T* x, const T* c, const T* s, int64_t half) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (half % 16 == 0) {  // as the loop below, 16 lanes at a time
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 a = load16(x + i), b = load16(x + i + half);
        store16(x + i, _mm512_fmsub_ps(a, load16(c + i), _mm512_mul_ps(b, load16(s + i))));
        store16(x + i + half,
                _mm512_fmadd_ps(b, load16(c + i + half), _mm512_mul_ps(a, load16(s + i + half))));
      }
      return;
    }
#endif
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_f(x[i]), b = to_f(x[i + half]);
    x[i] = from_f<T>(a * to_f(c[i]) - b * to_f(s[i]));
    x[i + half] = from_f<T>(b * to_f(c[i + half]) + a * to_f(s[i + half]));
  }
}

template <typename T>
void rope_write_kv_impl(T* qkv, int64_t row_stride, const T* cos, const T* sin,
                        const int64_t* pos, T* kc, T* vc, const int64_t* slots, int64_t rows,
                        int64_t H, int64_t KVH, int64_t D, int64_t num_slots, int64_t BS,
                        batchlens::BlockStrides ks, batchlens::BlockStrides vs, bool packed,
                        bool write) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, grain_rows((H + 2 * KVH) * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = qkv + r * row_stride;
      const T* c = cos + pos[r] * D;
      const T* s = sin + pos[r] * D;
      for (int64_t h = 0; h < H + KVH; ++h) rope_head(row + h * D, c, s, half);
      if (!write) continue;
      const int64_t slot = slots[r];
      for (int64_t h = 0; h < KVH; ++h) {
        const T* k = row + (H + h) * D;
        const T* v = row + (H + KVH + h) * D;
        if (!packed) {
          std::memcpy(kc + (h * num_slots + slot) * D, k, D * sizeof(T));
          std::memcpy(vc + (h * num_slots + slot) * D, v, D * sizeof(T));
          continue;
        }
        // the block's elements: K's pair of dims d/2 holds this key at `off`; V's pair of
        // keys off/2 holds this key's dim d in its half off % 2
        const int64_t blk = slot / BS;
        batchlens::write_packed(kc + h * ks.head + blk * ks.block,
                                vc + h * vs.head + blk * vs.block, k, v, slot % BS, BS, D);
      }
    }
  });
}

}  // namespace

namespace batchlens {

void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                   bool write) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1,
              "rope_write_kv: qkv must be a CPU [rows, width] tensor with contiguous rows");
  const bool packed = k_cache.dim() == 5;
  TORCH_CHECK((packed || (k_cache.is_contiguous() && v_cache.is_contiguous())) &&
                  (packed ? v_cache.dim() == 5 && k_cache.size(4) == 2 && v_cache.size(4) == 2 &&
                                k_cache.size(2) * 2 == v_cache.size(3) &&
                                v_cache.size(2) * 2 == k_cache.size(3)
                          : k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes()),
              "rope_write_kv: caches must be contiguous [KVH, NB, BS, D] of one shape, or "
              "packed K [KVH, NB, D/2, BS, 2] and V [KVH, NB, BS/2, D, 2] (views of one pool)");
  const batchlens::BlockStrides none{0, 0};  // in rows: contiguous, addressed by slot
  const auto ks = packed ? batchlens::block_strides(k_cache, "rope_write_kv") : none;
  const auto vs = packed ? batchlens::block_strides(v_cache, "rope_write_kv") : none;
  // V's dim 3 is head_dim in both layouts
  const int64_t rows = qkv.size(0), D = v_cache.size(3);
  const int64_t BS = packed ? k_cache.size(3) : k_cache.size(2);
  const int64_t H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(KVH == k_cache.size(0) && qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0,
              "rope_write_kv: qkv width must be (heads + 2 kv heads) x head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D &&
                  sin.sizes() == cos.sizes(),
              "rope_write_kv: cos and sin must be contiguous [positions, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == cos.scalar_type() &&
                  qkv.scalar_type() == sin.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == rows && slot_mapping.numel() == rows,
              "rope_write_kv: positions and slot_mapping must be int64 [rows]");
  auto pos = positions.contiguous();
  auto slots = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(1) * BS, max_pos = cos.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)  // a bad index would write outside the cache
    TORCH_CHECK(pp[r] >= 0 && pp[r] < max_pos && sp[r] >= 0 && sp[r] < num_slots,
                "rope_write_kv: row ", r, " has position ", pp[r], " / slot ", sp[r],
                " outside the tables");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), cos.data_ptr<scalar_t>(),
                                 sin.data_ptr<scalar_t>(), pp, k_cache.data_ptr<scalar_t>(),
                                 v_cache.data_ptr<scalar_t>(), sp, rows, H, KVH, D, num_slots, BS,
                                 ks, vs, packed, write);
  });
}

}  // namespace batchlens

namespace {

#if defined(__AVX512F__)
// 16 lanes of SiLU(g) * u for bfloat16: e^-g by exp_ps, 1 / (1 + e^-g) by the 14-bit
// reciprocal (bfloat16 keeps 8 bits), rounded to nearest even on the way out
inline void silu_mul_bf16x16(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* o) {
  const __m512 x = load16(g);
  // -g within [-87, 88], where e^-g is a finite float32 (SiLU is g or 0 beyond)
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(87.f));
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), c));
  const __m512 s = _mm512_mul_ps(x, _mm512_rcp14_ps(_mm512_add_ps(e, _mm512_set1_ps(1.f))));
  store16(o, _mm512_mul_ps(s, load16(u)));
}
#endif

template <typename T>
void silu_mul_impl(const T* in, T* out, int64_t rows, int64_t n, int64_t in_stride) {
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * in_stride;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>)
        for (; i + 16 <= n; i += 16) silu_mul_bf16x16(g + i, u + i, o + i);
#endif
#pragma omp simd
      for (int64_t j = i; j < n; ++j) {
        const float x = to_f(g[j]);
        o[j] = from_f<T>(x / (1.f + exp_f(-x)) * to_f(u[j]));
      }
    }
  });
}

}  // namespace

namespace batchlens {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  // silu_mul_into checks gate_up (of a wrong rank, out is made empty here)
  auto out = at::empty({gate_up.dim() == 2 ? gate_up.size(0) : 0,
                        gate_up.dim() == 2 ? gate_up.size(1) / 2 : 0}, gate_up.options());
  silu_mul_into(gate_up, out);
  return out;
}

void silu_mul_into(const at::Tensor& gate_up, const at::Tensor& out) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a CPU [rows, 2 x intermediate] tensor");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef({rows, n}) && out.is_contiguous() &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: the output must be a contiguous [rows, intermediate] tensor in "
              "gate_up's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                            gate_up.stride(0));
  });
}

}  // namespace batchlens

namespace {

// The index of each row's largest value (the first one on ties, a NaN above everything),
// read from bfloat16 in place: greedy sampling without a float32 copy of the logits
// (64 x 49,152 logits: 0.3 ms here against 3 ms for .float().argmax()); float32 logits
// (after the sampler's processing) take the same vector loop.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t best = 0;
  float bv = to_f(x[0]);
  if (std::isnan(bv)) return 0;
  int64_t i = 1;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    if (n >= 32) {  // per lane: the largest value and its first index; NaN breaks out
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i vidx = _mm512_setzero_si512();
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        const __m512 v = load16(x + j);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;  // a NaN: the scalar loop finds it
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
        idx = _mm512_add_epi32(idx, step);
      }
      alignas(64) float mv[16];
      alignas(64) int32_t mi[16];
      _mm512_store_ps(mv, vmax);
      _mm512_store_si512(mi, vidx);
      for (int l = 0; l < 16; ++l)
        if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) bv = mv[l], best = mi[l];
      i = j;
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    if (std::isnan(v)) return i;
    if (v > bv) bv = v, best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "argmax_rows: logits must be a CPU [rows, vocab] tensor with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, n);
    });
  });
  return out;
}

// Structured outputs' token mask: in each listed row of float32 `logits` [rows, vocab], set
// to -inf every token whose bit in `bitmask` [rows, words] is clear (int32 words, bit i of
// word w: token 32w + i; xgrammar's layout). A word of all-allowed tokens is skipped, and
// AVX-512 writes the barred ones of 16 tokens with one masked store.
void bar_tokens(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "bar_tokens: logits must be a CPU float32 [rows, vocab] tensor with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bar_tokens: bitmask must be a contiguous int32 [rows, ceil(vocab / 32)] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "bar_tokens: rows must be a 1-d int64 tensor");
  const int64_t n = logits.size(1), words = bitmask.size(1), stride = logits.stride(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "bar_tokens: row ", r[i], " out of range");
  float* x = logits.data_ptr<float>();
  const auto* b = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = x + r[i] * stride;
      const uint32_t* br = b + r[i] * words;
      int64_t t = 0;
#if defined(__AVX512F__)
      const __m512 vninf = _mm512_set1_ps(ninf);
      for (; t + 32 <= n; t += 32) {
        const uint32_t barred = ~br[t >> 5];
        if (barred == 0) continue;
        _mm512_mask_storeu_ps(xr + t, static_cast<__mmask16>(barred & 0xFFFFu), vninf);
        _mm512_mask_storeu_ps(xr + t + 16, static_cast<__mmask16>(barred >> 16), vninf);
      }
#endif
      for (; t < n; ++t)
        if (!((br[t >> 5] >> (t & 31)) & 1u)) xr[t] = ninf;
    }
  });
}

void rope_write_kv_op(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  batchlens::rope_write_kv(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, num_heads,
                           num_kv_heads, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchlens, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("bar_tokens(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(batchlens, CPU, m) {
  m.impl("add_rms_norm", &batchlens::add_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv_op);
  m.impl("silu_mul", &batchlens::silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("bar_tokens", &bar_tokens);
}
