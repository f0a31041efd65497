// The expand and add of lora_add (lora_add.h) for an item of a few rows: a decode step's groups hold 1-4 rows
// each. There the lanes path's transpose of b into its panel costs more than the multiply-adds it serves (measured
// on a Zen 4: the expand took twice fgemm's shrink over the same bytes), so this path reads b in its own (cols, K)
// layout, each weight widened once and used by every row of the item. lora_add.h's shrink_rows runs such an item's
// shrink through it too (b = A, K = the input width, y the shrink's zeroed rows, scale 1).
//
// Numerics: fgemm's (fgemm.h steps 1-4) for every element, so the bits are the lanes path's and the flinear loop's
// (tests/test_lora_add_kernel.py). An output column c of row h is 8 lane chains a_j = fma(h[k0 + j], b[c][k0 + j],
// a_j) from +0 over k0 = 0, 8, ... (past K: fma(+0, +0, a_j), the same +0 padding), one ymm a column; then
// fgemm's tree ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) for 4 columns at once, each add with the same
// operands in the same order as fgemm::avx2::hsum's; then y += s * scale, as the other paths add.
// Included by lora_add.h, after fgemm.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace lora_rows {

static constexpr int kAhead = 2048;  // bytes of b prefetched ahead of the pass reading them
static constexpr int kCols = 4;  // columns a pass: 2 rows x 4 columns of accumulators + 4 weights fit 16 ymm

// The sums of 4 columns' lanes, [s0, s1, s2, s3]; a[c] holds column c's lanes a0..a7.
static inline __attribute__((always_inline)) __m128 tree4(const __m256 (&a)[kCols]) {
  // (a_j + a_{j+4}) for j = 0..3: column 0 in the low half, column 1 in the high (and 2, 3 likewise)
  const __m256 p01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 p23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  // u = (a0 + a4) + (a2 + a6), v = (a1 + a5) + (a3 + a7): low half [u0, v0, u2, v2], high half [u1, v1, u3, v3]
  const __m256 uv = _mm256_add_ps(_mm256_shuffle_ps(p01, p23, 0x44), _mm256_shuffle_ps(p01, p23, 0xEE));
  const __m256 s = _mm256_hadd_ps(uv, uv);  // u + v: low half [s0, s2, ..], high half [s1, s3, ..]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// One 8-wide step at k0 of every row's chains against kCols columns (kTail: the masked loads past K; the columns
// past w are +0).
template <int R, bool kTail, bool kFull, typename W>
static inline __attribute__((always_inline)) void step(__m256 (&acc)[R][kCols], const float* const* h, const W* b,
                                                       int64_t K, int64_t k0, int w, __m256i mask) {
  __m256 wv[kCols];
#pragma GCC unroll 4
  for (int j = 0; j < kCols; ++j)
    wv[j] = kFull || j < w ? fgemm::avx2::load8<kTail>(b + j * K + k0, mask) : _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i) {
    const __m256 hv = _mm256_loadu_ps(h[i] + k0);
#pragma GCC unroll 4
    for (int j = 0; j < kCols; ++j) acc[i][j] = _mm256_fmadd_ps(hv, wv[j], acc[i][j]);
  }
}

// Rows h[0..R) (each kp floats, +0 past K) against the w <= kCols columns of b from b0 (the columns past w are
// +0 and their sums thrown away), added into y[i] + c. kFull: w is kCols.
template <int R, bool kFull, typename W>
static inline __attribute__((always_inline)) void pass(const float* const* h, const W* b0, int64_t K, int64_t c,
                                                       int w, float* const* y, __m128 scv) {
  __m256 acc[R][kCols];
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kCols; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8) step<R, false, kFull, W>(acc, h, b0, K, k0, w, __m256i{});
  if (k0 < K) step<R, true, kFull, W>(acc, h, b0, K, k0, w, fgemm::avx2::tail_mask(K - k0));  // fgemm's step 3
#pragma GCC unroll 2
  for (int i = 0; i < R; ++i) {
    const __m128 d = _mm_mul_ps(tree4(acc[i]), scv);
    float* yc = y[i] + c;
    if (kFull) {
      _mm_storeu_ps(yc, _mm_add_ps(_mm_loadu_ps(yc), d));
    } else {  // the slice's last columns: nothing past them is touched
      alignas(16) float t[kCols];
      _mm_store_ps(t, d);
      for (int j = 0; j < w; ++j) yc[j] += t[j];
    }
  }
}

// y[i][lo, lo + cols) += (hs[i] b^T) * sc for the n rows of hs (n, kp), +0 past K; y[i] is row i's output row.
// Rows go in pairs (one for an odd last), every pair reading the same columns while they are in L1.
template <typename W>
static void expand_add(int64_t n, const float* hs, int64_t kp, const W* b, int64_t K, int64_t cols,
                       float* const* y, float sc) {
  const __m128 scv = _mm_set1_ps(sc);
  const char* bytes = reinterpret_cast<const char*>(b);
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W)), total = cols * row_bytes;
  for (int64_t c = 0; c < cols; c += kCols) {
    const int w = static_cast<int>(std::min<int64_t>(kCols, cols - c));
    // b comes from memory at a decode step (every resident adapter's weights, past the caches): ask for the
    // pass's worth of bytes kAhead ahead (within b), as the hardware's prefetchers ramp up too slowly over b's
    // short arrays
    const int64_t from = c * row_bytes + kAhead, to = std::min(total, from + kCols * row_bytes);
    for (int64_t off = from; off < to; off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      const float* h[2] = {hs + i * kp, hs + (i + 1) * kp};
      if (w == kCols) pass<2, true, W>(h, b + c * K, K, c, w, y + i, scv);
      else pass<2, false, W>(h, b + c * K, K, c, w, y + i, scv);
    }
    if (i < n) {
      const float* h[1] = {hs + i * kp};
      if (w == kCols) pass<1, true, W>(h, b + c * K, K, c, w, y + i, scv);
      else pass<1, false, W>(h, b + c * K, K, c, w, y + i, scv);
    }
  }
}

}  // namespace lora_rows
#pragma GCC pop_options
