// The A16 kernel for few rows (packed_tiles: on the AVX2 path below 12 rows for Q4, 24 for Q8, on the VNNI path
// below 5; decode batches) against block codes packed in lane order (QArgs16::wlanes, qgemm_core.h's pack_lanes_q4
// / _q8), 256-bit only. Included at the end of qgemm_a16_lanes.h inside the AVX2 namespace of qgemm_core.h, whose
// dispatch calls it on the VNNI path too (the same AVX2 code); no STL. Numerics: qgemm_a16.h (the
// same exact block sums, the same group ends, so the same bits as every other path).
//
// Why: the pair kernel (qgemm_a16.h) widens each weight pair in its natural order and reduces four pairs'
// partial sums to eight block sums with shuffles: on Zen 1 a one-row call ran 7.0 GMAC/s a core at K = 576, and
// the lane kernel first widens every column of a call into an L2 panel. Packed, a full group is already in the
// lane layout's order: for Q4, 32-bit lane j of vector q holds bytes 4q .. 4q + 3 of block j, and each vector
// widens to four lane steps with shifts and masks (widen_lanes_q4's, in registers); for Q8 each step is 16 bytes
// that sign-extend to its words. A tile of up to 3 rows uses each widened step, every vpmaddwd sums straight into
// the group's eight block sums, and nothing is reduced. Only full groups are packed; the last nb % 8 blocks keep
// the GGUF's bytes and run as the pair kernel's partial group (packed_tail).
//
// Activations (quantize_rows16_packed): per row, the nb / 8 full groups in the lane layout (qgemm_a16_lanes.h),
// then the tail's blocks in the pair layout (qgemm_a16.h), at ngf * kGroup16; within a16_code_stride(K).

// rows x K floats -> q (rows, qs) int16 in the layout above, sa and xsum (rows, ss), zero-padded.
static void quantize_rows16_packed(const float* x, int64_t rows, int64_t K, int bits, int16_t* q, int64_t qs,
                                   float* sa, float* xsum, int64_t ss) {
  const int64_t nb = K / QK, full = nb / 8 * 8;
  alignas(32) int16_t c[QK];
  const LaneElems lanes(bits);
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* qr = q + r * qs;
    int16_t* tail = qr + (nb / 8) * kGroup16;
    for (int64_t b = 0; b < nb; ++b) {
      quantize_block16(x + r * K + b * QK, c, sa + r * ss + b, xsum + r * ss + b);
      if (b < full) {
        lanes.place(c, b, qr);
      } else {
        place_block16(c, static_cast<int>((b - full) % 2), bits, tail + ((b - full) / 2) * kPair16);
      }
    }
    if ((nb - full) % 2) {  // the odd last block's partner: zeros, as in quantize_rows16_pairs
      std::memset(c, 0, sizeof c);
      place_block16(c, 1, bits, tail + ((nb - full) / 2) * kPair16);
    }
    for (int64_t b = nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}

// The last rem = nb % 8 blocks of column n (the GGUF's bytes, in NP pairs) for R rows, as the pair kernel's partial
// group (qgemm_a16.h, numerics 3: lanes past rem add +0), without its per-column copies of d and m: with them
// the 2-block tail of K = 576 took as long as the 16 packed blocks before it (a one-row call on Zen 1), with the
// masked loads below about 60% as long.
template <int R, int NP, bool Q4>
static inline void packed_tail(const QArgs16& a, int64_t m0, int64_t n, __m256 acc[R]) {
  constexpr int64_t kBlock = Q4 ? QK / 2 : QK;  // bytes a block
  const int64_t nb = a.K / QK, ngf = nb / 8, rem = nb % 8;
  const uint8_t* wg = a.wq + n * nb * kBlock + ngf * 8 * kBlock;
  // An odd last block's pair partner is the next row's first block: its activations are zeros, so it adds 0 to a
  // padding lane. Only past the end of wq (the last column) is it read from a zero-padded copy.
  alignas(32) uint8_t wt[2 * kBlock];
  const uint8_t* last = wg + (NP - 1) * 2 * kBlock;
  if ((rem & 1) && n == a.N - 1) {
    std::memcpy(wt, last, kBlock);
    std::memset(wt + kBlock, 0, kBlock);
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
    const uint8_t* pair = p == NP - 1 ? last : wg + p * 2 * kBlock;
    if constexpr (Q4) widen_q4(pair, w);
    else widen_q8(pair, w);
    for (int r = 0; r < R; ++r) pp[r][p] = dot_pair(w, a.qa + (m0 + r) * a.qs + ngf * kGroup16 + p * kPair16);
  }
  // d and m of the rem blocks, zeros past them: masked loads never read past the column's scales.
  const __m128i dwords = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>((rem + 1) / 2)), _mm_setr_epi32(0, 1, 2, 3));
  const __m128i halves =
      _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<int16_t>(rem)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
  const int64_t off = n * nb + 8 * ngf;
  const __m256 d8 = _mm256_cvtph_ps(_mm_and_si128(
      _mm_maskload_epi32(reinterpret_cast<const int*>(a.wd + off), dwords), halves));
  __m256 m8 = _mm256_setzero_ps();
  if constexpr (Q4)
    m8 = _mm256_cvtph_ps(_mm_and_si128(_mm_maskload_epi32(reinterpret_cast<const int*>(a.wm + off), dwords), halves));
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
    if constexpr (Q4) acc[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * ngf), acc[r]);
  }
}

// Columns a tile: one. Two (the rows' activation steps loaded once for both) ran a one-row call up to 1.09x faster
// with the weights in cache, but from memory, where decode reads them, two columns' interleaved streams were
// slower: the head (Q8, 49,152 x 576) at one row 0.81x of the GGUF order against 1.13x with one column, a model's
// 4-bit linears 1.05x against 1.15x. A software prefetch 12 KB ahead moved neither by more than the noise (Zen 1,
// 2 threads, /tmp A/B scripts; bench/RESULTS.md).
#ifndef QG_PACKED_COLS
#define QG_PACKED_COLS 1
#endif
static constexpr int kPackedCols = QG_PACKED_COLS;

// Steps 4q .. 4q + 3 of a packed group's lane layout (qgemm_a16_lanes.h's e(s, h)) for one column: Q4, the four
// nibbles of each 16-bit word of its vector q (widen_lanes_q4's); Q8, four 16-byte steps sign-extended.
template <bool Q4>
static inline void packed_steps(const uint8_t* group, int q, __m256i w[4]) {
  if constexpr (Q4) {
    const __m256i nib = _mm256_set1_epi16(0x000F);
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * q));
    w[0] = _mm256_and_si256(d, nib);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(d, 4), nib);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(d, 8), nib);
    w[3] = _mm256_srli_epi16(d, 12);
  } else {
    for (int t = 0; t < 4; ++t)
      w[t] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * (4 * q + t))));
  }
}

// R rows (from m0) against packed columns n0 .. n0 + C - 1.
template <int R, int C, bool Q4>
static inline void packed_tile(const QArgs16& a, int64_t m0, int64_t n0) {
  const int64_t nb = a.K / QK, ngf = nb / 8, row_bytes = Q4 ? a.K / 2 : a.K, group_bytes = Q4 ? 4 * QK : 8 * QK;
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
        __m256i w[4];
        packed_steps<Q4>(a.wq + (n0 + j) * row_bytes + g * group_bytes, q, w);
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
      __m256 m8 = _mm256_setzero_ps();
      if constexpr (Q4) m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.wm + (dn - a.wd))));
      for (int r = 0; r < R; ++r) {
        const float* sa = a.sa + (m0 + r) * a.ss + 8 * g;
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][j]), _mm256_mul_ps(d8, _mm256_loadu_ps(sa)), acc[r][j]);
        if constexpr (Q4)
          acc[r][j] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * g), acc[r][j]);
      }
    }
  }
  if (nb % 8) {
    for (int j = 0; j < C; ++j) {
      __m256 col[R];
      for (int r = 0; r < R; ++r) col[r] = acc[r][j];
      switch ((nb % 8 + 1) / 2) {
        case 1: packed_tail<R, 1, Q4>(a, m0, n0 + j, col); break;
        case 2: packed_tail<R, 2, Q4>(a, m0, n0 + j, col); break;
        case 3: packed_tail<R, 3, Q4>(a, m0, n0 + j, col); break;
        default: packed_tail<R, 4, Q4>(a, m0, n0 + j, col); break;
      }
      for (int r = 0; r < R; ++r) acc[r][j] = col[r];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) store16(a, m0 + r, n0 + j, acc[r][j]);
}

// All rows against columns n0 .. n0 + C - 1: the columns' bytes stay in L1 while the row tiles of 3 (then 2 or 1)
// widen them again in registers.
template <int C, bool Q4>
static inline void packed_rows(const QArgs16& a, int64_t n0) {
  int64_t m = 0;
  for (; m + 3 <= a.M; m += 3) packed_tile<3, C, Q4>(a, m, n0);
  switch (a.M - m) {
    case 2: packed_tile<2, C, Q4>(a, m, n0); break;
    case 1: packed_tile<1, C, Q4>(a, m, n0); break;
    default: break;
  }
}

template <bool Q4>
static void packed_cols(const QArgs16& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kPackedCols <= n1; n += kPackedCols) packed_rows<kPackedCols, Q4>(a, n);
  for (; n < n1; ++n) packed_rows<1, Q4>(a, n);
}

// Output columns [n0, n1) of a call that packed_tiles (qgemm_core.h) picks, with packed weights.
static void gemm16_packed(const QArgs16& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) packed_cols<true>(a, n0, n1);
  else packed_cols<false>(a, n0, n1);
}
