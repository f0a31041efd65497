// The span group of the A16 lane layout: a K's last 1-4 blocks (qgemm_a16_lanes.h describes the layouts; to_span
// writes them). Included by qgemm_a16_lanes.h after lane_steps and lane_group_end, inside the instruction-set
// namespaces of qgemm_core.h; no STL. Both versions end each tail block b = 8 * ngl + i in fp32 lane i with
// lane_group_end's operations in its order, so the outputs are the same bits (tests/test_qgemm_a16.py).
#if QG_VNNI
// A span group's partial sums -> the tail blocks' sums in lanes 0 .. span-1 (lanes past them: any value, their
// d is 0). Integer adds: exact in any order.
template <int SPAN>
static inline __m256i span_sums(__m256i v) {
  v = _mm256_add_epi32(v, _mm256_srli_epi64(v, 32));                                 // pairs: lanes 0, 2, 4, 6
  if constexpr (SPAN <= 2) v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0x4E));   // quads: lanes 0, 4
  if constexpr (SPAN == 1) v = _mm256_add_epi32(v, _mm256_permute2x128_si256(v, v, 0x01));  // all: lane 0
  const __m256i idx = SPAN == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0) : _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
  return _mm256_permutevar8x32_epi32(v, idx);
}

// 2 * SPAN steps, each block's lanes summed, then the usual end.
template <int R, int C, bool Q4, int SPAN>
static inline void span_group(const QArgs16& a, const Col16* c, const Lanes16& L, const int16_t* const* xr,
                              int64_t m0, __m256 acc[R][C]) {
  const int16_t* xg[R];
  const int16_t* wg[C];
  for (int r = 0; r < R; ++r) xg[r] = xr[r] + L.ngl * kGroup16;
  for (int j = 0; j < C; ++j) wg[j] = c[j].w + L.ngl * kGroup16;
  __m256i s[R][C];
  lane_steps<R, C, 2 * SPAN>(xg, wg, s);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) s[r][j] = span_sums<SPAN>(s[r][j]);
  lane_group_end<R, C, Q4>(a, c, m0, L.ngl, s, acc);
}
#else
// 256-bit: a step is 128 bits of a row's codes, broadcast to both halves, against two columns' 128 bits (one a
// half; a lone column leaves the upper half zero), so a vpmaddwd serves two columns and the H lanes of a block
// are summed once per row and column pair instead of 8 lanes per column (on Zen 1 the span group's reductions
// and 256-bit ends cost twice its multiplies). The tail blocks touch fp32 lanes 0..3 only, so their end runs
// on 128 bits: lane_group_end's operations on those lanes, lanes 4..7 left as they are (where lane_group_end
// adds a signed zero, which leaves them as they are).

// A half's H-lane partial sums -> the tail blocks' sums in its lanes 0 .. span-1 (integer adds: exact).
template <int SPAN>
static inline __m256i tail_sums(__m256i v) {
  if constexpr (SPAN == 4) return v;                                    // H = 1: lane i is block i
  v = _mm256_add_epi32(v, _mm256_srli_epi64(v, 32));                   // pairs: lanes 0, 2 of each half
  if constexpr (SPAN == 2) return _mm256_shuffle_epi32(v, 0x08);       // lanes 0, 2 -> 0, 1
  return _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0x4E));          // H = 4: all four in lane 0
}

template <int R, int C, bool Q4, int SPAN>
static inline void span_group(const QArgs16& a, const Col16* c, const Lanes16& L, const int16_t* const* xr,
                              int64_t m0, __m256 acc[R][C]) {
  constexpr int P = (C + 1) / 2;  // column pairs
  const int64_t off = L.ngl * kGroup16;
  __m256i s[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) s[r][p] = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int st = 0; st < 4 * SPAN; ++st) {
    __m256i w[P];
    for (int p = 0; p < P; ++p) {
      const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(c[2 * p].w + off + 8 * st));
      w[p] = 2 * p + 1 < C
                 ? _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                           _mm_load_si128(reinterpret_cast<const __m128i*>(c[2 * p + 1].w + off + 8 * st)), 1)
                 : _mm256_zextsi128_si256(lo);
      keep_chain(w[p]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr[r] + off + 8 * st)));
      for (int p = 0; p < P; ++p) {
        s[r][p] = _mm256_add_epi32(s[r][p], _mm256_madd_epi16(w[p], x));
        keep_chain(s[r][p]);
      }
    }
  }
  const int64_t g = L.ngl;
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const __m256i v = tail_sums<SPAN>(s[r][p]);
      for (int h = 0; h < 2 && 2 * p + h < C; ++h) {
        const int j = 2 * p + h;
        const __m128i sj = h ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
        const float* sa = a.sa + (m0 + r) * a.ss + 8 * g;
        __m128 lo = _mm256_castps256_ps128(acc[r][j]);
        lo = _mm_fmadd_ps(_mm_cvtepi32_ps(sj), _mm_mul_ps(_mm_load_ps(c[j].d + 8 * g), _mm_loadu_ps(sa)), lo);
        if constexpr (Q4)
          lo = _mm_fmadd_ps(_mm_load_ps(c[j].m + 8 * g), _mm_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * g), lo);
        acc[r][j] = _mm256_insertf128_ps(acc[r][j], lo, 0);
      }
    }
}
#endif
