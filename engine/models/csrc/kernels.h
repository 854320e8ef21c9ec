// The kernels' entry points, callable from C++ as well as registered as torch ops: the
// decoder stack (decoder.cpp) runs them back to back without a trip through Python. Also
// the packed KV block's addressing, which the cache writer and the attention share.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace batchlens {

// Where element (key t, dim d) of a packed K or V block sits in it (the layout of
// attention.py): K in pairs of dims, each pair row the block's BS keys; V in pairs of keys,
// each pair row the D dims
inline int64_t packed_k(int64_t t, int64_t d, int64_t BS) { return (d / 2 * BS + t) * 2 + d % 2; }
inline int64_t packed_v(int64_t t, int64_t d, int64_t D) { return (t / 2 * D + d) * 2 + t % 2; }

// Where a packed cache's blocks sit, in elements: between kv heads and between blocks. Each
// block is whole (its elements in a row), but K and V may be views of one pool tensor, a
// block's K beside its V, so that both are one run of memory (attention.py).
struct BlockStrides {
  int64_t head, block;
};
inline BlockStrides block_strides(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1 && cache.stride(3) == cache.size(4) &&
                  cache.stride(2) == cache.size(3) * cache.size(4),
              name, ": a packed cache's blocks must each be contiguous");
  return {cache.stride(0), cache.stride(1)};
}

// One key's K and V into a packed block (kb, vb): K's pairs of dims go one per pair row (a
// stride of BS pairs), V's dims into the half `off % 2` of pair row off / 2.
template <typename T>
inline void write_packed(T* kb, T* vb, const T* k, const T* v, int64_t off, int64_t BS,
                         int64_t D) {
#if defined(__AVX512BW__)
  if constexpr (sizeof(T) == 2) {
    if (D % 32 == 0) {
      const __mmask32 half = off % 2 ? 0xAAAAAAAAu : 0x55555555u;
      int32_t* kp = reinterpret_cast<int32_t*>(kb) + off;
      T* vp = vb + off / 2 * D * 2;
      for (int64_t d = 0; d < D; d += 32) {  // 16 pairs of K, 32 dims of V
        // one 32-bit store per pair row: a scatter of the 16 took longer on Zen 4
        const int32_t* pairs = reinterpret_cast<const int32_t*>(k + d);
        for (int i = 0; i < 16; ++i) kp[(d / 2 + i) * BS] = pairs[i];
        for (int64_t j = 0; j < 32; j += 16) {  // 16 dims -> the low or high halves of 16 pairs
          __m512i x = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d + j)));
          if (off % 2) x = _mm512_slli_epi32(x, 16);
          _mm512_mask_storeu_epi16(vp + (d + j) * 2, half, x);
        }
      }
      return;
    }
  }
#endif
  for (int64_t d = 0; d < D; ++d) {
    kb[packed_k(off, d, BS)] = k[d];
    vb[packed_v(off, d, D)] = v[d];
  }
}

// bf16_gemm.cpp
bool bf16_linear_supported();
bool bf16_linear_amx();
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias);
// the same into y, a contiguous [M, N] bfloat16 tensor (a buffer the caller reuses)
void bf16_linear_into(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, const at::Tensor& y);

// layer_ops.cpp
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps);
void add_rms_norm_into(at::Tensor x, const c10::optional<at::Tensor>& delta,
                       const at::Tensor& weight, double eps, const at::Tensor& out);
// write: also store each row's K and V at its slot (else RoPE alone: the attention stores
// them, see paged_decode_attention)
void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                   bool write);
at::Tensor silu_mul(const at::Tensor& gate_up);
void silu_mul_into(const at::Tensor& gate_up, const at::Tensor& out);

// paged_attention.cpp
bool paged_packed_supported(int64_t head_dim, int64_t group, int64_t block_size);
// Whether paged_decode_attention can store the step's K and V itself (store_kv): the tile
// kernel over packed caches, every row alone (a run of prompt rows reads keys that its
// other rows store), each row's slot that of its newest key (position context_lens - 1)
bool attention_stores_kv(const at::Tensor& k_cache, int64_t num_heads,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& slot_mapping);
// store_kv (where attention_stores_kv): q is rows of the fused QKV output after RoPE, and
// each row's K and V, after its query heads, go into the cache as the row's newest key;
// `into` (if defined): the contiguous [S, H, D] output to write, returned
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, bool store_kv,
                                  const at::Tensor& into = at::Tensor());

}  // namespace batchlens
