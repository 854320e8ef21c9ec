// The kernels' entry points, callable from C++ as well as registered as torch ops: the
// decoder stack (decoder.cpp) runs them back to back without a trip through Python. Also
// the packed KV block's addressing, which the cache writer and the attention share.
#pragma once

#include <ATen/ATen.h>

namespace batchlens {

// Where element (key t, dim d) of a packed K or V block sits in it (the layout of
// attention.py): K in pairs of dims, each pair row the block's BS keys; V in pairs of keys,
// each pair row the D dims
inline int64_t packed_k(int64_t t, int64_t d, int64_t BS) { return (d / 2 * BS + t) * 2 + d % 2; }
inline int64_t packed_v(int64_t t, int64_t d, int64_t D) { return (t / 2 * D + d) * 2 + t % 2; }

// bf16_gemm.cpp
bool bf16_linear_supported();
bool bf16_linear_amx();
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias);

// layer_ops.cpp
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps);
void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

// paged_attention.cpp
bool paged_packed_supported(int64_t head_dim, int64_t group, int64_t block_size);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale);

}  // namespace batchlens
