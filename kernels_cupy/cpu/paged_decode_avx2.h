// AVX2 + FMA body of one attention work item (paged_decode.cpp's attend_group), for head sizes D = 8 V, V <= 16.
// The kernel is built with -march=native (its build key carries the CPU), so this is compiled exactly where
// the CPU has AVX2 and FMA; elsewhere the portable loops run.
//
// Why not the portable loops: the compiler kept one running sum per dot product (a chain of dependent adds),
// reduced it through the stack, called libm's fmaxf per element and left exp scalar; and the V pass loaded
// and stored the (G, D) accumulator for every context row. Here a K row is loaded (and widened) once into
// registers for all G query heads, the V pass keeps one head's accumulator (V registers) in registers over
// all rows, and max/exp/sum run 8 lanes at a time: 2.5-3.4x faster per call (bench/cpu_kernels.py).
#pragma once

#include "simd_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#define KVGATE_DECODE_AVX2 1

namespace avx2dec {

// 8 elements of a cache row as fp32.
static inline __m256 load8(const float* r) { return _mm256_loadu_ps(r); }
static inline __m256 load8(const at::BFloat16* r) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16));
}
static inline __m256 load8(const at::Half* r) {  // F16C (every AVX2 CPU has it; -march=native defines it)
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(r[i]);
  return _mm256_loadu_ps(f);
#endif
}
static inline __m256 load8(const int8_t* r) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r))));
}

// The row's scale: 1 for fp32/bf16/fp16; an int8 row carries its fp32 scale after its D codes.
static inline float row_scale(const float*, int64_t) { return 1.f; }
static inline float row_scale(const at::BFloat16*, int64_t) { return 1.f; }
static inline float row_scale(const at::Half*, int64_t) { return 1.f; }
static inline float row_scale(const int8_t* r, int64_t d) {
  float s;
  std::memcpy(&s, r + d, sizeof s);
  return s;
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores (L) -> exp(scores - max) in place; returns max and sum.
static inline void softmax_row(float* s, int64_t L, float* m_out, float* l_out) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax8(mv);
  for (; t < L; ++t) mx = s[t] > mx ? s[t] : mx;
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= L; t += 8) {
    const __m256 e = kvgate_simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  for (; t < L; ++t) { s[t] = exp_neg(s[t] - mx); sum += s[t]; }
  *m_out = mx;
  *l_out = sum;
}

// Context rows are scattered (blocks of the paged cache, KV heads interleaved: a head's rows 768 bytes apart
// at D = 64, Hkv = 3), so the hardware prefetchers miss most of them and the score pass waited on each K row
// (a third of a 32-sequence offline run on a Xeon with AMX, where the GEMMs had become fast). Rows this far
// ahead are prefetched.
static constexpr int64_t kPrefetchRows = 16;

template <typename KV>
static inline void prefetch_row(const KV* r, int64_t W) {
  const char* p = reinterpret_cast<const char*>(r);
  for (int64_t o = 0; o < W * static_cast<int64_t>(sizeof(KV)); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// The prefetch cursor of one chunk [t0, t1) of KV head h: each position's K and V rows (pfw elements from head h's
// row on), the first kPrefetchRows at once, then one position kPrefetchRows ahead of the pass on each ahead().
// pfw 0: nothing (this head's rows came with the first head's). Prefetches only: no numerics.
template <typename KV>
struct Prefetcher {
  const KV *kp, *vp;
  const int32_t* bt;
  int64_t BS, Hkv, h, W, pfw, t1, pt, blk, off;

  Prefetcher(const KV* k, const KV* v, const int32_t* table, int64_t t0, int64_t end, int64_t bs, int64_t hkv,
             int64_t head, int64_t w, int64_t width)
      : kp(k), vp(v), bt(table), BS(bs), Hkv(hkv), h(head), W(w), pfw(width), t1(end), pt(width == 0 ? end : t0),
        blk(t0 / bs), off(t0 % bs) {
    while (pt < t1 && pt < t0 + kPrefetchRows) next();  // the first rows all at once, not a miss at a time
  }

  void ahead() {
    if (pt < t1) next();
  }

  void next() {
    const int64_t at = ((static_cast<int64_t>(bt[blk]) * BS + off) * Hkv + h) * W;
    prefetch_row(kp + at, pfw);
    prefetch_row(vp + at, pfw);
    if (++off == BS) { off = 0; ++blk; }
    ++pt;
  }
};

// One context chunk [t0, t1) for a group of nr query rows of one sequence (rows of a prefill chunk, or a single
// decode row): same contract as attend_group in paged_decode.cpp. Row r sees positions [t0, min(t1, lens[r]));
// lens are nondecreasing and lens[0] > t0. Each K/V row is loaded (and widened) once for every row and query
// head that sees it; the arithmetic of each (row, head) is exactly that of the row computed alone. V = D / 8.
// pfw: elements of each position's K and V to prefetch from the position's first KV head on (the caller runs a
// chunk's KV heads back to back: the first prefetches every head's rows, Hkv * W contiguous elements, the others
// pass 0 and find theirs in cache).
// vrows: (CH, D) + (CH) scratch: the chunk's V rows widened to fp32 once, and their scales. The V pass reads every
// row G * nr times (each query head of each row); widening it each time (vcvtph2ps) was most of that pass.
template <typename KV, int V>
static void attend_group(const float* q, int64_t qs, const int32_t* lens, int64_t nr, const KV* kp, const KV* vp,
                         const int32_t* bt, int64_t t0, int64_t t1, int64_t BS, int64_t Hkv, int64_t h, int64_t W,
                         int64_t G, int64_t CH, float sc, float* scores, float* slots, int64_t pfw, float* vrows) {
  constexpr int64_t D = 8 * V;
  const int64_t S = G * (D + 2);  // a row's slot: acc (G, D), m (G), l (G)
  float* vscale = vrows + CH * D;  // (CH): each V row's scale (1 but for int8 rows)
  int64_t blk = t0 / BS, off = t0 % BS, rf = 0;
  Prefetcher<KV> pf(kp, vp, bt, t0, t1, BS, Hkv, h, W, pfw);  // K rows for this pass, V rows for the next
  for (int64_t t = t0; t < t1; ++t) {  // scores (nr, G, CH): each K row widened once, into registers
    pf.ahead();
    while (lens[rf] <= t) ++rf;  // rows [rf, nr) see position t
    const int64_t at = ((static_cast<int64_t>(bt[blk]) * BS + off) * Hkv + h) * W;
    const KV* kr = kp + at;
    if (++off == BS) { off = 0; ++blk; }
    const KV* vr = vp + at;  // widened here, where its address is at hand, for the V pass below
    float* vw = vrows + (t - t0) * D;
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(vw + 8 * v, load8(vr + 8 * v));
    vscale[t - t0] = row_scale(vr, D);
    __m256 k[V];
    for (int v = 0; v < V; ++v) k[v] = load8(kr + 8 * v);
    const float s = row_scale(kr, D) * sc;
    for (int64_t r = rf; r < nr; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + r * qs + g * D;
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]), a1 = _mm256_setzero_ps();
        for (int v = 1; v < V; ++v) {  // two chains of dependent FMAs instead of one
          if (v & 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), k[v], a1);
          else a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), k[v], a0);
        }
        scores[(r * G + g) * CH + (t - t0)] = hsum8(_mm256_add_ps(a0, a1)) * s;
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t n = std::min<int64_t>(t1, lens[r]) - t0;
    float* slot = slots + r * S;
    for (int64_t g = 0; g < G; ++g) softmax_row(scores + (r * G + g) * CH, n, slot + G * D + g, slot + G * D + G + g);
  }
  for (int64_t r = 0; r < nr; ++r) {  // weighted V sum: one head's accumulator stays in registers
    const int64_t n = std::min<int64_t>(t1, lens[r]) - t0;
    for (int64_t g = 0; g < G; ++g) {
      __m256 a[V];
      for (int v = 0; v < V; ++v) a[v] = _mm256_setzero_ps();
      const float* pg = scores + (r * G + g) * CH;
      for (int64_t t = 0; t < n; ++t) {  // the same products in the same order as from the cache row itself
        const __m256 p = _mm256_set1_ps(pg[t] * vscale[t]);
        const float* vw = vrows + t * D;
        for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vw + 8 * v), a[v]);
      }
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(slots + r * S + g * D + 8 * v, a[v]);
    }
  }
}

}  // namespace avx2dec
#endif
