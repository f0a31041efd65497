// A step's LoRA deltas on one projection in one call (workers/lora/batch.py's loop, moved here): for each adapter
// group g (its rows of the flat batch) and each slice s of the projection g's adapter targets,
//   y[rows_g, lo_s:hi_s] += ((x[rows_g] A_g^T)[:, rlo_s:rhi_s] B_s^T) * scale_g
// with the Python loop's arithmetic exactly: both products in fgemm's fixed order (flinear's numerics, whatever
// the rows or the split), the scale as one fp32 multiply, the add one fp32 rounding.
//
// Threads: the work is cut into items, each a group's run of rows (a whole group where it is small, chunks of
// rows where it is large: a 512-token prefill chunk of one adapter is one group), and the threads take items
// as they come. An item does its rows' shrink and then every slice's expand and add, in slice order. fgemm's
// result for an element does not depend on the rows computed beside it, so the cut changes no bit; a row is in
// one item (checked: where a row index repeats, everything runs on one thread in group order, the old order),
// so no two writers ever touch one element of y.
//
// The expand (K = the rank, 4-64) through fgemm spends most of its time in the horizontal sum of each output's
// 8 lanes. Where K <= kLanesMaxK, the AVX2 path instead puts 8 outputs of a row in the 8 lanes of a vector:
// B's columns are widened and transposed into a small panel (lane k of fgemm's accumulators for 8 outputs is
// then one vector), and the lanes' tree ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) is done vertically:
// the same fmas from +0, the same +0 padding past K, the same adds in the same order, per element: fgemm's bits
// (tests/test_lora_add_kernel.py). Measured faster than fgemm from 1 row a group up (~1.9x at 512 rows). An item
// of at most kRowsMaxN rows (a decode step's group) skips the panel: lora_rows.h reads B in its own layout, with
// the same bits (the panel's transpose cost more than the multiply-adds it served there), and so does such an
// item's shrink (shrink_rows). For a larger K, and on the scalar path (KVGATE_FGEMM_ISA=scalar), fgemm itself.
// Included by qgemm.cpp after fgemm.h.
#pragma once

#include "lora_rows.h"
#include "torch_api.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

namespace lora_add_impl {

static constexpr int64_t kLanesMaxK = 64;     // the panel (kLanesMaxK x kPanel fp32) stays in L1
static constexpr int64_t kPanel = 96;         // output columns a panel holds (a multiple of 24)
static constexpr int64_t kRowsMaxN = 4;       // items of up to this many rows expand through lora_rows.h

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// r[j] <- lane j of every r[c]: an 8 x 8 transpose.
static inline __attribute__((always_inline)) void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// wt (kp, kPanel) <- columns [c0, c0 + w) of b (cols, K) transposed, widened exactly (fgemm's loads); +0 for
// k >= K (fgemm's step-3 padding) and for the columns past w up to the next multiple of 8.
template <typename W>
static void pack(const W* b, int64_t K, int64_t kp, int64_t c0, int64_t w, float* wt) {
  for (int64_t cb = 0; cb < w; cb += 8)
    for (int64_t k0 = 0; k0 < kp; k0 += 8) {
      const bool tail = k0 + 8 > K;
      const __m256i mask = fgemm::avx2::tail_mask(K - k0);
      __m256 r[8];
      for (int c = 0; c < 8; ++c) {
        const W* p = b + (c0 + cb + c) * K + k0;
        r[c] = cb + c >= w ? _mm256_setzero_ps()
               : tail      ? fgemm::avx2::load8<true>(p, mask)
                           : fgemm::avx2::load8<false>(p, mask);
      }
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wt + (k0 + j) * kPanel + cb, r[j]);
    }
}

// Lane j of fgemm's accumulators for the 8V outputs of columns wt[:, 0:8V] and the row h (kp values, +0 past
// K): a = +0, then a = fma(h[k0 + j], w[k0 + j], a) for k0 = 0, 8, ... (past K: fma(+0, +0, a), as fgemm).
template <int V>
static inline __attribute__((always_inline)) void lane(const float* h, const float* wt, int64_t kp, int j,
                                                        __m256 (&a)[V]) {
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) a[v] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < kp; k0 += 8) {
    const __m256 xv = _mm256_broadcast_ss(h + k0 + j);
    const float* w = wt + (k0 + j) * kPanel;
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * v), a[v]);
  }
}

// t[v] = lane i + lane j: one pair of the tree's first level.
template <int V>
static inline __attribute__((always_inline)) void pair(const float* h, const float* wt, int64_t kp, int i, int j,
                                                        __m256 (&t)[V]) {
  __m256 q[V];
  lane<V>(h, wt, kp, i, t);
  lane<V>(h, wt, kp, j, q);
  for (int v = 0; v < V; ++v) t[v] = _mm256_add_ps(t[v], q[v]);
}

// s[v] = fgemm's sum for the 8 outputs of columns 8v..8v+7: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
template <int V>
static inline __attribute__((always_inline)) void sums(const float* h, const float* wt, int64_t kp, __m256 (&s)[V]) {
  __m256 lo[V], hi[V], t[V];
  pair<V>(h, wt, kp, 0, 4, lo);
  pair<V>(h, wt, kp, 2, 6, t);
  for (int v = 0; v < V; ++v) lo[v] = _mm256_add_ps(lo[v], t[v]);
  pair<V>(h, wt, kp, 1, 5, hi);
  pair<V>(h, wt, kp, 3, 7, t);
  for (int v = 0; v < V; ++v) hi[v] = _mm256_add_ps(hi[v], t[v]);
  for (int v = 0; v < V; ++v) s[v] = _mm256_add_ps(lo[v], hi[v]);
}

// y[r[i], lo:lo + cols] += (hs[i] b^T) * sc for i < n: hs (n, kp) with +0 past K, b (cols, K). wt: kp * kPanel
// floats of scratch.
template <typename W>
static void expand_add(int64_t n, const float* hs, int64_t kp, const W* b, int64_t K, int64_t cols, float* yp,
                       const int64_t* r, int64_t N, int64_t lo, float sc, float* wt) {
  const __m256 scv = _mm256_set1_ps(sc);
  for (int64_t c0 = 0; c0 < cols; c0 += kPanel) {
    const int64_t w = std::min(kPanel, cols - c0), full = w / 8;
    pack<W>(b, K, kp, c0, w, wt);
    for (int64_t i = 0; i < n; ++i) {
      const float* h = hs + i * kp;
      float* y = yp + r[i] * N + lo + c0;
      int64_t v = 0;
      for (; v + 3 <= full; v += 3) {
        __m256 s[3];
        sums<3>(h, wt + 8 * v, kp, s);
        for (int q = 0; q < 3; ++q)
          _mm256_storeu_ps(y + 8 * (v + q), _mm256_add_ps(_mm256_loadu_ps(y + 8 * (v + q)), _mm256_mul_ps(s[q], scv)));
      }
      for (; v < full; ++v) {
        __m256 s[1];
        sums<1>(h, wt + 8 * v, kp, s);
        _mm256_storeu_ps(y + 8 * v, _mm256_add_ps(_mm256_loadu_ps(y + 8 * v), _mm256_mul_ps(s[0], scv)));
      }
      if (w % 8) {  // the last < 8 columns: the same sums, added one by one (nothing past the slice is touched)
        __m256 s[1];
        sums<1>(h, wt + 8 * full, kp, s);
        alignas(32) float t[8];
        _mm256_store_ps(t, _mm256_mul_ps(s[0], scv));
        for (int64_t j = 0; j < w % 8; ++j) y[8 * full + j] += t[j];
      }
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

// One item: rows [i0, i1) of group g.
struct Item {
  int64_t g, i0, i1;
};

// A thread's scratch, reused across its items.
struct Scratch {
  std::vector<float> xs, h, hs, d;
  std::vector<float*> y;  // lora_rows' output rows
  alignas(32) float wt[kLanesMaxK * kPanel];
};

// One lora_add call, its arguments checked: x (T, K), y (T, N), per group rows, a and scale, per slice its
// group's index, (lo, hi, rlo, rhi) and b; first[g] .. first[g + 1] the slices of group g.
struct Call {
  const float* x;
  float* y;
  int64_t T, K, N;
  const std::vector<torch::Tensor>& rows;
  const std::vector<torch::Tensor>& a;
  const std::vector<double>& scale;
  const std::vector<int64_t>& s_cols;
  const std::vector<torch::Tensor>& b;
  std::vector<int64_t> first;
  bool repeats;  // a row index in two places: the items could not run side by side
};

// Checks the arguments (bad input raises, nothing is written) and fills c.first and c.repeats.
static void check_call(Call& c, const std::vector<int64_t>& s_group) {
  const int64_t G = static_cast<int64_t>(c.rows.size()), S = static_cast<int64_t>(c.b.size());
  TORCH_CHECK(static_cast<int64_t>(c.a.size()) == G && static_cast<int64_t>(c.scale.size()) == G,
              "one a, scale a group");
  TORCH_CHECK(static_cast<int64_t>(s_group.size()) == S && static_cast<int64_t>(c.s_cols.size()) == 4 * S,
              "a group and (lo, hi, rlo, rhi) a slice");
  std::vector<uint8_t> seen(c.T, 0);
  c.repeats = false;
  for (int64_t g = 0; g < G; ++g) {
    const torch::Tensor &rg = c.rows[g], &ag = c.a[g];
    TORCH_CHECK(rg.scalar_type() == torch::kInt64 && rg.is_contiguous() && ag.is_contiguous() &&
                    fgemm_wtype(ag.scalar_type()).has_value() && ag.dim() == 2 && ag.size(1) == c.K,
                "group ", g, ": rows int64, a (R, in) contiguous fp32, fp16 or bf16");
    const int64_t* r = rg.data_ptr<int64_t>();
    for (int64_t i = 0; i < rg.numel(); ++i) {
      TORCH_CHECK(0 <= r[i] && r[i] < c.T, "row out of range");
      c.repeats |= seen[r[i]] != 0;
      seen[r[i]] = 1;
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t g = s_group[s], lo = c.s_cols[4 * s], hi = c.s_cols[4 * s + 1], rlo = c.s_cols[4 * s + 2],
                  rhi = c.s_cols[4 * s + 3];
    TORCH_CHECK(0 <= g && g < G && 0 <= lo && lo < hi && hi <= c.N && 0 <= rlo && rlo < rhi && rhi <= c.a[g].size(0),
                "slice ", s, ": bad group or columns");
    TORCH_CHECK(c.b[s].is_contiguous() && fgemm_wtype(c.b[s].scalar_type()).has_value() && c.b[s].dim() == 2 &&
                    c.b[s].size(0) == hi - lo && c.b[s].size(1) == rhi - rlo,
                "slice ", s, ": b must be (hi - lo, rhi - rlo) contiguous fp32, fp16 or bf16");
  }
  for (int64_t s = 1; s < S; ++s) TORCH_CHECK(s_group[s - 1] <= s_group[s], "slices must come in group order");
  c.first.assign(G + 1, 0);  // they come in group order: count each group's, then prefix sums
  for (int64_t s = 0; s < S; ++s) ++c.first[s_group[s] + 1];
  for (int64_t g = 0; g < G; ++g) c.first[g + 1] += c.first[g];
}

// The items. A group's work a row: its shrink (R K multiply-adds) and its slices' expands. A group is cut into
// chunks (a multiple of 4 rows, fgemm's row block) of about a quarter of a thread's share, none under ~64k
// multiply-adds (below that a thread's start costs more than it saves).
static std::vector<Item> plan_items(const Call& c, int64_t threads) {
  const int64_t G = static_cast<int64_t>(c.rows.size());
  std::vector<int64_t> per_row(G, 0);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (c.rows[g].numel() == 0 || c.first[g] == c.first[g + 1]) continue;
    per_row[g] = c.a[g].size(0) * c.K;
    for (int64_t s = c.first[g]; s < c.first[g + 1]; ++s)
      per_row[g] += (c.s_cols[4 * s + 1] - c.s_cols[4 * s]) * c.b[s].size(1);
    total += static_cast<double>(per_row[g]) * c.rows[g].numel();
  }
  const double target = std::max(total / (4.0 * threads), 65536.0);
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = c.rows[g].numel();
    if (per_row[g] == 0) continue;
    int64_t chunk = n;
    if (threads > 1) {
      const int64_t parts = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(per_row[g]) * n / target));
      chunk = std::max<int64_t>(4, (((n + parts - 1) / parts) + 3) / 4 * 4);
    }
    for (int64_t i0 = 0; i0 < n; i0 += chunk) items.push_back(Item{g, i0, std::min(n, i0 + chunk)});
  }
  return items;
}

// f(p), p: b's data as the weight type its dtype is (fgemm::gemm's three widenings).
template <typename F>
static void with_weights(const torch::Tensor& b, F&& f) {
  const void* p = b.data_ptr();
  switch (*fgemm_wtype(b.scalar_type())) {
    case fgemm::WType::kF16: f(static_cast<const fgemm::F16*>(p)); break;
    case fgemm::WType::kBF16: f(static_cast<const fgemm::BF16*>(p)); break;
    default: f(static_cast<const float*>(p));
  }
}

// Slice s's expand and add for n rows r of shrinks hs (n, kp), +0 past its rank rr, through the lanes path.
static void expand_lanes(const Call& c, int64_t s, int64_t n, const float* hs, int64_t kp, int64_t rr,
                         const int64_t* r, float scl, float* wt) {
  const int64_t lo = c.s_cols[4 * s], hi = c.s_cols[4 * s + 1];
  with_weights(c.b[s], [&](const auto* b) { avx2::expand_add(n, hs, kp, b, rr, hi - lo, c.y, r, c.N, lo, scl, wt); });
}

// The same for an item of a few rows, through lora_rows.h (b read in its own layout); y: the rows' scratch.
static void expand_rows(const Call& c, int64_t s, int64_t n, const float* hs, int64_t kp, int64_t rr,
                        const int64_t* r, float scl, std::vector<float*>& y) {
  const int64_t lo = c.s_cols[4 * s], cols = c.s_cols[4 * s + 1] - lo;
  y.resize(n);
  for (int64_t i = 0; i < n; ++i) y[i] = c.y + r[i] * c.N + lo;
  with_weights(c.b[s], [&](const auto* b) { lora_rows::expand_add(n, hs, kp, b, rr, cols, y.data(), scl); });
}

// The shrink h (n, R) = xs a^T of an item of a few rows through lora_rows.h: a read once, in its own layout, as
// one stream with prefetches (a decode step's A comes from memory). Its bits are fgemm's: lora_rows sums every
// element in fgemm's order, and y = +0 + s * 1 is s exactly (fgemm's sums start from +0 lanes, so s is never -0).
// xs rows are padded with +0 to whole 8-wide steps, which lora_rows reads whole (fgemm's step-3 padding).
static void shrink_rows(const Call& c, int64_t g, int64_t n, const int64_t* r, Scratch& sc) {
  const int64_t R = c.a[g].size(0), K = c.K, kx = (K + 7) / 8 * 8;
  sc.xs.assign(n * kx, 0.f), sc.h.assign(n * R, 0.f);
  for (int64_t i = 0; i < n; ++i) std::copy_n(c.x + r[i] * K, K, sc.xs.data() + i * kx);  // exact copies
  sc.y.resize(n);
  for (int64_t i = 0; i < n; ++i) sc.y[i] = sc.h.data() + i * R;
  with_weights(c.a[g], [&](const auto* a) { lora_rows::expand_add(n, sc.xs.data(), kx, a, K, R, sc.y.data(), 1.f); });
}

// One item: its rows' shrink, then every slice's expand and add in slice order (lanes: the AVX2 path, lora_rows.h
// for items of a few rows, else the lanes expand where the rank allows it and fgemm's shrink; scalar: fgemm's).
static void run_item(const Call& c, const Item& it, bool lanes, Scratch& sc) {
  const int64_t g = it.g, n = it.i1 - it.i0, R = c.a[g].size(0), K = c.K;
  const int64_t* r = c.rows[g].data_ptr<int64_t>() + it.i0;
  if (lanes && n <= kRowsMaxN) {  // a decode step's group: its lora_add 5-8% faster at 2 threads (bench/RESULTS.md)
    shrink_rows(c, g, n, r, sc);
  } else {
    sc.xs.resize(n * K), sc.h.resize(n * R);
    for (int64_t i = 0; i < n; ++i) std::copy_n(c.x + r[i] * K, K, sc.xs.data() + i * K);  // (n, in): exact copies
    fgemm::gemm(fgemm_args(n, R, K, sc.xs.data(), c.a[g], nullptr, sc.h.data()), 0, R);
  }
  const float scl = static_cast<float>(c.scale[g]);  // torch's mul_ by a Python float: the scalar as fp32
  for (int64_t s = c.first[g]; s < c.first[g + 1]; ++s) {
    const int64_t lo = c.s_cols[4 * s], hi = c.s_cols[4 * s + 1], rlo = c.s_cols[4 * s + 2],
                  rr = c.s_cols[4 * s + 3] - rlo;
    if (lanes && rr <= kLanesMaxK) {  // the lanes path: ~1.9x fgemm at 512 rows; few rows: lora_rows.h
      const int64_t kp = (rr + 7) / 8 * 8;
      sc.hs.assign(n * kp, 0.f);
      for (int64_t i = 0; i < n; ++i) std::copy_n(sc.h.data() + i * R + rlo, rr, sc.hs.data() + i * kp);
      if (n <= kRowsMaxN) expand_rows(c, s, n, sc.hs.data(), kp, rr, r, scl, sc.y);
      else expand_lanes(c, s, n, sc.hs.data(), kp, rr, r, scl, sc.wt);
      continue;
    }
    sc.hs.resize(n * rr), sc.d.resize(n * (hi - lo));
    for (int64_t i = 0; i < n; ++i) std::copy_n(sc.h.data() + i * R + rlo, rr, sc.hs.data() + i * rr);
    fgemm::gemm(fgemm_args(n, hi - lo, rr, sc.hs.data(), c.b[s], nullptr, sc.d.data()), 0, hi - lo);
    for (int64_t i = 0; i < n; ++i) {
      float* yr = c.y + r[i] * c.N + lo;
      const float* dr = sc.d.data() + i * (hi - lo);
      for (int64_t j = 0; j < hi - lo; ++j) yr[j] += dr[j] * scl;
    }
  }
}

}  // namespace lora_add_impl

// x (T, in), y (T, out): fp32, contiguous. Per group: rows (n,) int64, a (n_t * r, in), scale. Per slice (in group
// order): its group, columns [lo, hi) of y, columns [rlo, rhi) of the shrink, b (hi - lo, rhi - rlo). a and b are
// fp32, or fp16/bf16 (an adapter saved at 16 bits keeps its width; fgemm widens each weight exactly).
[[maybe_unused]] static void lora_add(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> rows,
                                      std::vector<torch::Tensor> a, std::vector<double> scale,
                                      std::vector<int64_t> s_group, std::vector<int64_t> s_cols,
                                      std::vector<torch::Tensor> b) {
  using namespace lora_add_impl;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() && y.is_contiguous() &&
                  x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32,
              "x (T, in) and y (T, out): contiguous fp32 with one row each");
  Call c{x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), y.size(1), rows, a, scale, s_cols, b, {},
         false};
  check_call(c, s_group);
  const int64_t threads = c.repeats ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const std::vector<Item> items = plan_items(c, threads);
  if (items.empty()) return;
  const bool lanes = fgemm::isa() == fgemm::kAvx2;
  const int64_t I = static_cast<int64_t>(items.size());
  if (threads == 1 || I == 1) {
    auto sc = std::make_unique<Scratch>();
    for (const Item& it : items) run_item(c, it, lanes, *sc);
    return;
  }
  std::atomic<int64_t> next{0};  // the threads take the items in turn: which thread runs one changes no bit
  at::parallel_for(0, std::min(threads, I), 1, [&](int64_t w0, int64_t w1) {
    auto sc = std::make_unique<Scratch>();
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t i = next.fetch_add(1); i < I; i = next.fetch_add(1)) run_item(c, items[i], lanes, *sc);
  });
}
