// Block-quantized GEMM with int16 activations ("A16", qlinear(..., act_bits=16)): out (M, N) = x (M, K) @ W^T
// for W in the blocks of qgemm_core.h. Included once per instruction set inside qgemm_core.h's namespaces and
// `#pragma GCC target` regions, after qgemm_impl.h (like it: no STL here). QG_VNNI selects vpdpwssd.
// The scalar reference is qgemm_core.h's scalar::quantize_rows16 / scalar::gemm16; every path here is
// bit-identical to it (tests/test_qgemm_a16.py).
//
// Why: int8 activations (the A8 path) flip ~1 argmax in 23 against fp32 of the same weights; 12-bit codes (held
// in int16) make the activation rounding ~16x smaller while the block dots stay exact integer arithmetic.
//
// Numerics (exact for finite x; every path, every M, row tiling, thread split of N):
//  1. Activations, per row m and block b of 32 (x_i, i = 0..31):
//       amax = max_i |x_i|;  sa = amax / C;  id = sa != 0 ? 1.0f / sa : 0.0f   (C = kCodeMax = 2047: 12 bits);
//       t_i = x_i * id;  t_i = t_i > -C ? t_i : -C;  t_i = t_i < C ? t_i : C  (maxps/minps semantics, so the
//       NaN of 0 * inf, where sa is so small that 1 / sa overflows, is -C on every path);
//       code_i = round-to-nearest-even(t_i) (int16, |code_i| <= 2047);
//       xsum_{m,b} = sa * (float)(sum_i code_i)   (the integer sum, |.| < 2^16, converts exactly).
//  2. isum_{m,n,b} = sum_i wcode_i * code_i, exact in int32 (Q4 wcode 0..15, Q8 -127..127; |isum| < 2^23).
//  3. Eight fp32 lanes acc_j = +0. Blocks in groups of 8: lane j of group g is block b = 8g + j; for b >= nb
//     the block is padding with isum 0, d 0, m 0, sa 0, xsum 0 and is still applied. Per group, per lane:
//       acc_j = fma((float)isum_b, d_b * sa_b, acc_j)     (d_b * sa_b one rounded fp32 product; (float) RNE)
//       Q4 only: acc_j = fma(m_b, xsum_b, acc_j)
//     then s = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)); out = s + bias[n] if bias.
//
// Two layouts of the int16 activations on the SIMD paths (quantize_rows16); any gives the same exact isum, so the
// results do not depend on which runs. M >= kLaneRows: the lane layout (qgemm_a16_lanes.h). M < kLaneRows,
// the pair layout: per row, blocks in pairs (2p, 2p+1),
// each pair 4 vectors of 16 int16, vector v's low 8 words from block 2p and high 8 words from block 2p+1 (an odd
// last block's partner is zeros). Word w of vector v holds element e(v, w) of its block, matching how a pair of
// weight blocks widens to int16 with fewest operations (widen_q4 / widen_q8):
//   Q4: e = 2w, 2w+16, 2w+1, 2w+17 for v = 0..3 (byte 2w's two nibbles, then byte 2w+1's, as int16 words)
//   Q8: e = w, 8+w, 16+w, 24+w                  (8 codes of each block side by side, sign-extended)
// So each 128-bit half of a vpmaddwd result is one block's partial sums, and four pairs reduce to one vector
// of eight block sums with 9 in-lane operations and one permute (reduce_pairs), not a horizontal sum a block.
// Activation scales sa and xsum are (M, ss) with ss = nb rounded up to 8, zero past nb (the padding blocks).

// int16 codes per pair of blocks in the activation layout (4 vectors of 16).
static constexpr int64_t kPair16 = 64;

// 32 floats -> 32 int16 codes in natural order, their scale and xsum (numerics 1).
static inline void quantize_block16(const float* x, int16_t* c, float* scale, float* xsum) {
  __m256 v[4];
  const float s = block_amax(x, v) / kCodeMax;
  const __m256 id = _mm256_set1_ps(s != 0.0f ? 1.0f / s : 0.0f);
  const __m256 lo = _mm256_set1_ps(-kCodeMax), hi = _mm256_set1_ps(kCodeMax);
  __m256i q[4];
  for (int j = 0; j < 4; ++j)  // max then min: a NaN product lands on -kCodeMax, as the scalar path's ternaries
    q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], id), lo), hi));
  const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i is4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
  // packs works per 128-bit lane: [q0 0..3, q1 0..3 | q0 4..7, q1 4..7]; the permute restores element order.
  const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), p01);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 16), p23);
  *scale = s;
  *xsum = s * static_cast<float>(_mm_cvtsi128_si32(is4));
}

// One block's natural-order codes c (32) into side L (0: low words, 1: high words) of its pair's 4 vectors.
static inline void place_block16(const int16_t* c, int L, int bits, int16_t* pair) {
  if (bits == 8) {  // e = 8v + w: four runs of 8
    for (int v = 0; v < 4; ++v) std::memcpy(pair + v * 16 + L * 8, c + 8 * v, 16);
    return;
  }
  // Q4: e = 2w (+16) in vectors 0 (1), 2w+1 (+16) in vectors 2 (3): even and odd words of each half apart.
  const __m128i even_odd = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int h = 0; h < 2; ++h) {  // h = 0: elements 0..15 -> vectors 0, 2; h = 1: 16..31 -> vectors 1, 3
    const __m128i a = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h)), even_odd);
    const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h + 8)), even_odd);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + h * 16 + L * 8), _mm_unpacklo_epi64(a, b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + (2 + h) * 16 + L * 8), _mm_unpackhi_epi64(a, b));
  }
}

// A pair of Q4 blocks (32 bytes, 16 each) -> the 4 int16 vectors of the pair layout.
static inline void widen_q4(const uint8_t* p, __m256i w[4]) {
  const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nib = _mm256_set1_epi8(0x0F), low = _mm256_set1_epi16(0x00FF);
  const __m256i lo = _mm256_and_si256(y, nib);                           // word: lo(2w) | lo(2w+1) << 8
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), nib);    // word: hi(2w) | hi(2w+1) << 8
  w[0] = _mm256_and_si256(lo, low);
  w[1] = _mm256_and_si256(hi, low);
  w[2] = _mm256_srli_epi16(lo, 8);
  w[3] = _mm256_srli_epi16(hi, 8);
}

// A pair of Q8 blocks (64 bytes, 32 each) -> the 4 int16 vectors of the pair layout.
static inline void widen_q8(const uint8_t* p, __m256i w[4]) {
  const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
  const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48));
  w[0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(a0, b0));
  w[1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi64(a0, b0));
  w[2] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(a1, b1));
  w[3] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi64(a1, b1));
}

// The 4 x 16 products of a pair: 8 int32 partial sums, low half block 2p, high half block 2p+1 (exact).
static inline __m256i dot_pair(const __m256i w[4], const int16_t* x) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
#if QG_VNNI
  __m256i s = _mm256_madd_epi16(w[0], _mm256_loadu_si256(xv));
  s = _mm256_dpwssd_epi32(s, w[1], _mm256_loadu_si256(xv + 1));
  s = _mm256_dpwssd_epi32(s, w[2], _mm256_loadu_si256(xv + 2));
  return _mm256_dpwssd_epi32(s, w[3], _mm256_loadu_si256(xv + 3));
#else
  const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(xv)),
                                       _mm256_madd_epi16(w[1], _mm256_loadu_si256(xv + 1)));
  const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(xv + 2)),
                                       _mm256_madd_epi16(w[3], _mm256_loadu_si256(xv + 3)));
  return _mm256_add_epi32(s01, s23);
#endif
}

// Four pairs' partial sums -> the 8 block sums of the group in natural order (lane j = block 8g + j).
static inline __m256i reduce_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  // [p0 0+2, p1 0+2, p0 1+3, p1 1+3 | p0 4+6, p1 4+6, p0 5+7, p1 5+7], and the same for p2, p3
  const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  // [b0, b2, b4, b6 | b1, b3, b5, b7]
  const __m256i t = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
  return _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// --- Few rows (decode): each weight pair is widened in registers and used by the R rows at once. ---

// What one weight column's group of 8 blocks needs: where each of its pairs' bytes are, d and (Q4) m.
struct Group16 {
  const uint8_t* w[4];  // pair p's bytes (32 for Q4, 64 for Q8); pairs past the group's NP unused
  const uint16_t* d;    // 8 fp16
  const uint16_t* m;    // 8 fp16, or null (Q8)
};

// The per-row end of a group (numerics 3): the pairs' sums to 8 block sums, then the lanes' fused multiply-adds.
template <bool Q4>
static inline __m256 apply_group(const __m256i pp[4], __m256 d8, __m256 m8, const float* sa, const float* xs,
                                 __m256 acc) {
  const __m256i isum = reduce_pairs(pp[0], pp[1], pp[2], pp[3]);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_loadu_ps(sa)), acc);
  if constexpr (Q4) acc = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs), acc);
  return acc;
}

// R rows (activation rows xr, offset to this group; scales sar / xsr likewise) against one column's group.
template <int R, int NP, bool Q4>
static inline void group16(const Group16& gw, const int16_t* const* xr, const float* const* sar,
                           const float* const* xsr, __m256 acc[R]) {
  // One pair at a time, widened and used by every row: 4 weight vectors live, not 16 (which spilled).
  __m256i pp[R][4];
  for (int p = 0; p < 4; ++p) {
    if (p >= NP) {
      for (int r = 0; r < R; ++r) pp[r][p] = _mm256_setzero_si256();
      continue;
    }
    __m256i w[4];
    if constexpr (Q4) widen_q4(gw.w[p], w);
    else widen_q8(gw.w[p], w);
    for (int r = 0; r < R; ++r) pp[r][p] = dot_pair(w, xr[r] + p * kPair16);
  }
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gw.d)));
  __m256 m8 = _mm256_setzero_ps();
  if constexpr (Q4) m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gw.m)));
  for (int r = 0; r < R; ++r) acc[r] = apply_group<Q4>(pp[r], d8, m8, sar[r], xsr[r], acc[r]);
}

// The fixed end of an output (numerics 3).
static inline void store16(const QArgs16& a, int64_t m, int64_t n, __m256 acc) {
  float v = hsum(acc);
  if (a.bias) v += a.bias[n];
  a.out[m * a.N + n] = v;
}

// The last, partial group of column n (nb % 8 blocks, the GGUF's natural bytes) for R rows whose activations
// (xr, sar, xsr) are at that group in the pair layout: d = m = 0 past nb (zero-padded copies) makes the padding
// lanes add +0. An odd last block's pair is read from a zero-padded copy: the row's bytes end with that block.
template <int R, bool Q4>
static inline void rem_group16(const QArgs16& a, int64_t n, const int16_t* const* xr, const float* const* sar,
                               const float* const* xsr, __m256 acc[R]) {
  const int64_t nb = a.K / QK, ng = nb / 8, rem = nb % 8;
  const int64_t pb = Q4 ? QK : 2 * QK;  // bytes a pair
  const uint8_t* wn = a.wq + n * (Q4 ? a.K / 2 : a.K);
  const uint16_t* dn = a.wd + n * nb;
  const uint16_t* mn = Q4 ? a.wm + n * nb : nullptr;
  // Element by element, not memcpy: a call with a run-time size a column was ~1/8 of a 1-row K = 576 call.
  alignas(16) uint16_t dt[8], mt[8];
  for (int b = 0; b < 8; ++b) {
    dt[b] = b < rem ? dn[8 * ng + b] : uint16_t{0};
    mt[b] = Q4 && b < rem ? mn[8 * ng + b] : uint16_t{0};
  }
  const uint8_t* wg = wn + ng * 4 * pb;
  Group16 gw{{wg, wg + pb, wg + 2 * pb, wg + 3 * pb}, dt, mt};
  alignas(32) uint8_t wt[2 * QK];  // (the odd block, zeros): up to one pair
  const int np = static_cast<int>((rem + 1) / 2);
  if (rem % 2) {
    std::memset(wt, 0, sizeof wt);
    std::memcpy(wt, gw.w[np - 1], pb / 2);
    gw.w[np - 1] = wt;
  }
  switch (np) {
    case 1: group16<R, 1, Q4>(gw, xr, sar, xsr, acc); break;
    case 2: group16<R, 2, Q4>(gw, xr, sar, xsr, acc); break;
    case 3: group16<R, 3, Q4>(gw, xr, sar, xsr, acc); break;
    default: group16<R, 4, Q4>(gw, xr, sar, xsr, acc); break;
  }
}

// Rows m0 .. m0+R-1 of output column n.
template <int R, bool Q4>
static inline void micro16(const QArgs16& a, int64_t m0, int64_t n) {
  const int64_t nb = a.K / QK, ng = nb / 8, rem = nb % 8;
  const uint8_t* wn = a.wq + n * (Q4 ? a.K / 2 : a.K);
  const uint16_t* dn = a.wd + n * nb;
  const uint16_t* mn = Q4 ? a.wm + n * nb : nullptr;
  const int16_t* xr[R];
  const float* sar[R];
  const float* xsr[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = a.qa + (m0 + r) * a.qs;
    sar[r] = a.sa + (m0 + r) * a.ss;
    xsr[r] = a.xsum + (m0 + r) * a.ss;
    acc[r] = _mm256_setzero_ps();
  }
  const int64_t pb = Q4 ? QK : 2 * QK;  // bytes a pair
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = wn + g * 4 * pb;
    const Group16 gw{{wg, wg + pb, wg + 2 * pb, wg + 3 * pb}, dn + 8 * g, Q4 ? mn + 8 * g : nullptr};
    group16<R, 4, Q4>(gw, xr, sar, xsr, acc);
    for (int r = 0; r < R; ++r) xr[r] += 4 * kPair16, sar[r] += 8, xsr[r] += 8;
  }
  if (rem) rem_group16<R, Q4>(a, n, xr, sar, xsr, acc);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n, acc[r]);
}

// Output columns [n0, n1) of a call with R = M < kLaneRows rows (one loop per R: each is compiled for its R).
template <int R, bool Q4>
static void pairs_cols(const QArgs16& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) micro16<R, Q4>(a, 0, n);
}

template <bool Q4>
static void gemm16_pairs(const QArgs16& a, int64_t n0, int64_t n1) {
  switch (a.M) {
    case 3: pairs_cols<3, Q4>(a, n0, n1); break;
    case 2: pairs_cols<2, Q4>(a, n0, n1); break;
    default: pairs_cols<1, Q4>(a, n0, n1); break;
  }
}

// rows x K floats -> q (rows, qs) int16 in the pair layout for `bits`, sa and xsum (rows, ss), zero-padded.
static void quantize_rows16_pairs(const float* x, int64_t rows, int64_t K, int bits, int16_t* q, int64_t qs,
                                  float* sa, float* xsum, int64_t ss) {
  const int64_t nb = K / QK;
  alignas(32) int16_t c[QK];
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* qr = q + r * qs;
    for (int64_t b = 0; b < nb; ++b) {
      quantize_block16(x + r * K + b * QK, c, sa + r * ss + b, xsum + r * ss + b);
      place_block16(c, static_cast<int>(b % 2), bits, qr + (b / 2) * kPair16);
    }
    if (nb % 2) {  // the odd last block's partner: zeros, so any weight bytes against it add nothing
      std::memset(c, 0, sizeof c);
      place_block16(c, 1, bits, qr + (nb / 2) * kPair16);
    }
    for (int64_t b = nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}
