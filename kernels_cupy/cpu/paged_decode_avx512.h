// AVX-512 body of one attention work item (paged_decode.cpp's attend_group), for head sizes D = 16 Z, Z <= 8,
// giving the AVX2 body's bits exactly (paged_decode_avx2.h; tests/test_cpu_kernel.py compares the two):
// - a score is the AVX2 body's two FMA chains (even and odd 8-lane slices of the row) summed and reduced by
//   hsum8's tree. A zmm holding slices 2j and 2j+1 runs both chains at once (lanes 0-7 the even one, 8-15 the
//   odd one; the odd chain's first FMA onto zero is the rounded product, as the AVX2 body's), and its two halves
//   added are a0 + a1. Eight positions' sums are then reduced together (reduce8: the same pairs, added in the same
//   tree, lane-parallel) instead of one horizontal sum each;
// - the weighted V sum keeps up to kAccRegs / Z query heads' accumulators in registers, so each V row is loaded
//   and widened once for them all; every lane still adds the positions in order, as the AVX2 body does.
// Why: with the GEMMs on AMX, the 8-lane body spent as long on arithmetic (the horizontal sums, one widening of
// each V row per query head) as it waited on memory (bench/cpu_kernels.py).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(KVGATE_DECODE_AVX2)
#define KVGATE_DECODE_AVX512 1

namespace avx512dec {

using avx2dec::row_scale;

// 16 elements of a cache row as fp32.
static inline __m512 load16(const float* r) { return _mm512_loadu_ps(r); }
static inline __m512 load16(const at::BFloat16* r) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
}
static inline __m512 load16(const at::Half* r) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
}
static inline __m512 load16(const int8_t* r) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r))));
}

// Lanes 0-7 plus lanes 8-15: the AVX2 body's a0 + a1.
static inline __m256 halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// x[0..7] (8 vectors of 8 lanes) -> lane j = hsum8(x[j]), by hsum8's own tree: (i, i + 4) first, then (i, i + 2),
// then (0, 1); each pair added once, so every lane's bits are hsum8's.
static inline __m256 reduce8(const float* x) {
  __m256 b[4];
  for (int j = 0; j < 4; ++j) {  // b[j] = [x[j] | x[j + 4]], each half (i, i + 4) summed
    const __m256 u = _mm256_loadu_ps(x + 8 * j), w = _mm256_loadu_ps(x + 8 * (j + 4));
    b[j] = _mm256_add_ps(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
  }
  // e0 = [x0: t0 t1, x1: t0 t1 | x4: .., x5: ..], t0 = s0 + s2, t1 = s1 + s3
  const __m256 e0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 e1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // [x0 x1 x2 x3 | x4 x5 x6 x7], each t0 + t1
  return _mm256_add_ps(_mm256_shuffle_ps(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The dot product of a query head (qg, D = 16 Z) with a widened K row, as the AVX2 body's chains: (D / 8) lanes.
template <int Z>
static inline __m256 dot_halves(const float* qg, const __m512* k) {
  __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
  for (int z = 1; z < Z; ++z) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * z), k[z], a);
  return halves(a);
}

// Query heads [g0, g0 + GB) of row r: acc = sum_t p_t v_t over n positions, each V row widened once for them all.
template <typename KV, int Z, int GB>
static inline void v_heads(const KV* vp, const int32_t* bt, int64_t t0, int64_t n, int64_t BS, int64_t Hkv,
                           int64_t h, int64_t W, const float* pr, int64_t CH, float* out) {
  constexpr int64_t D = 16 * Z;
  __m512 a[GB][Z];
  for (int g = 0; g < GB; ++g)
    for (int z = 0; z < Z; ++z) a[g][z] = _mm512_setzero_ps();
  int64_t blk = t0 / BS, off = t0 % BS;
  for (int64_t t = 0; t < n; ++t) {
    const KV* vr = vp + ((static_cast<int64_t>(bt[blk]) * BS + off) * Hkv + h) * W;
    if (++off == BS) { off = 0; ++blk; }
    const float rs = row_scale(vr, D);
    __m512 v[Z];
    for (int z = 0; z < Z; ++z) v[z] = load16(vr + 16 * z);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(pr[g * CH + t] * rs);
      for (int z = 0; z < Z; ++z) a[g][z] = _mm512_fmadd_ps(p, v[z], a[g][z]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(out + g * D + 16 * z, a[g][z]);
}

// Query heads a V pass takes at once: their accumulators in registers (24 of the 32; the rest hold the V row and
// the weight), at most 8 (more heads per KV head are rare, and each count is an instantiation).
template <int Z>
static constexpr int kHeadsPerPass = 24 / Z < 8 ? 24 / Z : 8;

// The next min(B, left) query heads' V pass (B or fewer, as many as are left); returns how many it took.
template <typename KV, int Z, int B>
static inline int64_t v_some(const KV* vp, const int32_t* bt, int64_t t0, int64_t n, int64_t BS, int64_t Hkv,
                             int64_t h, int64_t W, const float* pr, int64_t CH, float* out, int64_t left) {
  if constexpr (B > 1) {
    if (left < B) return v_some<KV, Z, B - 1>(vp, bt, t0, n, BS, Hkv, h, W, pr, CH, out, left);
  }
  v_heads<KV, Z, B>(vp, bt, t0, n, BS, Hkv, h, W, pr, CH, out);
  return B;
}

// Same contract as avx2dec::attend_group (pfw included); red: scratch of nr * G * 64 floats.
template <typename KV, int Z>
static void attend_group(const float* q, int64_t qs, const int32_t* lens, int64_t nr, const KV* kp, const KV* vp,
                         const int32_t* bt, int64_t t0, int64_t t1, int64_t BS, int64_t Hkv, int64_t h, int64_t W,
                         int64_t G, int64_t CH, float sc, float* scores, float* slots, int64_t pfw, float* red) {
  constexpr int64_t D = 16 * Z;
  const int64_t S = G * (D + 2);
  int64_t blk = t0 / BS, off = t0 % BS, rf = 0;
  avx2dec::Prefetcher<KV> pf(kp, vp, bt, t0, t1, BS, Hkv, h, W, pfw);
  for (int64_t tb = t0; tb < t1; tb += 8) {  // scores (nr, G, CH), eight positions at a time
    const int64_t nt = std::min<int64_t>(8, t1 - tb);
    while (lens[rf] <= tb) ++rf;  // rows [rf, nr) see position tb; a row that stops inside the eight gets
                                  // scores past its end, which its softmax never reads
    alignas(32) float s8[8];
    for (int64_t j = 0; j < nt; ++j) {
      pf.ahead();
      const KV* kr = kp + ((static_cast<int64_t>(bt[blk]) * BS + off) * Hkv + h) * W;
      if (++off == BS) { off = 0; ++blk; }
      __m512 k[Z];
      for (int z = 0; z < Z; ++z) k[z] = load16(kr + 16 * z);
      s8[j] = row_scale(kr, D) * sc;
      for (int64_t r = rf; r < nr; ++r)
        for (int64_t g = 0; g < G; ++g)
          _mm256_storeu_ps(red + ((r * G + g) * 8 + j) * 8, dot_halves<Z>(q + r * qs + g * D, k));
    }
    for (int64_t r = rf; r < nr; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        float* dst = scores + (r * G + g) * CH + (tb - t0);
        const float* x = red + (r * G + g) * 64;
        if (nt == 8) {
          _mm256_storeu_ps(dst, _mm256_mul_ps(reduce8(x), _mm256_load_ps(s8)));
        } else {
          for (int64_t j = 0; j < nt; ++j) dst[j] = avx2dec::hsum8(_mm256_loadu_ps(x + 8 * j)) * s8[j];
        }
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t n = std::min<int64_t>(t1, lens[r]) - t0;
    float* slot = slots + r * S;
    for (int64_t g = 0; g < G; ++g)
      avx2dec::softmax_row(scores + (r * G + g) * CH, n, slot + G * D + g, slot + G * D + G + g);
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t n = std::min<int64_t>(t1, lens[r]) - t0;
    for (int64_t g = 0; g < G;)
      g += v_some<KV, Z, kHeadsPerPass<Z>>(vp, bt, t0, n, BS, Hkv, h, W, scores + (r * G + g) * CH, CH,
                                            slots + r * S + g * D, G - g);
  }
}

}  // namespace avx512dec
#endif
