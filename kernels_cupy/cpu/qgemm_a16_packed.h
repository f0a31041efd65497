// The A16 kernel for few rows (M < kPackedRows: decode batches) against 4-bit weights packed in lane order
// (QArgs16::wlanes, qgemm_core.h's pack_lanes_q4), 256-bit only. Included at the end of qgemm_a16_lanes.h inside
// the AVX2 namespace of qgemm_core.h; no STL. Numerics: qgemm_a16.h (the same exact block sums, the same
// group ends, so the same bits as every other path).
//
// Why: the pair kernel (qgemm_a16.h) widens each weight pair in its natural order and reduces four pairs'
// partial sums to eight block sums with shuffles: on Zen 1 a one-row call ran 7.0 GMAC/s a core at K = 576, and
// the lane kernel first widens every column of a call into an L2 panel. Packed, a full group's 128 bytes are
// already transposed: 32-bit lane j of vector q holds bytes 4q .. 4q + 3 of block j. Each vector then widens to
// four lane-layout steps with shifts and masks (widen_lanes_q4's, in registers), used by a tile of up to 3 rows,
// every vpmaddwd sums straight into the group's eight block sums, and nothing is reduced. Only full groups are
// packed; the last nb % 8 blocks keep the GGUF's bytes and run as the pair kernel's partial group (packed_tail).
//
// Activations (quantize_rows16_packed): per row, the nb / 8 full groups in the lane layout (qgemm_a16_lanes.h),
// then the tail's blocks in the pair layout (qgemm_a16.h), at ngf * kGroup16; within a16_code_stride(K).

// rows x K floats -> q (rows, qs) int16 in the layout above, sa and xsum (rows, ss), zero-padded.
static void quantize_rows16_packed(const float* x, int64_t rows, int64_t K, int16_t* q, int64_t qs, float* sa,
                                   float* xsum, int64_t ss) {
  const int64_t nb = K / QK, full = nb / 8 * 8;
  alignas(32) int16_t c[QK];
  int elem[16][2];  // a full group's e(s, h)
  for (int st = 0; st < 16; ++st) elem[st][0] = lane_elem(4, st, 0), elem[st][1] = lane_elem(4, st, 1);
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* qr = q + r * qs;
    int16_t* tail = qr + (nb / 8) * kGroup16;
    for (int64_t b = 0; b < nb; ++b) {
      quantize_block16(x + r * K + b * QK, c, sa + r * ss + b, xsum + r * ss + b);
      if (b < full) {
        int16_t* g = qr + (b / 8) * kGroup16 + 2 * (b % 8);
        for (int st = 0; st < 16; ++st) g[st * 16] = c[elem[st][0]], g[st * 16 + 1] = c[elem[st][1]];
      } else {
        place_block16(c, static_cast<int>((b - full) % 2), 4, tail + ((b - full) / 2) * kPair16);
      }
    }
    if ((nb - full) % 2) {  // the odd last block's partner: zeros, as in quantize_rows16_pairs
      std::memset(c, 0, sizeof c);
      place_block16(c, 1, 4, tail + ((nb - full) / 2) * kPair16);
    }
    for (int64_t b = nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}

// The last rem = nb % 8 blocks of column n (the GGUF's bytes, in NP pairs) for R rows, as the pair kernel's partial
// group (qgemm_a16.h, numerics 3: lanes past rem add +0), without its per-column copies of d and m: with them
// the 2-block tail of K = 576 took as long as the 16 packed blocks before it (a one-row call on Zen 1), with the
// masked loads below about 60% as long.
template <int R, int NP>
static inline void packed_tail(const QArgs16& a, int64_t m0, int64_t n, __m256 acc[R]) {
  const int64_t nb = a.K / QK, ngf = nb / 8, rem = nb % 8;
  const uint8_t* wg = a.wq + n * (a.K / 2) + ngf * 4 * QK;
  // An odd last block's pair partner is the next row's first block: its activations are zeros, so it adds 0 to a
  // padding lane. Only past the end of wq (the last column) is it read from a zero-padded copy.
  alignas(32) uint8_t wt[QK];
  const uint8_t* last = wg + (NP - 1) * QK;
  if ((rem & 1) && n == a.N - 1) {
    std::memcpy(wt, last, QK / 2);
    std::memset(wt + QK / 2, 0, QK / 2);
    last = wt;
  }
  __m256i pp[R][4];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    if (p >= NP) {
      for (int r = 0; r < R; ++r) pp[r][p] = _mm256_setzero_si256();
      continue;
    }
    __m256i w[4];
    widen_q4(p == NP - 1 ? last : wg + p * QK, w);
    for (int r = 0; r < R; ++r) pp[r][p] = dot_pair(w, a.qa + (m0 + r) * a.qs + ngf * kGroup16 + p * kPair16);
  }
  // d and m of the rem blocks, zeros past them: masked loads never read past the column's scales.
  const __m128i dwords = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>((rem + 1) / 2)), _mm_setr_epi32(0, 1, 2, 3));
  const __m128i halves =
      _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<int16_t>(rem)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
  const int64_t off = n * nb + 8 * ngf;
  const __m256 d8 = _mm256_cvtph_ps(_mm_and_si128(
      _mm_maskload_epi32(reinterpret_cast<const int*>(a.wd + off), dwords), halves));
  const __m256 m8 = _mm256_cvtph_ps(_mm_and_si128(
      _mm_maskload_epi32(reinterpret_cast<const int*>(a.wm + off), dwords), halves));
  for (int r = 0; r < R; ++r) {
    __m256i isum;
    if constexpr (NP == 1) {  // lanes 0 and 1 the pair's two blocks; the other lanes any integer (padding)
      const __m256i h = _mm256_hadd_epi32(pp[r][0], pp[r][0]);
      isum = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h, h), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    } else {
      isum = reduce_pairs(pp[r][0], pp[r][1], pp[r][2], pp[r][3]);
    }
    const float* sa = a.sa + (m0 + r) * a.ss + 8 * ngf;
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_loadu_ps(sa)), acc[r]);
    acc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * ngf), acc[r]);
  }
}

// How far ahead packed_tile prefetches: a one-row call reads each weight byte once, and on Zen 1 the hardware
// prefetcher alone left it at ~3 GB/s a thread from memory (a /tmp A/B of 30 layers' distinct weights).
#ifndef QG_PACKED_PREFETCH_KB
#define QG_PACKED_PREFETCH_KB 12
#endif
static constexpr int64_t kPrefetchBytes = QG_PACKED_PREFETCH_KB * 1024;

// Column n's codes and scales toward L1 ahead of their use (nothing past the last column).
static inline void prefetch_column(const QArgs16& a, int64_t n) {
  if (n >= a.N) return;
  const int64_t row_bytes = a.K / 2, nb = a.K / QK;
  const char* w = reinterpret_cast<const char*>(a.wq + n * row_bytes);
  for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(w + o, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.wd + n * nb), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.wm + n * nb), _MM_HINT_T0);
}

// R rows against packed columns n0 .. n0 + C - 1.
template <int R, int C>
static inline void packed_tile(const QArgs16& a, int64_t m0, int64_t n0) {
  const int64_t nb = a.K / QK, ngf = nb / 8, row_bytes = a.K / 2;
  const __m256i nib = _mm256_set1_epi16(0x000F);
  const int64_t ahead = kPrefetchBytes / row_bytes > C ? kPrefetchBytes / row_bytes : C;  // columns
  if (m0 == 0)
    for (int j = 0; j < C; ++j) prefetch_column(a, n0 + ahead + j);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ngf; ++g) {
    __m256i s[R][C];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) s[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        const __m256i d = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.wq + (n0 + j) * row_bytes + g * 4 * QK + 32 * q));
        // steps 4q .. 4q + 3 (qgemm_a16_lanes.h's e(s, h) for Q4): the four nibbles of each 16-bit word
        const __m256i w[4] = {_mm256_and_si256(d, nib), _mm256_and_si256(_mm256_srli_epi16(d, 4), nib),
                              _mm256_and_si256(_mm256_srli_epi16(d, 8), nib), _mm256_srli_epi16(d, 12)};
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(a.qa + (m0 + r) * a.qs + g * kGroup16 + (4 * q + t) * 16));
            s[r][j] = _mm256_add_epi32(s[r][j], _mm256_madd_epi16(w[t], x));
            keep_chain(s[r][j]);
          }
        }
      }
    }
    for (int j = 0; j < C; ++j) {  // the group's end (numerics 3), as lane_group_end
      const uint16_t* dn = a.wd + (n0 + j) * nb + 8 * g;
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dn)));
      const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.wm + (dn - a.wd))));
      for (int r = 0; r < R; ++r) {
        const float* sa = a.sa + (m0 + r) * a.ss + 8 * g;
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][j]), _mm256_mul_ps(d8, _mm256_loadu_ps(sa)), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * g), acc[r][j]);
      }
    }
  }
  if (nb % 8) {
    for (int j = 0; j < C; ++j) {
      __m256 col[R];
      for (int r = 0; r < R; ++r) col[r] = acc[r][j];
      switch ((nb % 8 + 1) / 2) {
        case 1: packed_tail<R, 1>(a, m0, n0 + j, col); break;
        case 2: packed_tail<R, 2>(a, m0, n0 + j, col); break;
        case 3: packed_tail<R, 3>(a, m0, n0 + j, col); break;
        default: packed_tail<R, 4>(a, m0, n0 + j, col); break;
      }
      for (int r = 0; r < R; ++r) acc[r][j] = col[r];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) store16(a, m0 + r, n0 + j, acc[r][j]);
}

// All rows against columns n0 .. n0 + C - 1: the columns' bytes stay in L1 while the row tiles of 3 (then 2 or 1)
// widen them again in registers.
template <int C>
static inline void packed_rows(const QArgs16& a, int64_t n0) {
  int64_t m = 0;
  for (; m + 3 <= a.M; m += 3) packed_tile<3, C>(a, m, n0);
  switch (a.M - m) {
    case 2: packed_tile<2, C>(a, m, n0); break;
    case 1: packed_tile<1, C>(a, m, n0); break;
    default: break;
  }
}

// Output columns [n0, n1) of a call with M < kPackedRows rows and packed 4-bit weights.
static void gemm16_packed(const QArgs16& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) packed_rows<2>(a, n);
  if (n < n1) packed_rows<1>(a, n);
}
