// The span group of the A16 lane layout: a K's last 1-4 blocks (qgemm_a16_lanes.h describes the layouts; to_span
// writes them). Included by qgemm_a16_lanes.h after lane_steps and lane_group_end, inside the instruction-set
// namespaces of qgemm_core.h; no STL. Both versions end each tail block b = 8 * ngl + i in fp32 lane i with
// lane_group_end's operations in its order, and sum a tile's lanes by hsum's tree, so the outputs are the same
// bits (tests/test_qgemm_a16.py). The VNNI version (lane_finish) also ends the tile: its outputs, stored.
#if QG_VNNI
// Two span groups' partial sums (rows r and r2 of a column) -> [row r's tail block sums in lanes 0 .. SPAN-1 | row
// r2's likewise]; lanes 2-3 of a span of 2 hold any value (their d is 0). Integer adds: exact in any order.
template <int SPAN>
static inline __m256i pair_sums(__m256i u, __m256i w) {
  const __m256i h = _mm256_hadd_epi32(u, w);  // [u 01, u 23, w 01, w 23 | u 45, u 67, w 45, w 67] (lane pairs)
  if constexpr (SPAN == 4) return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const __m256i h2 = _mm256_hadd_epi32(h, h);  // [u 0-3, w 0-3, u 0-3, w 0-3 | u 4-7, w 4-7, ..]
  if constexpr (SPAN == 2) return _mm256_permutevar8x32_epi32(h2, _mm256_setr_epi32(0, 4, 0, 4, 1, 5, 1, 5));
  const __m256i all = _mm256_add_epi32(h2, _mm256_permute2x128_si256(h2, h2, 0x01));  // [u, w, ..]
  return _mm256_permutevar8x32_epi32(all, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Rows r and r2 of column j (r2 == r for a lone row): their fp32 lanes as [row r | row r2], the tail blocks' ends
// applied to lanes 0 .. SPAN-1 (lane_group_end's operations, lane for lane: the tail's lanes are at most 4, all in
// the low half; d = m = 0 past nb, so lanes 2-3 of a span of 2 add a +0 as before), then each half's lanes i and
// i + 4 summed: the first level of hsum's tree. t: each (row, column)'s span group partial sums (pair_sums adds them).
template <int R, int C, bool Q4, int SPAN>
static inline __m256 half_sums(const QArgs16& a, const Col16& c, int64_t g, int64_t m0, int r, int r2, int j,
                               const __m256 acc[R][C], const __m256i t[R][C]) {
  __m256 p = _mm256_permute2f128_ps(acc[r][j], acc[r2][j], 0x20);
  const __m256 q = _mm256_permute2f128_ps(acc[r][j], acc[r2][j], 0x31);
  if constexpr (SPAN > 0) {
    const auto rows = [&](const float* base) {  // [base row r, blocks 8g .. 8g+3 | the same of row r2]
      return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(base + (m0 + r) * a.ss + 8 * g)),
                                  _mm_loadu_ps(base + (m0 + r2) * a.ss + 8 * g), 1);
    };
    const __m256i is = pair_sums<SPAN>(t[r][j], t[r2][j]);
    const __m256 d = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(c.d + 8 * g));
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, rows(a.sa)), p);
    if constexpr (Q4)
      p = _mm256_fmadd_ps(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(c.m + 8 * g)), rows(a.xsum), p);
  }
  return _mm256_add_ps(p, q);
}

// The tile's end: the span group's 2 * SPAN steps (SPAN = 0: none), each tail block's lanes summed, and the
// outputs of all R x C lanes, by hsum's tree on several outputs at once (store16's bits): half_sums gives
// (i, i + 4), a shuffle pair (i, i + 2), a hadd the last pair. On Zen 4 the span group's full-width end and twelve
// separate horizontal sums took a fifth of a K = 576 tile's time for a ninth of its multiply-adds.
template <int R, int C, bool Q4, int SPAN>
static inline void lane_finish(const QArgs16& a, const Col16* c, const Lanes16& L, const int16_t* const* xr,
                               int64_t m0, int64_t n0, const __m256 acc[R][C]) {
  static_assert(R == 1 || R == 2 || R == 4, "rows pair up");
  __m256i t[R][C];
  if constexpr (SPAN > 0) {
    const int16_t* xg[R];
    const int16_t* wg[C];
    for (int r = 0; r < R; ++r) xg[r] = xr[r] + L.ngl * kGroup16;
    for (int j = 0; j < C; ++j) wg[j] = c[j].w + L.ngl * kGroup16;
    lane_steps<R, C, 2 * SPAN>(xg, wg, t);
  }
  constexpr int r1 = R > 1 ? 1 : 0;
  // z[j], column j: [r0 e0, r0 e1, r2 e0, r2 e1 | r1 e0, r1 e1, r3 e0, r3 e1], e0 = (0+4)+(2+6), e1 = (1+5)+(3+7)
  __m256 z[C];
  for (int j = 0; j < C; ++j) {
    const __m256 u01 = half_sums<R, C, Q4, SPAN>(a, c[j], L.ngl, m0, 0, r1, j, acc, t);
    const __m256 u23 = R > 2 ? half_sums<R, C, Q4, SPAN>(a, c[j], L.ngl, m0, R - 2, R - 1, j, acc, t) : u01;
    z[j] = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  static constexpr int lane[4] = {0, 4, 1, 5};  // v's lane of row r's output of column j; of column j2: 2 lanes on
  for (int j = 0; j < C; j += 2) {
    const int j2 = j + 1 < C ? j + 1 : j;
    alignas(32) float v[8];  // [r0 j, r2 j, r0 j2, r2 j2 | r1 j, r3 j, r1 j2, r3 j2], each e0 + e1
    _mm256_store_ps(v, _mm256_hadd_ps(z[j], z[j2]));
    for (int r = 0; r < R; ++r) {
      float* o = a.out + (m0 + r) * a.N + n0;
      o[j] = a.bias ? v[lane[r]] + a.bias[n0 + j] : v[lane[r]];
      if (j2 > j) o[j2] = a.bias ? v[lane[r] + 2] + a.bias[n0 + j2] : v[lane[r] + 2];
    }
  }
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
