// Numeric helpers the CPU kernels share: a scalar's value as float32 (bfloat16 is the top
// half of a float32), and for AVX-512 and AVX2 the same widening for vectors of loads and
// e^x for x <= 0 (a softmax's and SiLU's exponent).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

inline float to_f(float x) { return x; }
inline float to_f(double x) { return static_cast<float>(x); }
inline float to_f(at::Half x) { return static_cast<float>(x); }
inline float to_f(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
// 16 bfloat16 bit patterns -> 16 floats (bfloat16 is the top half of a float32)
inline __m512 widen16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 elements -> 16 floats
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats rounded to bfloat16 (to nearest even) and stored at p; returns the rounded
// values as floats. With AVX512_BF16 one instruction rounds (subnormals to zero, as the
// matmul kernel's results); without it the bits are rounded as a scalar rounding does.
inline __m512 store16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  const __m256i packed = (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  return widen16(packed);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  return _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
#endif
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
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// 8 elements -> 8 floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0, as exp_ps, with 2^k built in the exponent bits (AVX2 has no scalef)
inline __m256 exp8(__m256 x) {
  const __m256 y = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.4426950408889634f));
  const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(y, k), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif  // __AVX2__ && __FMA__
