// Decode attention that reads the paged KV cache in place, one pass over each block.
//
// For every (request, kv head) pair, in parallel: walk the request's block table, score
// the block's keys against the query heads that share this kv head, and fold the block
// into a running softmax (max, sum, weighted V) kept in float32. Each K/V byte is read
// once; nothing is gathered into a padded copy first. The AVX-512 path scores 16 keys at a
// time and sums the 16 dot products across lanes together (hsum16), by bfloat16 dot
// instructions where the CPU has them (AVX512_BF16).
//
// With AMX or AVX512_BF16 the bfloat16 caches come packed (5-dim, see attention.py): in
// each block K holds its dims in pairs, each pair row the block's keys, and V its keys in
// pairs, so that 16 keys' K and V are tiles the tile unit reads as they are (decode_amx),
// and vectors the dot instruction takes as they are (decode_bf16_packed).
//
//   q        [S, H, D]                  one new token per request
//   k_cache  [KVH, NUM_BLOCKS, BS, D]   v_cache alike; packed: K [KVH, NB, D/2, BS, 2],
//                                       V [KVH, NB, BS/2, D, 2], each block contiguous but
//                                       heads and blocks at any strides (the engine's K and
//                                       V are views of one pool, a block's K beside its V)
//   tables   [S, MAX_BLOCKS] int32      block table per request (padding unused)
//   lens     [S] int32                  context length per request (incl. the new token)
//   returns  [S, H, D]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

template <typename T>
inline void row_to_f(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

template <typename scalar_t>
void decode(const scalar_t* q, int64_t q_stride, const scalar_t* kc, const scalar_t* vc,
            const int32_t* tables,
            const int32_t* lens, scalar_t* out, int64_t S, int64_t H, int64_t KVH,
            batchlens::BlockStrides ks, batchlens::BlockStrides vs, int64_t BS, int64_t D,
            int64_t max_blocks, float scale, bool packed) {
  const int64_t G = H / KVH;
  // finite, so the running max never meets inf - inf
  constexpr float kLowest = -std::numeric_limits<float>::max();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(BS * D), score(BS), m(G), l(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / KVH, h = w % KVH;
      const scalar_t* qs = q + s * q_stride + h * G * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qs[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kLowest);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[s];
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t blk = tables[s * max_blocks + b];
        const int64_t n = std::min(BS, len - b * BS);
        const scalar_t* kb = kc + h * ks.head + blk * ks.block;
        const scalar_t* vb = vc + h * vs.head + blk * vs.block;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sc = score.data();
          for (int64_t t = 0; t < n; ++t) {
            float dot = 0.f;
            if (packed) {
              for (int64_t d = 0; d < D; ++d)
                dot += qg[d] * to_f(kb[batchlens::packed_k(t, d, BS)]);
            } else {
              const scalar_t* kt = kb + t * D;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_f(kt[d]);
            }
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
            if (packed) {
              for (int64_t d = 0; d < D; ++d) ag[d] += p * to_f(vb[batchlens::packed_v(t, d, D)]);
            } else {
              const scalar_t* vt = vb + t * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) ag[d] += p * to_f(vt[d]);
            }
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

// Calls f(std::integral_constant<int, G>{}) for G = `group` query heads per kv head, G in
// 1..8 (the compiled instances); false for another G, which runs the portable kernel.
template <typename F>
bool with_group(int64_t group, const F& f) {
  switch (group) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return false;
  }
}

// Runs of prompt rows: rows s .. s + n - 1 of one request (the same table, lengths one apart)
// whose queries fill one A tile together (n G <= 16). runs[s] = n at a run's first row, 0 at
// its others, 1 for a row alone.
std::vector<int32_t> row_runs(const int32_t* tables, const int32_t* lens, int64_t S, int64_t BS,
                              int64_t max_blocks, int G) {
  std::vector<int32_t> runs(S, 1);
  const int64_t most = 16 / G;
  for (int64_t s = 0; s < S;) {
    int64_t n = 1;
    while (n < most && s + n < S && lens[s + n] == lens[s] + n &&
           std::equal(tables + s * max_blocks,
                      tables + s * max_blocks + (lens[s + n] + BS - 1) / BS,
                      tables + (s + n) * max_blocks))
      ++n;
    for (int64_t i = 1; i < n; ++i) runs[s + i] = 0;
    runs[s] = static_cast<int32_t>(n);
    s += n;
  }
  return runs;
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

// What every kernel instance shares: the work, cut into units of keys, dealt to the
// threads by a shared counter, and the walk over a unit's keys a tile at a time.
//
// A unit is one (request, kv head) pair's keys [k0, k1): all of them, unless there are too
// few pairs to keep every thread busy (a small batch, batch 1 above all), when each pair's
// keys are cut into pieces of at least 256. Units run longest first and each thread takes the next one as
// it finishes the last, so the threads finish together however the lengths mix and
// whichever thread the OS takes away for a while. A piece's running softmax (max, sum,
// unnormalised V sum) goes to a scratch row; the thread that finishes a pair's last piece
// merges them and writes the output.
//
//   pair (s, h), 3 pieces:  keys [0, 256) [256, 512) [512, 600)   -> partials -> merge
struct Unit {
  int32_t s, h, k0, k1;
  int32_t part;  // first scratch row of the pair's pieces; -1: one piece, written directly
  int32_t pieces;
  int32_t rows;  // rows s .. s + rows - 1 at once (a run of prompt rows): body writes them
};

template <int G, int D>
struct Partial {  // one piece's running softmax per query head; acc in the kernel's order
  float m[G], l[G];
  alignas(64) float acc[G][D];
};

struct NoScope {};  // what a thread sets up before its units and undoes after: nothing

// Cuts the pairs into units and runs `body(unit, partial)` on every unit, longest first,
// over the threads; then `finish(s, h, partial)` once per pair with the whole pair's
// partial (a single piece's own, or the merge of its pieces). `runs` (optional, see
// row_runs): rows one unit takes together, where no pair is cut into pieces. A body that
// takes a third argument gets the unit its thread runs next (nullptr: none), claimed
// before it starts, so that it can prefetch that unit's first keys.
template <int G, int D, typename Scope = NoScope, typename Body, typename Finish>
void run_units(const int32_t* lens, int64_t S, int64_t KVH, const Body& body,
               const Finish& finish, const int32_t* runs = nullptr) {
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const int64_t pairs = S * KVH;
  int64_t piece = std::numeric_limits<int32_t>::max();
  if (nt > 1 && pairs < 4 * nt) {  // too few pairs: about 4 units per thread
    int64_t keys = 0;
    for (int64_t s = 0; s < S; ++s) keys += lens[s];
    // at least 256 keys a piece: each unit starts on keys not yet prefetched; a multiple
    // of 32, the keys of one step of the AMX kernel
    piece = std::max<int64_t>(256, (keys * KVH / (4 * nt) + 31) / 32 * 32);
  }
  std::vector<Unit> units;
  units.reserve(pairs);
  int32_t parts = 0;  // scratch rows for the pieces
  if (piece != std::numeric_limits<int32_t>::max()) runs = nullptr;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h) {
      if (runs != nullptr && runs[s] != 1) {
        if (runs[s] > 1)  // the run's keys: up to its last row's length
          units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), 0,
                           lens[s + runs[s] - 1], -1, 1, runs[s]});
        continue;
      }
      const int32_t len = lens[s];
      const int32_t n = static_cast<int32_t>((len + piece - 1) / piece);
      for (int32_t i = 0; i < n; ++i)
        units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                         static_cast<int32_t>(i * piece),
                         static_cast<int32_t>(std::min<int64_t>(len, (i + 1) * piece)),
                         n > 1 ? parts : -1, n, 1});
      if (n > 1) parts += n;
    }
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.k1 - a.k0 > b.k1 - b.k0; });
  std::vector<Partial<G, D>> scratch(parts);
  std::unique_ptr<std::atomic<int32_t>[]> left(new std::atomic<int32_t>[pairs]);
  for (const Unit& u : units) left[u.s * KVH + u.h].store(u.pieces, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t N = static_cast<int64_t>(units.size());
  const auto run = [&](const Unit& u, Partial<G, D>& p, const Unit* after) {
    if constexpr (std::is_invocable_v<const Body&, const Unit&, Partial<G, D>&, const Unit*>)
      body(u, p, after);
    else
      body(u, p);
  };
  at::parallel_for(0, std::min(nt, N), 1, [&](int64_t, int64_t) {
    [[maybe_unused]] Scope scope;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed), j; i < N; i = j) {
      j = next.fetch_add(1, std::memory_order_relaxed);
      const Unit& u = units[i];
      const Unit* after = j < N ? &units[j] : nullptr;
      if (u.part < 0) {
        Partial<G, D> p;
        run(u, p, after);
        if (u.rows == 1) finish(u.s, u.h, p);
        continue;
      }
      run(u, scratch[u.part + u.k0 / piece], after);
      if (left[u.s * KVH + u.h].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      Partial<G, D> p;  // this thread finished the pair's last piece: merge all of them
      const Partial<G, D>* parts = scratch.data() + u.part;
      for (int g = 0; g < G; ++g) {
        float m = parts[0].m[g];
        for (int32_t k = 1; k < u.pieces; ++k) m = std::max(m, parts[k].m[g]);
        float l = 0.f;
        for (int d = 0; d < D; ++d) p.acc[g][d] = 0.f;
        for (int32_t k = 0; k < u.pieces; ++k) {
          const float w = std::exp(parts[k].m[g] - m);
          l += parts[k].l[g] * w;
          for (int d = 0; d < D; ++d) p.acc[g][d] += parts[k].acc[g][d] * w;
        }
        p.m[g] = m, p.l[g] = l;
      }
      finish(u.s, u.h, p);
    }
  });
}

// The output rows of pair (s, h): acc / l per query head; `perm[d]` is where dimension d
// sits in acc (nullptr: in order).
template <typename T, int G, int D>
void write_out(T* out, int64_t H, int64_t s, int64_t h, const Partial<G, D>& p,
               const int* perm) {
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / p.l[g];
    T* os = out + (s * H + h * G + g) * D;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, at::BFloat16> && D % 16 == 0) {
      if (perm == nullptr) {  // in order: 16 at a time (each unit's rows go out here)
        for (int d = 0; d < D; d += 16)
          store16(os + d, _mm512_mul_ps(_mm512_load_ps(p.acc[g] + d), _mm512_set1_ps(inv)));
        continue;
      }
    }
#endif
    for (int d = 0; d < D; ++d) os[d] = static_cast<T>(p.acc[g][perm ? perm[d] : d] * inv);
  }
}

// Keys prefetched past the tile in use, in two reaches: the next tile's K/V into L1, and
// the keys up to kAheadKeys past it into L2. A core has few L1 misses in flight, too few
// to cover main memory's latency at this kernel's rate of reads; the L2 keeps more, and an
// L1 miss that hits there waits little.
constexpr int64_t kAheadKeys = 64;

template <typename T, int TILE = 16>
struct KeyWalk {  // row offsets (in elements) of a unit's keys, TILE at a time
  struct Cursor {  // a key of the unit: its block-table column and slot
    int64_t blk_i, in_blk;
  };
  const int32_t* table;
  int64_t h, NB, BS, D, len;  // len: the unit's keys, from its first
  Cursor next, near, far;     // the next key to return; the next to prefetch into L1, L2
  int64_t near_n = 0, far_n = 0;  // keys prefetched so far into L1, L2
  int64_t rows[TILE];
  KeyWalk(const int32_t* t, int64_t h_, int64_t nb, int64_t bs, int64_t d, int64_t k0,
          int64_t k1)
      : table(t), h(h_), NB(nb), BS(bs), D(d), len(k1 - k0),
        next{k0 / bs, k0 % bs}, near{k0 / bs, k0 % bs}, far{k0 / bs, k0 % bs} {}
  int64_t step(Cursor& c) const {  // the row offset of c's key; c moves to the next key
    const int64_t off = ((h * NB + table[c.blk_i]) * BS + c.in_blk) * D;
    if (++c.in_blk == BS) c.in_blk = 0, ++c.blk_i;
    return off;
  }
  template <auto HINT>  // _MM_HINT_T0 or _T1 (an enum in GCC, an int in clang)
  void fetch(Cursor& c, int64_t& done, int64_t until, const T* kc, const T* vc) {
    for (; done < until; ++done) {
      const int64_t off = step(c);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + off) + b, HINT);
        _mm_prefetch(reinterpret_cast<const char*>(vc + off) + b, HINT);
      }
    }
  }
  // the offsets of keys [start, start + TILE) of the unit, after prefetching the next
  // tile's K/V into L1 and those of the keys up to kAheadKeys further into L2 (a shuffled
  // block table defeats the hardware prefetcher every block)
  const int64_t* tile(int64_t start, const T* kc, const T* vc) {
    fetch<_MM_HINT_T1>(far, far_n, std::min<int64_t>(len, start + 2 * TILE + kAheadKeys), kc, vc);
    fetch<_MM_HINT_T0>(near, near_n, std::min<int64_t>(len, start + 2 * TILE), kc, vc);
    const int64_t count = std::min<int64_t>(TILE, len - start);
    for (int64_t t = 0; t < count; ++t) rows[t] = step(next);
    return rows;
  }
};

#endif

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
constexpr bool kHasDotBf16 = true;
#else
constexpr bool kHasDotBf16 = false;
#endif

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

// The first n of a tile's 16 lanes (n in [0, 16])
inline __mmask16 first_lanes(int64_t n) {
  return n == 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Online softmax over one tile of scores x (lane t: key t, n valid): the tile's
// probabilities p (0 past n), with the running max m and the per-lane running sums l of one
// query head updated. True when the max grew: the head's accumulator must then be scaled by
// `corr` (l is, here). After the first tiles the max rarely grows, and a tile costs one
// compare: no reduction, no scalar exp, no rescaling on the serial path.
inline bool softmax_tile(__m512 x, __mmask16 valid, float& m, __m512& l, __m512& p,
                         float& corr) {
  const bool grew = _mm512_mask_cmp_ps_mask(valid, x, _mm512_set1_ps(m), _CMP_GT_OQ) != 0;
  if (grew) {
    const float bmax = _mm512_mask_reduce_max_ps(valid, x);
    corr = std::exp(m - bmax);
    l = _mm512_mul_ps(l, _mm512_set1_ps(corr));
    m = bmax;
  }
  p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(x, _mm512_set1_ps(m))));
  l = _mm512_add_ps(l, p);
  return grew;
}

// softmax_tile over two tiles of 16 keys at once (x1 the first): one test of the max, one
// rescale, for 32 keys.
inline bool softmax_tiles(__m512 x1, __mmask16 v1, __m512 x2, __mmask16 v2, float& m,
                          __m512& l, __m512& p1, __m512& p2, float& corr) {
  const __m512 mv = _mm512_set1_ps(m);
  const bool grew = (_mm512_mask_cmp_ps_mask(v1, x1, mv, _CMP_GT_OQ) |
                     _mm512_mask_cmp_ps_mask(v2, x2, mv, _CMP_GT_OQ)) != 0;
  if (grew) {
    const float bmax = std::max(v1 ? _mm512_mask_reduce_max_ps(v1, x1) : m,
                                v2 ? _mm512_mask_reduce_max_ps(v2, x2) : m);
    corr = std::exp(m - bmax);
    l = _mm512_mul_ps(l, _mm512_set1_ps(corr));
    m = bmax;
  }
  p1 = _mm512_maskz_mov_ps(v1, exp_ps(_mm512_sub_ps(x1, _mm512_set1_ps(m))));
  p2 = _mm512_maskz_mov_ps(v2, exp_ps(_mm512_sub_ps(x2, _mm512_set1_ps(m))));
  l = _mm512_add_ps(l, _mm512_add_ps(p1, p2));
  return grew;
}

// float32 and bfloat16 by float32 FMAs (q·k and p·v), head_dim = 16 DV. G (query heads per
// kv head) and DV are compile-time constants, so loops unroll and accumulators stay in
// registers. `q_stride`: elements between rows of q (rows of the fused QKV output are read
// in place).
template <typename T, int G, int DV>
void decode_avx512(const T* q, int64_t q_stride, const T* kc, const T* vc, const int32_t* tables,
                   const int32_t* lens, T* out, int64_t S, int64_t H, int64_t KVH, int64_t NB,
                   int64_t BS, int64_t max_blocks, float scale) {
  constexpr int D = 16 * DV;
  const auto body = [&](const Unit& u, Partial<G, D>& part) {
    const int64_t s = u.s, h = u.h;
    __m512 qf[G][DV], acc[G][DV], l[G];
    float m[G];
    for (int g = 0; g < G; ++g) {
      const T* qs = q + s * q_stride + (h * G + g) * D;
      for (int j = 0; j < DV; ++j) {
        qf[g][j] = _mm512_mul_ps(load16(qs + 16 * j), _mm512_set1_ps(scale));
        acc[g][j] = _mm512_setzero_ps();
      }
      m[g] = -std::numeric_limits<float>::max();  // finite: no inf - inf
      l[g] = _mm512_setzero_ps();
    }
    KeyWalk<T> walk(tables + s * max_blocks, h, NB, BS, D, u.k0, u.k1);
    for (int64_t start = 0; start < walk.len; start += 16) {
      const int64_t n = std::min<int64_t>(16, walk.len - start);
      const int64_t* row = walk.tile(start, kc, vc);
      const __mmask16 valid = first_lanes(n);
      alignas(64) float prob[G][16];
      for (int g = 0; g < G; ++g) {
        __m512 dots[16];
        for (int t = 0; t < 16; ++t) {
          __m512 a = _mm512_setzero_ps();
          if (t < n)
            for (int j = 0; j < DV; ++j) a = _mm512_fmadd_ps(qf[g][j], load16(kc + row[t] + 16 * j), a);
          dots[t] = a;
        }
        __m512 p;
        float corr;
        if (softmax_tile(hsum16(dots), valid, m[g], l[g], p, corr))
          for (int j = 0; j < DV; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(corr));
        _mm512_store_ps(prob[g], p);
      }
      for (int64_t t = 0; t < n; ++t)
        for (int j = 0; j < DV; ++j) {
          const __m512 v = load16(vc + row[t] + 16 * j);
          for (int g = 0; g < G; ++g)
            acc[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(prob[g][t]), v, acc[g][j]);
        }
    }
    for (int g = 0; g < G; ++g) {
      part.m[g] = m[g], part.l[g] = _mm512_reduce_add_ps(l[g]);
      for (int j = 0; j < DV; ++j) _mm512_store_ps(part.acc[g] + 16 * j, acc[g][j]);
    }
  };
  run_units<G, D>(lens, S, KVH, body, [&](int64_t s, int64_t h, const Partial<G, D>& p) {
    write_out<T, G, D>(out, H, s, h, p, nullptr);
  });
}

#if defined(__AVX512BF16__)
// bfloat16 with AVX512_BF16: q·k and p·v both by VDPBF16PS (pairs of bfloat16 products
// summed into float32 lanes), head_dim = 32 DC. For p·v two keys go together: their V rows
// are interleaved 16 bits at a time (unpacklo/hi, within 128-bit lanes), and each lane
// pair meets the broadcast pair (p_t, p_t+1) rounded to bfloat16, as GPU flash attention
// rounds P before its P·V product. The accumulators hold head_dim in a permuted order,
// undone at the end:
//
//   acc[2c]   lane 4L+i  <- dims 32c + 8L + i       (L: 128-bit lane 0..3, i: 0..3)
//   acc[2c+1] lane 4L+i  <- dims 32c + 8L + 4 + i
template <int G, int DC>
void decode_bf16_dp(const at::BFloat16* q, int64_t q_stride, const at::BFloat16* kc,
                    const at::BFloat16* vc, const int32_t* tables, const int32_t* lens,
                    at::BFloat16* out, int64_t S, int64_t H, int64_t KVH, int64_t NB, int64_t BS,
                    int64_t max_blocks, float scale) {
  constexpr int D = 32 * DC;
  const auto body = [&](const Unit& u, Partial<G, D>& part) {
    const int64_t s = u.s, h = u.h;
    __m512bh qb[G][DC];
    __m512 acc[G][2 * DC], l[G];
    alignas(64) uint32_t pairs[G][8];  // (p_2k, p_2k+1) as bfloat16 pairs
    float m[G];
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* qs = q + s * q_stride + (h * G + g) * D;
      for (int j = 0; j < DC; ++j) qb[g][j] = (__m512bh)_mm512_loadu_si512(qs + 32 * j);
      for (int j = 0; j < 2 * DC; ++j) acc[g][j] = _mm512_setzero_ps();
      m[g] = -std::numeric_limits<float>::max();
      l[g] = _mm512_setzero_ps();
    }
    KeyWalk<at::BFloat16> walk(tables + s * max_blocks, h, NB, BS, D, u.k0, u.k1);
    for (int64_t start = 0; start < walk.len; start += 16) {
      const int64_t n = std::min<int64_t>(16, walk.len - start);
      const int64_t* row = walk.tile(start, kc, vc);
      const __mmask16 valid = first_lanes(n);
      for (int g = 0; g < G; ++g) {
        __m512 dots[16];
        for (int t = 0; t < 16; ++t) {
          __m512 a = _mm512_setzero_ps();
          if (t < n)
            for (int j = 0; j < DC; ++j)
              a = _mm512_dpbf16_ps(a, qb[g][j], (__m512bh)_mm512_loadu_si512(kc + row[t] + 32 * j));
          dots[t] = a;
        }
        __m512 p;
        float corr;
        if (softmax_tile(_mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)), valid, m[g], l[g], p,
                         corr))
          for (int j = 0; j < 2 * DC; ++j)
            acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(corr));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(p));
      }
      for (int64_t t = 0; t < n; t += 2) {
        const at::BFloat16* v0 = vc + row[t];
        const at::BFloat16* v1 = vc + row[t + 1 < n ? t + 1 : t];  // a lone last key: p = 0
        __m512bh pp[G];  // broadcast once per pair of keys, used for every slice of V
        for (int g = 0; g < G; ++g)
          pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][t / 2]));
        for (int c = 0; c < DC; ++c) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
          const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
          for (int g = 0; g < G; ++g) {
            acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], pp[g], lo);
            acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], pp[g], hi);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      part.m[g] = m[g], part.l[g] = _mm512_reduce_add_ps(l[g]);
      for (int j = 0; j < 2 * DC; ++j) _mm512_store_ps(part.acc[g] + 16 * j, acc[g][j]);
    }
  };
  int perm[D];  // where dimension d sits in acc (the order above)
  for (int d = 0; d < D; ++d) {
    const int c = d / 32, lane = d % 32 / 8, e = d % 8;
    perm[d] = 16 * (2 * c + e / 4) + 4 * lane + e % 4;
  }
  run_units<G, D>(lens, S, KVH, body, [&](int64_t s, int64_t h, const Partial<G, D>& p) {
    write_out<at::BFloat16, G, D>(out, H, s, h, p, perm);
  });
}

// bfloat16 with AVX512_BF16 over packed caches (the AMX kernel's layout, attention.py), on a
// CPU with the dot instruction but no tile unit. Packed, a tile of 16 keys needs no
// horizontal sums and no shuffles: each of K's pair rows holds dims (2r, 2r+1) of the
// tile's 16 keys, one vector, so q·k is D/2 VDPBF16PS per query head, each of the row
// against the broadcast pair (q_2r, q_2r+1), with the 16 scores in the lanes; and each of
// V's pair rows holds keys (2j, 2j+1) interleaved for every dim, so p·v is D/16 VDPBF16PS
// per pair of keys and head against the broadcast pair (p_2j, p_2j+1), accumulating
// head_dim in order. In rows (decode_bf16_dp), q·k sums each key's products across lanes
// and p·v interleaves pairs of V rows first.
//
// Prefetches: each load of a full tile's line goes with a prefetch of the same line of the
// tile kPackedAheadKeys on into L2 and one of the next tile into L1: spread over the tile's
// work, not queued at its start behind the core's few misses in flight, and no loop of
// their own. Past the unit's keys the L2 ones go on into the first keys of the unit its
// thread runs next (docs/benchmarks.md).
// store_kv as in decode_amx: the unit holding a row's newest key stores it before reading
// the tile it lands in.
constexpr int64_t kPackedAheadKeys = 48;

// One line into L1 (T0) or L2 (T1), in inline assembly: GCC 12 leaves no `_mm_prefetch`
// of this kernel's in its object code.
template <bool kL1>
inline void prefetch_line(const char* p) {
  if constexpr (kL1) asm volatile("prefetcht0 %0" : : "m"(*p));
  else asm volatile("prefetcht1 %0" : : "m"(*p));
}

// Where a tile of 16 keys of a unit lies: its block-table column and first slot.
struct TileCursor {
  int64_t blk_i, off;
  TileCursor(int64_t key, int64_t bs) : blk_i(key / bs), off(key % bs) {}
  void advance(int64_t bs) {
    if ((off += 16) == bs) off = 0, ++blk_i;
  }
};

template <int G, int D>
void decode_bf16_packed(const at::BFloat16* q, int64_t q_stride, at::BFloat16* kc,
                        at::BFloat16* vc, const int32_t* tables, const int32_t* lens,
                        at::BFloat16* out, int64_t S, int64_t H, int64_t KVH,
                        batchlens::BlockStrides ks, batchlens::BlockStrides vs, int64_t BS,
                        int64_t max_blocks, float scale, bool store_kv) {
  constexpr int KP = D / 2;               // K's pair rows
  constexpr int VC = D / 16;              // 16-dim slices of a V pair row
  constexpr int CHAINS = G >= 4 ? 2 : 4;  // q·k sums per head, kept apart for the latency
  static_assert(KP % CHAINS == 0);
  const int64_t k_row = BS * 4;  // bytes between K's pair rows
  const auto body = [&](const Unit& u, Partial<G, D>& part, const Unit* after) {
    const int64_t s = u.s, h = u.h;
    const uint32_t* qp[G];  // q's dims in pairs, one 32-bit word each
    __m512 acc[G][VC], l[G];
    float m[G];
    for (int g = 0; g < G; ++g) {
      qp[g] = reinterpret_cast<const uint32_t*>(q + s * q_stride + (h * G + g) * D);
      for (int c = 0; c < VC; ++c) acc[g][c] = _mm512_setzero_ps();
      m[g] = -std::numeric_limits<float>::max();  // finite: no inf - inf
      l[g] = _mm512_setzero_ps();
    }
    const int32_t* table = tables + s * max_blocks;
    const bool stores = store_kv && u.k1 == lens[s];  // this unit holds the row's newest key
    at::BFloat16* kbase = kc + h * ks.head;
    at::BFloat16* vbase = vc + h * vs.head;
    // a tile's K and V, from a kv head's K and V and a row's block table
    const auto k_in = [&](const at::BFloat16* kb, const int32_t* t, const TileCursor& c) {
      return reinterpret_cast<const char*>(kb + t[c.blk_i] * ks.block + c.off * 2);
    };
    const auto v_in = [&](const at::BFloat16* vb, const int32_t* t, const TileCursor& c) {
      return reinterpret_cast<const char*>(vb + t[c.blk_i] * vs.block + c.off * D);
    };
    const auto k_at = [&](const TileCursor& c) { return k_in(kbase, table, c); };
    const auto v_at = [&](const TileCursor& c) { return v_in(vbase, table, c); };
    // past this unit's last kPackedAheadKeys, the L2 prefetches go on into the first keys of
    // the unit the thread takes next, so that it starts on keys in cache
    const int32_t* after_table = after ? tables + after->s * max_blocks : table;
    const at::BFloat16* after_kbase = after ? kc + after->h * ks.head : kbase;
    const at::BFloat16* after_vbase = after ? vc + after->h * vs.head : vbase;
    TileCursor after_far(after ? after->k0 : 0, BS);
    int64_t after_keys = after ? std::min<int64_t>(kPackedAheadKeys, after->k1 - after->k0) : 0;
    const auto fetch = [&](const TileCursor& c, auto l1) {  // a whole tile: a unit's first ones
      const char *kt = k_at(c), *vt = v_at(c);
      for (int r = 0; r < KP; ++r) prefetch_line<decltype(l1)::value>(kt + r * k_row);
      for (int b = 0; b < 32 * D; b += 64) prefetch_line<decltype(l1)::value>(vt + b);
    };
    TileCursor tile(u.k0, BS), next = tile, far = tile;
    next.advance(BS);
    for (int64_t key = u.k0; key < std::min<int64_t>(u.k0 + kPackedAheadKeys, u.k1); key += 16)
      fetch(far, std::false_type{}), far.advance(BS);
    fetch(tile, std::true_type{});
    for (int64_t key = u.k0; key < u.k1; key += 16, tile = next, next.advance(BS)) {
      if (stores && key + 16 >= u.k1) {  // the last tile: the newest key goes in first
        const int64_t t = u.k1 - 1;
        const int64_t blk = table[t / BS];
        const at::BFloat16* fresh = q + s * q_stride + (H + h) * D;
        batchlens::write_packed(kbase + blk * ks.block, vbase + blk * vs.block, fresh,
                                fresh + KVH * D, t % BS, BS, D);
      }
      const int64_t n = std::min<int64_t>(16, u.k1 - key);
      const char *kt = k_at(tile), *vb = v_at(tile);
      // the tiles to prefetch lines of: the far one (past this unit's keys, the next unit's
      // first ones) and the next; where there is none, this tile again (a hit in L1)
      const bool far_in = key + kPackedAheadKeys < u.k1, next_in = key + 16 < u.k1;
      const char *far_k = kt, *far_v = vb;
      if (far_in) {
        far_k = k_at(far), far_v = v_at(far);
        far.advance(BS);
      } else if (after_keys > 0) {
        far_k = k_in(after_kbase, after_table, after_far);
        far_v = v_in(after_vbase, after_table, after_far);
        after_far.advance(BS);
        after_keys -= 16;
      }
      const char *next_k = next_in ? k_at(next) : kt, *next_v = next_in ? v_at(next) : vb;
      __m512 sc[G][CHAINS];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < CHAINS; ++i) sc[g][i] = _mm512_setzero_ps();
#pragma GCC unroll 32
      for (int r = 0; r < KP; r += CHAINS)
        for (int i = 0; i < CHAINS; ++i) {
          const int64_t at = (r + i) * k_row;
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + at);
          prefetch_line<false>(far_k + at);
          prefetch_line<true>(next_k + at);
          for (int g = 0; g < G; ++g)
            sc[g][i] = _mm512_dpbf16_ps(
                sc[g][i], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g][r + i])), kv);
        }
      const __mmask16 valid = first_lanes(n);
      alignas(64) uint32_t pairs[G][8];  // (p_2j, p_2j+1) as bfloat16 pairs
      for (int g = 0; g < G; ++g) {
        __m512 x = sc[g][0];
        for (int i = 1; i < CHAINS; ++i) x = _mm512_add_ps(x, sc[g][i]);
        __m512 p;
        float corr;
        if (softmax_tile(_mm512_mul_ps(x, _mm512_set1_ps(scale)), valid, m[g], l[g], p, corr))
          for (int c = 0; c < VC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(corr));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(p));
      }
      const at::BFloat16* vt = reinterpret_cast<const at::BFloat16*>(vb);
      if (n == 16) {  // unrolled: the accumulators stay in registers
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          for (int c = 0; c < VC; ++c) {
            const int64_t at = (j * 2 * D + 32 * c) * 2;  // bytes: a line a load
            const __m512bh v = (__m512bh)_mm512_loadu_si512(vb + at);
            prefetch_line<false>(far_v + at);
            prefetch_line<true>(next_v + at);
            for (int g = 0; g < G; ++g)
              acc[g][c] = _mm512_dpbf16_ps(
                  acc[g][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j])), v);
          }
        continue;
      }
      for (int64_t j = 0; 2 * j < n; ++j) {  // a short tile: a unit's last
        __m512bh pp[G];
        for (int g = 0; g < G; ++g)
          pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j]));
        // a lone last key: its partner's half of the pair row may hold anything (p is 0
        // there, but NaN * 0 is NaN), so only the low halves are read
        const bool both = 2 * j + 1 < n;
        for (int c = 0; c < VC; ++c) {
          const at::BFloat16* vp = vt + j * 2 * D + 32 * c;
          const __m512bh v = (__m512bh)(both ? _mm512_loadu_si512(vp)
                                             : _mm512_maskz_loadu_epi16(0x55555555u, vp));
          for (int g = 0; g < G; ++g) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pp[g], v);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      part.m[g] = m[g], part.l[g] = _mm512_reduce_add_ps(l[g]);
      for (int c = 0; c < VC; ++c) _mm512_store_ps(part.acc[g] + 16 * c, acc[g][c]);
    }
  };
  run_units<G, D>(lens, S, KVH, body, [&](int64_t s, int64_t h, const Partial<G, D>& p) {
    write_out<at::BFloat16, G, D>(out, H, s, h, p, nullptr);
  });
}
#else
template <int G, int DC>  // never called: kHasDotBf16 is false without AVX512_BF16
void decode_bf16_dp(const at::BFloat16*, int64_t, const at::BFloat16*, const at::BFloat16*,
                    const int32_t*, const int32_t*, at::BFloat16*, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, float) {}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool kHasAmx = true;

struct alignas(64) TileConfig {  // the tile unit's palette 1: 8 tiles, rows x colsb bytes
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles of decode_amx, configured per thread for M query rows (a unit's rows times its
// query heads: G for a decode row, up to 16 for a run of prompt rows):
//   0, 7  C: the scores of 16 keys each, then 16 dims of p·v   M x 16 float32
//   1, 5  A: p of 16 keys each, bfloat16                        M x 16
//   2, 3  B: 16 keys (8 pairs) of V for 16 dims                 8 x 16 pairs
//   4     A: q, 32 dims                                         M x 32
//   6     B: 32 dims (16 pairs) of K for 16 keys                16 x 16 pairs
thread_local int tile_rows = 0;  // M of this thread's tile configuration; 0: none

inline void configure_tiles(int M) {
  if (tile_rows == M) return;
  TileConfig c;
  const auto set = [&](int t, int rows, int bytes) {
    c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(bytes);
  };
  set(0, M, 64), set(7, M, 64), set(1, M, 32), set(5, M, 32), set(2, 8, 64), set(3, 8, 64);
  set(4, M, 64), set(6, 16, 64);
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
  tile_rows = M;
}

struct AmxScope {  // a thread's tiles are configured at its first unit, released after its last
  ~AmxScope() {
    if (tile_rows != 0) _tile_release();
    tile_rows = 0;
  }
};

// bfloat16 over packed caches on the tile unit, two tiles of 16 keys at a time, for a unit's
// M = rows x G query rows at once: q·k is M x 16 scores a tile from D/32 tile products (q as
// A tiles, K's pair rows as B tiles, read in place), the online softmax runs on each row in
// AVX-512 registers as in decode_bf16_dp, one max for both tiles (a row's keys end at its
// own length: a prompt row sees its prefix), and p·v is D/16 tile products a tile of p
// (rounded to bfloat16) against V's pair rows, both tiles' summed in the tile unit and then
// added into float32 accumulators. A run of prompt rows reads its K and V once for all of
// its rows.
// GCC's tile intrinsics do not tell it they touch memory: the barriers keep the stores of p
// and the reads of the stored C tiles where they are.
//
// store_kv: q's rows are rows of the fused QKV output, each row's K and V (after RoPE) right
// after its query heads, and every row is alone (no run): the unit holding a row's newest
// key stores it into the cache in the step that reads it, whose lines the step before has
// fetched. Stored apart (rope_write_kv), a key's K lands on all D/2 pair rows of its block,
// lines in no cache, and each store waits on its line.
template <int G, int D>
void decode_amx(const at::BFloat16* q, int64_t q_stride, at::BFloat16* kc, at::BFloat16* vc,
                const int32_t* tables, const int32_t* lens, at::BFloat16* out, int64_t S,
                int64_t H, int64_t KVH, batchlens::BlockStrides ks, batchlens::BlockStrides vs,
                int64_t BS, int64_t max_blocks, float scale, bool store_kv) {
  constexpr int QT = D / 32;  // A tiles of q
  constexpr int VS = D / 16;  // 16-dim slices of V and of the output
  const int64_t k_row = BS * 4, v_row = D * 4;  // bytes between pair rows
  const auto body = [&](const Unit& u, Partial<G, D>& part) {
    const int64_t s = u.s, h = u.h;
    const int M = u.rows * G;
    configure_tiles(M);
    alignas(64) at::BFloat16 qa[16][D];
    alignas(64) float scores[2][16][16], pv[VS][16][16], acc[16][D];
    alignas(64) at::BFloat16 p16[2][16][16];
    alignas(64) at::BFloat16 vlast[8][D][2];  // a last tile's V, its missing keys zeroed
    __m512 l[16];
    float m[16];
    int64_t end[16];  // where each query row's keys end
    for (int r = 0; r < M; ++r) {
      const int64_t row = s + r / G;
      std::memcpy(qa[r], q + row * q_stride + (h * G + r % G) * D, sizeof qa[r]);
      end[r] = std::min<int64_t>(lens[row], u.k1);
      for (int c = 0; c < VS; ++c) _mm512_store_ps(acc[r] + 16 * c, _mm512_setzero_ps());
      m[r] = -std::numeric_limits<float>::max();  // finite: no inf - inf
      l[r] = _mm512_setzero_ps();
    }
    const int32_t* table = tables + s * max_blocks;
    const bool stores = store_kv && u.k1 == lens[s];  // this unit holds the row's newest key
    const char* kbase = reinterpret_cast<const char*>(kc + h * ks.head);
    const char* vbase = reinterpret_cast<const char*>(vc + h * vs.head);
    // the K and V of the 16 keys from `key` (a multiple of 16): offsets of block + tile
    const auto k_at = [&](int64_t key) {
      return kbase + (table[key / BS] * ks.block + key % BS * 2) * 2;
    };
    const auto v_at = [&](int64_t key) {
      return vbase + (table[key / BS] * vs.block + key % BS * D) * 2;
    };
    // V of the 16 keys from `key`, or of a last tile's keys with the rest zeroed: p is 0 past
    // each row's end, but V there may hold anything (NaN * 0 is NaN). A pair row holds two
    // keys' V, in the low and high halves of each 32-bit lane: a row of two present keys is
    // copied, one with only its first keeps the low halves, the rest are zeros.
    const auto v_tile = [&](int64_t key) {
      const char* vt = v_at(key);
      const int64_t n = u.k1 - key;
      if (n >= 16) return vt;
      constexpr int kRowVecs = D * 4 / 64;  // 64-byte vectors in a pair row
      const __m512i* src = reinterpret_cast<const __m512i*>(vt);
      __m512i* dst = reinterpret_cast<__m512i*>(vlast);
      for (int64_t r = 0; r < 8; ++r) {
        const __m512i keep = 2 * r + 1 < n ? _mm512_set1_epi32(-1)
                             : 2 * r < n    ? _mm512_set1_epi32(0xFFFF)
                                            : _mm512_setzero_si512();
        for (int i = 0; i < kRowVecs; ++i) {
          const int64_t at = r * kRowVecs + i;
          _mm512_store_si512(dst + at, 2 * r < n
                                           ? _mm512_and_si512(_mm512_loadu_si512(src + at), keep)
                                           : keep);
        }
      }
      return reinterpret_cast<const char*>(vlast);
    };
    // Two tiles of 16 keys a step: their q·k, softmax and p·v run side by side, two chains
    // of tile products where one tile alone leaves the tile unit waiting on each product.
    for (int64_t key = u.k0; key < u.k1; key += 32) {
      if (stores && key + 32 >= u.k1) {  // the last step: the newest key goes in first
        const int64_t t = u.k1 - 1;
        const int64_t blk = table[t / BS];
        const at::BFloat16* fresh = q + s * q_stride + (H + h) * D;
        batchlens::write_packed(kc + h * ks.head + blk * ks.block,
                                vc + h * vs.head + blk * vs.block, fresh, fresh + KVH * D, t % BS,
                                BS, D);
        asm volatile("" ::: "memory");
      }
      const bool two = key + 16 < u.k1;
      const int64_t next_end = std::min<int64_t>(key + 64, u.k1);
      for (int64_t next = key + 32; next < next_end; next += 16) {
        // the next step's K into L1 while this one runs; its V once this step's q·k is
        // issued, so that the tile products do not queue behind all of the misses
        const char* kn = k_at(next);
        for (int r = 0; r < D / 2; ++r) _mm_prefetch(kn + r * k_row, _MM_HINT_T0);
      }
      // and the first two lines of K and V of the step after next into L2: with blocks
      // shuffled over the pool every tile starts on lines nothing has asked for, and the
      // next step's own prefetches wait on the core's few L1 misses in flight; from two
      // lines in a row the L2 prefetcher can bring in the rest of the block by itself
      for (int64_t far = key + 64; far < std::min<int64_t>(key + 96, u.k1); far += 16) {
        const char* kf = k_at(far);
        const char* vf = v_at(far);
        for (int c = 0; c < 128; c += 64) {
          _mm_prefetch(kf + c, _MM_HINT_T1);
          _mm_prefetch(vf + c, _MM_HINT_T1);
        }
      }
      const char* kt[2] = {k_at(key), two ? k_at(key + 16) : nullptr};
      _tile_zero(0);
      if (two) _tile_zero(7);
      for (int i = 0; i < QT; ++i) {
        _tile_loadd(4, reinterpret_cast<const char*>(qa) + 64 * i, D * 2);
        _tile_loadd(6, kt[0] + 16 * i * k_row, k_row);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(6, kt[1] + 16 * i * k_row, k_row);
          _tile_dpbf16ps(7, 4, 6);
        }
      }
      for (int64_t next = key + 32; next < next_end; next += 16) {
        const char* vn = v_at(next);
        for (int c = 0; c < 8 * D * 4; c += 64) _mm_prefetch(vn + c, _MM_HINT_T0);
      }
      _tile_stored(0, scores[0], 64);
      if (two) _tile_stored(7, scores[1], 64);
      asm volatile("" ::: "memory");
      float corr[16];
      bool grew[16];
      const __m512 sc = _mm512_set1_ps(scale);
      for (int r = 0; r < M; ++r) {
        const auto valid = [&](int64_t from) {
          return first_lanes(std::clamp<int64_t>(end[r] - from, 0, 16));
        };
        __m512 p[2];
        if (two) {
          grew[r] = softmax_tiles(_mm512_mul_ps(_mm512_load_ps(scores[0][r]), sc), valid(key),
                                  _mm512_mul_ps(_mm512_load_ps(scores[1][r]), sc),
                                  valid(key + 16), m[r], l[r], p[0], p[1], corr[r]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(p16[1][r]),
                             (__m256i)_mm512_cvtneps_pbh(p[1]));
        } else {
          grew[r] = softmax_tile(_mm512_mul_ps(_mm512_load_ps(scores[0][r]), sc), valid(key),
                                 m[r], l[r], p[0], corr[r]);
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(p16[0][r]),
                           (__m256i)_mm512_cvtneps_pbh(p[0]));
      }
      const char* vt[2] = {v_tile(key), two ? v_tile(key + 16) : nullptr};
      asm volatile("" ::: "memory");
      _tile_loadd(1, p16[0], 32);
      if (two) _tile_loadd(5, p16[1], 32);
      for (int c = 0; c < VS; c += 2) {  // two slices at a time, in tiles 7 and 0
        _tile_zero(7);
        _tile_zero(0);
        _tile_loadd(2, vt[0] + 64 * c, v_row);
        _tile_dpbf16ps(7, 1, 2);
        _tile_loadd(3, vt[0] + 64 * (c + 1), v_row);
        _tile_dpbf16ps(0, 1, 3);
        if (two) {
          _tile_loadd(2, vt[1] + 64 * c, v_row);
          _tile_dpbf16ps(7, 5, 2);
          _tile_loadd(3, vt[1] + 64 * (c + 1), v_row);
          _tile_dpbf16ps(0, 5, 3);
        }
        _tile_stored(7, pv[c], 64);
        _tile_stored(0, pv[c + 1], 64);
      }
      asm volatile("" ::: "memory");
      for (int r = 0; r < M; ++r) {
        const __m512 k = _mm512_set1_ps(grew[r] ? corr[r] : 1.f);
        for (int c = 0; c < VS; ++c)
          _mm512_store_ps(acc[r] + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(acc[r] + 16 * c), k,
                                                           _mm512_load_ps(pv[c][r])));
      }
    }
    // each row's partial: a single row's goes to run_units to write or merge; a run is
    // never cut into pieces, so its rows are written here
    Partial<G, D> row;
    for (int i = 0; i < u.rows; ++i) {
      Partial<G, D>& p = u.rows == 1 ? part : row;
      for (int g = 0; g < G; ++g) {
        p.m[g] = m[i * G + g], p.l[g] = _mm512_reduce_add_ps(l[i * G + g]);
        std::memcpy(p.acc[g], acc[i * G + g], sizeof p.acc[g]);
      }
      if (u.rows > 1) write_out<at::BFloat16, G, D>(out, H, s + i, h, p, nullptr);
    }
  };
  const std::vector<int32_t> runs = row_runs(tables, lens, S, BS, max_blocks, G);
  run_units<G, D, AmxScope>(lens, S, KVH, body,
                            [&](int64_t s, int64_t h, const Partial<G, D>& p) {
                              write_out<at::BFloat16, G, D>(out, H, s, h, p, nullptr);
                            },
                            runs.data());
}
#endif

// The compiled instances: G = 1..8 query heads per kv head, head_dim 64 or 128 (SmolLM2,
// Llama, Mistral, Qwen2). Another shape returns false and runs the portable kernel.
template <typename T>
bool decode_avx512_any(const T* q, int64_t q_stride, const T* kc, const T* vc,
                       const int32_t* tables, const int32_t* lens, T* out, int64_t S, int64_t H,
                       int64_t KVH, int64_t NB, int64_t BS, int64_t D, int64_t max_blocks,
                       float scale) {
#define BATCHLENS_ARGS q, q_stride, kc, vc, tables, lens, out, S, H, KVH, NB, BS, max_blocks, scale
  return with_group(H / KVH, [&](auto group) {
    constexpr int G = decltype(group)::value;
    if constexpr (std::is_same_v<T, at::BFloat16> && kHasDotBf16) {
      if (D == 64) return decode_bf16_dp<G, 2>(BATCHLENS_ARGS), true;
      if (D == 128) return decode_bf16_dp<G, 4>(BATCHLENS_ARGS), true;
    }
    if (D == 64) return decode_avx512<T, G, 4>(BATCHLENS_ARGS), true;
    if (D == 128) return decode_avx512<T, G, 8>(BATCHLENS_ARGS), true;
    return false;
  });
#undef BATCHLENS_ARGS
}
#endif  // __AVX512F__

#if !(defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
      defined(__AVX512BF16__))
constexpr bool kHasAmx = false;
template <int G, int D>  // never called: kHasAmx is false without AMX
void decode_amx(const at::BFloat16*, int64_t, at::BFloat16*, at::BFloat16*, const int32_t*,
                const int32_t*, at::BFloat16*, int64_t, int64_t, int64_t, batchlens::BlockStrides,
                batchlens::BlockStrides, int64_t, int64_t, float, bool) {}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kDotBf16Built = true;
#else
constexpr bool kDotBf16Built = false;
template <int G, int D>  // never called: kDotBf16Built is false without AVX512_BF16
void decode_bf16_packed(const at::BFloat16*, int64_t, at::BFloat16*, at::BFloat16*,
                        const int32_t*, const int32_t*, at::BFloat16*, int64_t, int64_t, int64_t,
                        batchlens::BlockStrides, batchlens::BlockStrides, int64_t, int64_t, float,
                        bool) {}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 kernel (no AVX-512): float32 FMAs on 8 lanes, keys 8 at a time, the same
// structure as decode_avx512. AVX2 has 16 vector registers, so the accumulators live in
// an L1-resident array and p·v runs one 8-wide slice of head_dim at a time.
// Lane t of the result is the sum of v[t]'s 8 lanes.
inline __m256 hsum8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // b0: low 128 bits the low-half sums of v0..v3, high 128 bits their high-half sums
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hadd8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename T, int G, int DV>
void decode_avx2(const T* q, int64_t q_stride, const T* kc, const T* vc, const int32_t* tables,
                 const int32_t* lens, T* out, int64_t S, int64_t H, int64_t KVH, int64_t NB,
                 int64_t BS, int64_t max_blocks, float scale) {
  constexpr int D = 8 * DV;
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
  const auto body = [&](const Unit& u, Partial<G, D>& part) {
    const int64_t s = u.s, h = u.h;
    alignas(32) float qf[G][D], prob[G][8];
    float(*acc)[D] = part.acc;  // accumulated in place: AVX2 has too few registers for it
    float* m = part.m;
    float* l = part.l;
    for (int g = 0; g < G; ++g) {
      const T* qs = q + s * q_stride + (h * G + g) * D;
      for (int j = 0; j < DV; ++j) {
        _mm256_store_ps(qf[g] + 8 * j, _mm256_mul_ps(load8(qs + 8 * j), _mm256_set1_ps(scale)));
        _mm256_store_ps(acc[g] + 8 * j, _mm256_setzero_ps());
      }
      m[g] = -std::numeric_limits<float>::max();
      l[g] = 0.f;
    }
    KeyWalk<T, 8> walk(tables + s * max_blocks, h, NB, BS, D, u.k0, u.k1);
    for (int64_t start = 0; start < walk.len; start += 8) {
      const int64_t n = std::min<int64_t>(8, walk.len - start);
      const int64_t* row = walk.tile(start, kc, vc);
      const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
      for (int g = 0; g < G; ++g) {
        __m256 dots[8];
        for (int t = 0; t < 8; ++t) {
          __m256 a = _mm256_setzero_ps();
          if (t < n)
            for (int j = 0; j < DV; ++j)
              a = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + 8 * j), load8(kc + row[t] + 8 * j), a);
          dots[t] = a;
        }
        const __m256 x = _mm256_blendv_ps(lowest, hsum8(dots), valid);
        const float bmax = std::max(m[g], hmax8(x));
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, _mm256_set1_ps(bmax))), valid);
        _mm256_store_ps(prob[g], p);
        const float corr = std::exp(m[g] - bmax);
        l[g] = l[g] * corr + hadd8(p);
        m[g] = bmax;
        for (int j = 0; j < DV; ++j)
          _mm256_store_ps(acc[g] + 8 * j,
                          _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * j), _mm256_set1_ps(corr)));
      }
      for (int j = 0; j < DV; ++j) {
        __m256 a[G];
        for (int g = 0; g < G; ++g) a[g] = _mm256_load_ps(acc[g] + 8 * j);
        for (int64_t t = 0; t < n; ++t) {
          const __m256 v = load8(vc + row[t] + 8 * j);
          for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(prob[g][t]), v, a[g]);
        }
        for (int g = 0; g < G; ++g) _mm256_store_ps(acc[g] + 8 * j, a[g]);
      }
    }
  };
  run_units<G, D>(lens, S, KVH, body, [&](int64_t s, int64_t h, const Partial<G, D>& p) {
    write_out<T, G, D>(out, H, s, h, p, nullptr);
  });
}

// bfloat16 on AVX2: each 32-byte load of K or V holds 16 dimensions, and its even and odd
// ones become float32 by a shift and by a mask, with no shuffle, once per key for all G
// query heads (the float32 kernel above widens a key once per head). The query is kept
// split the same way, so q·k sums even and odd products; p·v accumulates head_dim in this
// split order, undone at the end:
//
//   acc[2c]   lane i <- dim 16c + 2i        acc[2c+1] lane i <- dim 16c + 2i + 1
template <int G, int DC>
void decode_avx2_bf16(const at::BFloat16* q, int64_t q_stride, const at::BFloat16* kc,
                      const at::BFloat16* vc, const int32_t* tables, const int32_t* lens,
                      at::BFloat16* out, int64_t S, int64_t H, int64_t KVH, int64_t NB, int64_t BS,
                      int64_t max_blocks, float scale) {
  constexpr int D = 16 * DC;
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto even = [](__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); };
  const auto odd = [&](__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, high)); };
  const auto load = [](const at::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  const auto body = [&](const Unit& u, Partial<G, D>& part) {
    const int64_t s = u.s, h = u.h;
    alignas(32) float qf[G][2 * DC][8], prob[G][16], corr[G];
    float(*acc)[D] = part.acc;  // accumulated in place: AVX2 has too few registers for it
    float* m = part.m;
    float* l = part.l;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* qs = q + s * q_stride + (h * G + g) * D;
      for (int c = 0; c < DC; ++c) {
        const __m256i x = load(qs + 16 * c);
        _mm256_store_ps(qf[g][2 * c], _mm256_mul_ps(even(x), sc));
        _mm256_store_ps(qf[g][2 * c + 1], _mm256_mul_ps(odd(x), sc));
      }
      for (int j = 0; j < 2 * DC; ++j) _mm256_store_ps(acc[g] + 8 * j, _mm256_setzero_ps());
      m[g] = -std::numeric_limits<float>::max();
      l[g] = 0.f;
    }
    KeyWalk<at::BFloat16, 16> walk(tables + s * max_blocks, h, NB, BS, D, u.k0, u.k1);
    for (int64_t start = 0; start < walk.len; start += 16) {
      const int64_t n = std::min<int64_t>(16, walk.len - start);
      const int64_t* row = walk.tile(start, kc, vc);
      __m256 dots[G][16];
      for (int t = 0; t < 16; ++t) {
        __m256 a[G], b[G];  // even and odd products: two chains per head
        for (int g = 0; g < G; ++g) a[g] = b[g] = _mm256_setzero_ps();
        if (t < n)
          for (int c = 0; c < DC; ++c) {
            const __m256i x = load(kc + row[t] + 16 * c);
            const __m256 ke = even(x), ko = odd(x);
            for (int g = 0; g < G; ++g) {
              a[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g][2 * c]), ke, a[g]);
              b[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g][2 * c + 1]), ko, b[g]);
            }
          }
        for (int g = 0; g < G; ++g) dots[g][t] = _mm256_add_ps(a[g], b[g]);
      }
      // a tile of 16 keys: one max, one rescale and one sum for twice the keys of a vector
      const __m256 fill = _mm256_set1_ps(static_cast<float>(n));
      const __m256 valid0 = _mm256_cmp_ps(lane, fill, _CMP_LT_OQ);
      const __m256 valid1 = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.f)), fill,
                                          _CMP_LT_OQ);
      for (int g = 0; g < G; ++g) {
        const __m256 x0 = _mm256_blendv_ps(lowest, hsum8(dots[g]), valid0);
        const __m256 x1 = _mm256_blendv_ps(lowest, hsum8(dots[g] + 8), valid1);
        const float bmax = std::max(m[g], hmax8(_mm256_max_ps(x0, x1)));
        const __m256 top = _mm256_set1_ps(bmax);
        const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(x0, top)), valid0);
        const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(x1, top)), valid1);
        _mm256_store_ps(prob[g], p0);
        _mm256_store_ps(prob[g] + 8, p1);
        corr[g] = bmax > m[g] ? std::exp(m[g] - bmax) : 1.f;  // the max mostly holds
        l[g] = l[g] * corr[g] + hadd8(_mm256_add_ps(p0, p1));
        m[g] = bmax;
      }
      for (int c = 0; c < DC; ++c) {
        __m256 a[G], b[G];  // the running sums, rescaled to this tile's max as they load
        for (int g = 0; g < G; ++g) {
          const __m256 k = _mm256_set1_ps(corr[g]);
          a[g] = _mm256_mul_ps(_mm256_load_ps(acc[g] + 16 * c), k);
          b[g] = _mm256_mul_ps(_mm256_load_ps(acc[g] + 16 * c + 8), k);
        }
        for (int64_t t = 0; t < n; ++t) {
          const __m256i x = load(vc + row[t] + 16 * c);
          const __m256 ve = even(x), vo = odd(x);
          for (int g = 0; g < G; ++g) {
            const __m256 p = _mm256_set1_ps(prob[g][t]);
            a[g] = _mm256_fmadd_ps(p, ve, a[g]);
            b[g] = _mm256_fmadd_ps(p, vo, b[g]);
          }
        }
        for (int g = 0; g < G; ++g) {
          _mm256_store_ps(acc[g] + 16 * c, a[g]);
          _mm256_store_ps(acc[g] + 16 * c + 8, b[g]);
        }
      }
    }
  };
  int perm[D];  // where dimension d sits in acc (the order above)
  for (int d = 0; d < D; ++d) perm[d] = 8 * (2 * (d / 16) + d % 2) + d % 16 / 2;
  run_units<G, D>(lens, S, KVH, body, [&](int64_t s, int64_t h, const Partial<G, D>& p) {
    write_out<at::BFloat16, G, D>(out, H, s, h, p, perm);
  });
}

// As decode_avx512_any: G = 1..8, head_dim 64 or 128, else false (the portable kernel).
template <typename T>
bool decode_avx2_any(const T* q, int64_t q_stride, const T* kc, const T* vc,
                     const int32_t* tables, const int32_t* lens, T* out, int64_t S, int64_t H,
                     int64_t KVH, int64_t NB, int64_t BS, int64_t D, int64_t max_blocks,
                     float scale) {
#define BATCHLENS_ARGS q, q_stride, kc, vc, tables, lens, out, S, H, KVH, NB, BS, max_blocks, scale
  return with_group(H / KVH, [&](auto group) {
    constexpr int G = decltype(group)::value;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (D == 64) return decode_avx2_bf16<G, 4>(BATCHLENS_ARGS), true;
      if (D == 128) return decode_avx2_bf16<G, 8>(BATCHLENS_ARGS), true;
    }
    if (D == 64) return decode_avx2<T, G, 8>(BATCHLENS_ARGS), true;
    if (D == 128) return decode_avx2<T, G, 16>(BATCHLENS_ARGS), true;
    return false;
  });
#undef BATCHLENS_ARGS
}
#endif

// The path BATCHLENS_KERNEL_PATH forces: avx2 or portable, a slower one on purpose (tests,
// measuring); empty where it is unset
std::string forced_path() {
  const char* forced = std::getenv("BATCHLENS_KERNEL_PATH");
  const std::string path = forced ? forced : "";
  TORCH_CHECK(path.empty() || path == "avx2" || path == "portable",
              "BATCHLENS_KERNEL_PATH must be unset, avx2 or portable, got ", path);
  return path;
}

}  // namespace

namespace batchlens {

bool paged_packed_supported(int64_t head_dim, int64_t group, int64_t block_size) {
  return ((kHasAmx && bf16_linear_amx()) || kDotBf16Built) && block_size % 16 == 0 &&
         (head_dim == 64 || head_dim == 128) && group >= 1 && group <= 8;
}

bool attention_stores_kv(const at::Tensor& k_cache, int64_t num_heads,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& slot_mapping) {
  if (k_cache.dim() != 5 || k_cache.scalar_type() != at::kBFloat16 || !forced_path().empty())
    return false;
  const int64_t KVH = k_cache.size(0), D = k_cache.size(2) * 2, BS = k_cache.size(3);
  if (num_heads % KVH != 0 || !paged_packed_supported(D, num_heads / KVH, BS)) return false;
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto sm = slot_mapping.contiguous();
  const int64_t S = cl.numel(), max_blocks = bt.size(1);
  if (bt.scalar_type() != at::kInt || cl.scalar_type() != at::kInt ||
      sm.scalar_type() != at::kLong || sm.numel() != S || bt.size(0) != S)
    return false;
  const int32_t* tp = bt.data_ptr<int32_t>();
  const int32_t* lp = cl.data_ptr<int32_t>();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {  // each row's slot: where its newest key goes
    const int64_t t = lp[s] - 1;
    if (t < 0 || t >= max_blocks * BS || sp[s] != tp[s * max_blocks + t / BS] * BS + t % BS)
      return false;
  }
  const std::vector<int32_t> runs = row_runs(tp, lp, S, BS, max_blocks, num_heads / KVH);
  return std::all_of(runs.begin(), runs.end(), [](int32_t n) { return n == 1; });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, bool store_kv,
                                  const at::Tensor& into) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3, "q must be [S, H, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const bool packed = k_cache.dim() == 5;
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1);
  const int64_t BS = packed ? k_cache.size(3) : k_cache.size(2);
  if (packed) {
    const std::vector<int64_t> k_shape{KVH, NB, D / 2, BS, 2}, v_shape{KVH, NB, BS / 2, D, 2};
    TORCH_CHECK(k_cache.sizes() == k_shape && v_cache.sizes() == v_shape && BS % 2 == 0,
                "packed caches must be K [KVH, NB, D/2, BS, 2] and V [KVH, NB, BS/2, D, 2]");
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == D,
                "caches must be [KVH, NB, BS, D] of one shape, head_dim that of q");
  }
  TORCH_CHECK(H % KVH == 0, "the query heads must be a multiple of the kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S && context_lens.numel() == S,
              "block_tables must be [S, max_blocks] and context_lens [S]");
  // packed caches are read where they lie (K and V may be views of one pool tensor); caches
  // in rows contiguous
  auto kc = packed ? k_cache : k_cache.contiguous();
  auto vc = packed ? v_cache : v_cache.contiguous();
  const batchlens::BlockStrides in_rows{NB * BS * D, BS * D};
  const batchlens::BlockStrides ks = packed ? batchlens::block_strides(kc, "k_cache") : in_rows;
  const batchlens::BlockStrides vs = packed ? batchlens::block_strides(vc, "v_cache") : in_rows;
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
  // q may be rows of a wider tensor (the fused QKV output): read in place where it can be
  auto qc = q.stride(2) == 1 && q.stride(1) == D ? q : q.contiguous();
  TORCH_CHECK(!into.defined() || (into.sizes() == at::IntArrayRef({S, H, D}) &&
                                   into.is_contiguous() && into.scalar_type() == q.scalar_type()),
              "paged_decode_attention: the output must be a contiguous [S, H, D] tensor in q's "
              "dtype");
  auto out = into.defined() ? into : at::empty({S, H, D}, q.options());
  const float sc = static_cast<float>(scale);
  const std::string path = forced_path();
#define BATCHLENS_TRY(any, T)                                                                  \
  if (qc.scalar_type() == c10::CppTypeToScalarType<T>::value &&                                \
      any<T>(qc.data_ptr<T>(), qc.stride(0), kc.data_ptr<T>(), vc.data_ptr<T>(), tp, lp,       \
             out.data_ptr<T>(), S, H, KVH, NB, BS, D, max_blocks, sc))                         \
    return out;
  const bool packed_path = packed && path.empty() && qc.scalar_type() == at::kBFloat16 &&
                           paged_packed_supported(D, H / KVH, BS);
  // the caller has asked attention_stores_kv; q must still be rows of the QKV output (a
  // lone row's stride is whatever its view says)
  TORCH_CHECK(!store_kv || (packed_path && qc.data_ptr() == q.data_ptr() &&
                            (S == 1 || qc.stride(0) >= (H + 2 * KVH) * D)),
              "paged_decode_attention: store_kv needs the packed kernel and q as rows of the "
              "QKV output");
  if (packed_path) {
    const bool amx = kHasAmx && bf16_linear_amx();  // else AVX512_BF16's dot products
    const auto packed_run = [&](auto group) {
      constexpr int G = decltype(group)::value;
      const auto run = amx      ? (D == 64 ? decode_amx<G, 64> : decode_amx<G, 128>)
                       : D == 64 ? decode_bf16_packed<G, 64>
                                 : decode_bf16_packed<G, 128>;
      run(qc.data_ptr<at::BFloat16>(), qc.stride(0), kc.data_ptr<at::BFloat16>(),
          vc.data_ptr<at::BFloat16>(), tp, lp, out.data_ptr<at::BFloat16>(), S, H, KVH, ks, vs,
          BS, max_blocks, sc, store_kv);
      return true;
    };
    if (with_group(H / KVH, packed_run)) return out;
  }
#if defined(__AVX512F__)
  if (path.empty() && !packed) {
    BATCHLENS_TRY(decode_avx512_any, at::BFloat16)
    BATCHLENS_TRY(decode_avx512_any, float)
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (path != "portable" && !packed) {
    BATCHLENS_TRY(decode_avx2_any, at::BFloat16)
    BATCHLENS_TRY(decode_avx2_any, float)
  }
#endif
#undef BATCHLENS_TRY
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(qc.data_ptr<scalar_t>(), qc.stride(0), kc.data_ptr<scalar_t>(),
                     vc.data_ptr<scalar_t>(), tp, lp, out.data_ptr<scalar_t>(), S, H, KVH, ks, vs,
                     BS, D, max_blocks, sc, packed);
  });
  return out;
}

}  // namespace batchlens

namespace {

at::Tensor paged_decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& context_lens, double scale) {
  return batchlens::paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                           false);
}

}  // namespace

TORCH_LIBRARY(batchlens, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("paged_packed_supported(int head_dim, int group, int block_size) -> bool",
        &batchlens::paged_packed_supported);
  m.def("attention_stores_kv(Tensor k_cache, int num_heads, Tensor block_tables, "
        "Tensor context_lens, Tensor slot_mapping) -> bool", &batchlens::attention_stores_kv);
}

TORCH_LIBRARY_IMPL(batchlens, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_op);
}
