// Every decoder layer of one step in a single call: the CPU bfloat16 path where each matmul
// is the bf16 kernel (bf16_gemm.cpp) and the attention kernel attends every row of the step
// (paged_attention.cpp). Per layer it runs what `LlamaModel._forward_fused` runs, in the same
// order on the same tensors, so the results are the same bits:
//
//   hs = add_rms_norm(x, delta, input_norm)      x += delta (the residual), in place
//   qkv = hs Wqkv^T (+ b);  rope_write_kv(qkv)    RoPE in place, this step's K/V stored
//   attn = paged_decode_attention(q of qkv)       (or the K/V stored here, where the kernel
//                                                  can: attention_stores_kv)
//   hs = add_rms_norm(x, attn Wo^T, post_norm)
//   delta = silu_mul(hs Wgu^T) Wdown^T
//
// then, for the rows that want logits, the final norm and the LM head (where it is the
// bf16 kernel; else the normed rows, for the caller's LM head). At a decode step's few rows
// the weights stream in a few milliseconds, and nine Python-level op calls per layer (with
// their views and argument checks) cost time of the same order: called from C++ they cost
// nothing next to the matmuls. Each op called from Python after the layers costs more
// than it would before them: the weights' stream has left the interpreter's memory in no
// cache, so the head runs here too.
//
//   weights  7 per layer: input_norm, qkv (packed), qkv bias (an empty tensor: none),
//            o (packed), post_norm, gate_up (packed), down (packed)
//   caches   one K and one V tensor per layer, [KVH, NB, BS, D] or packed (attention.py)

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <iterator>
#include <vector>

#include "kernels.h"

namespace batchlens {

constexpr int64_t kWeightsPerLayer = 7;

// The layer stack's ops, by kind, for the timings below; the final norm and LM head are
// timed apart from the layers' ops (slot kHead), recorded under their ops' names
enum Op { kLinear, kAttention, kNorm, kRope, kSilu, kOps };
constexpr int kHead = kOps, kWhole = kOps + 1;
constexpr const char* kOpNames[kOps] = {"batchlens::bf16_linear",
                                        "batchlens::paged_decode_attention",
                                        "batchlens::add_rms_norm", "batchlens::rope_write_kv",
                                        "batchlens::silu_mul"};

// Wall time of the stack's ops by kind, and of whole calls, summed while timing is on
// (`forward_times`, scripts/step_anatomy.py). torch.profiler costs about a microsecond an op,
// as much as a batch-1 step's small ops themselves: it cannot split such a step. Steps run
// on one thread (engine/compute.py), which alone reads and writes these.
struct Timings {
  bool on = false;
  double us[kOps + 2] = {};  // the ops, the head, then whole forward_layers calls
};
Timings timings;

using Clock = std::chrono::steady_clock;
struct Timed {  // adds its lifetime to timings.us[slot] where timing is on
  int slot;
  Clock::time_point start = timings.on ? Clock::now() : Clock::time_point();
  ~Timed() {
    if (timings.on)
      timings.us[slot] += std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  }
};

// `f()` under the op's own name for torch.profiler (the bench's step breakdown): a call from
// here skips the dispatcher, which is where ops are recorded. Free while no profiler runs.
template <typename F>
auto recorded(Op op, F&& f, int slot = -1) {
  RECORD_FUNCTION(kOpNames[op], std::vector<c10::IValue>());
  Timed timed{slot < 0 ? static_cast<int>(op) : slot};
  return f();
}

// The sums so far in microseconds (the ops in Op's order, the head, then whole calls),
// reset; timing stays on or goes off for the calls after this one as `on` says
std::vector<double> forward_times(bool on) {
  std::vector<double> out(std::begin(timings.us), std::end(timings.us));
  timings = Timings{};
  timings.on = on;
  return out;
}

at::Tensor forward_layers(at::Tensor x, at::TensorList weights, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          const at::Tensor& logits_rows, const at::Tensor& final_norm,
                          const at::Tensor& lm_head, int64_t num_heads, int64_t num_kv_heads,
                          double eps, double scale) {
  Timed whole{kWhole};
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers,
              "forward_layers: ", kWeightsPerLayer, " weights and one K and V cache per layer");
  TORCH_CHECK(x.dim() == 2 && context_lens.numel() == x.size(0),
              "forward_layers: every row of x is attended by the kernel (one length per row)");
  // V's dim 3 is head_dim whether the caches are packed or not
  const int64_t rows = x.size(0), head_dim = v_caches[0].size(3);
  const int64_t q_width = num_heads * head_dim;
  // Each op writes into a buffer made once for the call and reused by every layer: at a
  // decode step's few rows a tensor made per op and layer (and the views of it) costs as
  // much as the small ops themselves, its memory in no cache after the layer's weights
  const auto out_of = [&](const at::Tensor& packed) {  // a packed weight's output width
    return at::empty({rows, packed.size(0) * 32}, x.options());
  };
  at::Tensor hs = at::empty_like(x), qkv = out_of(weights[1]), o = out_of(weights[3]);
  at::Tensor gate_up = out_of(weights[5]), delta = out_of(weights[6]);
  at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, x.options());
  at::Tensor attn = at::empty({rows, num_heads, head_dim}, x.options());
  const at::Tensor attn_rows = attn.view({rows, q_width});
  const at::Tensor q = qkv.narrow(1, 0, q_width).view({rows, num_heads, head_dim});
  auto norm = [&](const c10::optional<at::Tensor>& d, const at::Tensor& weight) {
    recorded(kNorm, [&] { add_rms_norm_into(x, d, weight, eps, hs); });
  };
  auto linear = [&](const at::Tensor& in, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& b, const at::Tensor& out) {
    recorded(kLinear, [&] { bf16_linear_into(in, weight, b, out); });
  };
  // where the attention kernel can, it stores the step's K and V as it reads their blocks
  const bool kv_in_attention = attention_stores_kv(k_caches[0], num_heads, block_tables,
                                                   context_lens, slot_mapping);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const c10::optional<at::Tensor> bias =
        w[2].numel() > 0 ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
    norm(l > 0 ? c10::optional<at::Tensor>(delta) : c10::nullopt, w[0]);
    linear(hs, w[1], bias, qkv);
    recorded(kRope, [&] {
      rope_write_kv(qkv, cos, sin, positions, k_caches[l], v_caches[l], slot_mapping,
                    num_heads, num_kv_heads, !kv_in_attention);
    });
    recorded(kAttention, [&] {
      paged_decode_attention(q, k_caches[l], v_caches[l], block_tables, context_lens, scale,
                             kv_in_attention, attn);
    });
    linear(attn_rows, w[3], c10::nullopt, o);
    norm(o, w[4]);
    linear(hs, w[5], c10::nullopt, gate_up);
    recorded(kSilu, [&] { silu_mul_into(gate_up, act); });
    linear(act, w[6], c10::nullopt, delta);
  }
  // as the per-layer path ends: x + delta of the logits rows, normed, then the LM head
  const at::Tensor normed = recorded(kNorm, [&] {
    return add_rms_norm(x.index_select(0, logits_rows), delta.index_select(0, logits_rows),
                        final_norm, eps);
  }, kHead);
  if (lm_head.numel() == 0) return normed;
  return recorded(kLinear, [&] { return bf16_linear(normed, lm_head, c10::nullopt); }, kHead);
}

}  // namespace batchlens

TORCH_LIBRARY_FRAGMENT(batchlens, m) {
  m.def("forward_times(bool on) -> float[]", &batchlens::forward_times);
  m.def("forward_layers(Tensor(a!) x, Tensor[] weights, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor logits_rows, Tensor final_norm, "
        "Tensor lm_head, int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchlens, CPU, m) {
  m.impl("forward_layers", &batchlens::forward_layers);
}
