// Block-quantized GEMM body: out (M, N) = x (M, K) @ W (N, K)^T, W in GGUF-style blocks of 32 along K.
// Included once per instruction set by qgemm.cpp, inside its own namespace and `#pragma GCC target`
// region, so one binary carries an AVX2 and an AVX-512 VNNI build and picks one at run time. QG_VNNI
// selects the int8 dot-product instruction. No STL here: templates instantiated under a target pragma
// would clash with the same instantiations elsewhere.
//
// Arithmetic (llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 scheme): each row of x is quantized per block of 32 to
// int8 with scale sa = amax / 127; a weight block holds d (and, for Q4_1, m) and 32 codes; then
//   sum_i w_i x_i ~= d * sa * sum_i(q_i * qa_i) + m * sa * sum_i(qa_i)
// which is exactly W . x_hat (x_hat = sa * qa): the error is W times the rounding of x. (Pairing the min
// term with the exact sum of x instead leaves the error on the codes alone, d * q = w - m, which for
// Q4_1's unsigned codes is several times larger than w.)

static constexpr int QK = 32;

// The largest |x_i| of a block of 32 floats, the floats left in v (both activation quantizers start here).
static inline float block_amax(const float* x, __m256 v[4]) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// 32 floats -> 32 int8 codes, their scale and the block sum of the quantized values (scale * sum of codes).
static inline void quantize_block(const float* x, int8_t* q, float* scale, float* xsum) {
  __m256 v[4];
  const float d = block_amax(x, v) / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // round to nearest even
  // The sum of the block's codes, so a Q4 block's min term sees the same (quantized) x as its code term.
  const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i is4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
  is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
  // packs work per 128-bit lane: the permute restores element order.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  *scale = d;
  *xsum = d * static_cast<float>(_mm_cvtsi128_si32(is4));
}

static void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* scale, float* xsum) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + r * K + b * QK, q + r * K + b * QK, scale + r * nb + b, xsum + r * nb + b);
}

// The 4-bit kernels' activation layout. A pair of Q4 blocks is 32 contiguous weight bytes, byte i of block j
// holding elements i (low nibble) and i + 16 (high nibble); one 256-bit load, a mask and a shift give
// [block 2p elements 0..15 | block 2p+1 elements 0..15] and the same for 16..31. The activations of the pair
// are stored to match (64 bytes: 2p[0..16), 2p+1[0..16), 2p[16..32), 2p+1[16..32)), so a pair costs 3 integer
// ops to unpack instead of 10, and its two blocks' sums land in the low and high four int32 lanes of one
// register, scaled by one multiply with sa8's [sa_2p x4 | sa_2p+1 x4]. An odd last block stays in natural
// order. (Per block and row the single-row kernel ran ~16 instructions, compute-bound under memory speed.)
static void quantize_rows_q4(const float* x, int64_t rows, int64_t K, int8_t* q, float* scale, float* xsum,
                             float* sa8) {
  const int64_t nb = K / QK, np = nb / 2;
  alignas(32) int8_t tmp[2 * QK];
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    int8_t* qr = q + r * K;
    for (int64_t p = 0; p < np; ++p) {
      const int64_t b = 2 * p;
      quantize_block(xr + b * QK, tmp, scale + r * nb + b, xsum + r * nb + b);
      quantize_block(xr + (b + 1) * QK, tmp + QK, scale + r * nb + b + 1, xsum + r * nb + b + 1);
      std::memcpy(qr + b * QK, tmp, 16);
      std::memcpy(qr + b * QK + 16, tmp + QK, 16);
      std::memcpy(qr + b * QK + 32, tmp + 16, 16);
      std::memcpy(qr + b * QK + 48, tmp + QK + 16, 16);
      float* s8 = sa8 + (r * np + p) * 8;
      for (int i = 0; i < 4; ++i) s8[i] = scale[r * nb + b], s8[4 + i] = scale[r * nb + b + 1];
    }
    if (nb % 2) quantize_block(xr + (nb - 1) * QK, qr + (nb - 1) * QK, scale + r * nb + nb - 1, xsum + r * nb + nb - 1);
  }
}

// u8 x s8 -> 8 int32 partial sums of 4 products each.
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if QG_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 16 bytes of Q4 codes -> 32 u8; GGUF order: low nibbles are elements 0..15, high nibbles 16..31.
static inline __m256i expand_q4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(hi, lo);
}

// The fixed tree ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): also the A16 kernel's (qgemm_a16.h, numerics 3).
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a0+a4, a1+a5, a2+a6, a3+a7
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp16 (a) . fp32 (b) over n elements.
static inline float dot_h32(const uint16_t* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    acc = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + i), acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += _cvtsh_ss(a[i]) * b[i];
  return s;
}

// Q8_0 weights: R activation rows against one weight row; every weight block is decoded once and used R times.
// (4-bit weights on the SIMD paths always come with pair-ordered activations: micro_q4.)
template <int R>
static inline void micro_q8(const QArgs& a, int64_t m0, int64_t n) {
  const int64_t nb = a.K / QK;
  const uint8_t* w = a.wq + n * a.K;
  const uint16_t* wd = a.wd + n * nb;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * QK));
    const __m256i wu = _mm256_sign_epi8(wv, wv);  // |w| as u8, sign moved onto x
    const float db = _cvtsh_ss(wd[b]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qa + row * a.K + b * QK));
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wu, _mm256_sign_epi8(xv, wv)));
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(db * a.sa[row * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = m0 + r;
    float v = hsum(acc[r]);
    if (a.bias) v += a.bias[n];
    a.out[row * a.N + n] = v;
  }
}

// 4-bit weights over pair-ordered activations (quantize_rows_q4): R rows against one weight row. kMins: add
// the min terms and the bias here, column by column (without wmt); else min_terms8 / min_terms1 add them.
template <int R, bool kMins>
static inline void micro_q4(const QArgs& a, int64_t m0, int64_t n) {
  const int64_t nb = a.K / QK, np = nb / 2;
  const uint8_t* w = a.wq + n * (a.K / 2);
  const uint16_t* wd = a.wd + n * nb;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i pair_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * QK));
    const __m256i lo = _mm256_and_si256(wv, mask), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
    uint32_t dbits;
    std::memcpy(&dbits, wd + 2 * p, sizeof dbits);  // the pair's two fp16 scales
    const __m256 d8 = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dbits)))), pair_idx);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* xp = a.qa + row * a.K + p * 2 * QK;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + QK));
#if QG_VNNI
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
      // int16 sums of 2 products of a 4-bit code and an int8: |.| <= 3810, so two add without saturating.
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
      const __m256i dot = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
      const __m256 sc = _mm256_mul_ps(d8, _mm256_loadu_ps(a.sa8 + (row * np + p) * 8));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[r]);
    }
  }
  if (nb % 2) {  // the odd last block, natural order
    const int64_t b = nb - 1;
    const __m256i wu = expand_q4(w + b * (QK / 2));
    const float db = _cvtsh_ss(wd[b]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qa + row * a.K + b * QK));
      const __m256 pv = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
      acc[r] = _mm256_fmadd_ps(pv, _mm256_set1_ps(db * a.sa[row * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = m0 + r;
    float v = hsum(acc[r]);
    if (kMins) {
      v += dot_h32(a.wm + n * nb, a.xsum + row * nb, nb);
      if (a.bias) v += a.bias[n];
    }
    a.out[row * a.N + n] = v;
  }
}

// The min terms from the transposed minimums (QArgs::wmt): out[m, n] += sum_b wm[n, b] * xsum[m, b], then
// + bias[n]. Per column and row (dot_h32 and a horizontal sum) they took a third of a 16-row GEMM's time at
// K = 576; with the minimums of eight adjacent columns in one 16-byte row of wmt, each block costs one
// broadcast FMA for eight columns. Blocks in chunks, so the widened tile stays 4 KB whatever K is.
static constexpr int64_t kMinChunk = 128;

static void min_terms8(const QArgs& a, int64_t n0) {
  const int64_t nb = a.K / QK;
  alignas(32) float wt[kMinChunk * 8];  // (blocks of this chunk, 8 columns) fp32
  for (int64_t c0 = 0; c0 < nb; c0 += kMinChunk) {
    const int64_t cn = nb - c0 < kMinChunk ? nb - c0 : kMinChunk;
    for (int64_t b = 0; b < cn; ++b)
      _mm256_store_ps(wt + b * 8, _mm256_cvtph_ps(_mm_loadu_si128(
                                       reinterpret_cast<const __m128i*>(a.wmt + (c0 + b) * a.N + n0))));
    const __m256 bias = a.bias && c0 == 0 ? _mm256_loadu_ps(a.bias + n0) : _mm256_setzero_ps();
    for (int64_t row = 0; row < a.M; ++row) {
      const float* xs = a.xsum + row * nb + c0;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();  // two chains: FMA latency, short loop
      int64_t b = 0;
      for (; b + 2 <= cn; b += 2) {
        s0 = _mm256_fmadd_ps(_mm256_set1_ps(xs[b]), _mm256_load_ps(wt + b * 8), s0);
        s1 = _mm256_fmadd_ps(_mm256_set1_ps(xs[b + 1]), _mm256_load_ps(wt + (b + 1) * 8), s1);
      }
      if (b < cn) s0 = _mm256_fmadd_ps(_mm256_set1_ps(xs[b]), _mm256_load_ps(wt + b * 8), s0);
      float* o = a.out + row * a.N + n0;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(o), _mm256_add_ps(s0, s1)), bias));
    }
  }
}

// One column with min_terms8's arithmetic for its lane, operation for operation (the same fused multiply-adds,
// chains, chunks and additions): a column's value must not depend on whether the threads' split of N put it
// in a tile of eight, since the decode stack and the module path split differently and must agree bit for bit.
static void min_terms1(const QArgs& a, int64_t n) {
  const int64_t nb = a.K / QK;
  for (int64_t c0 = 0; c0 < nb; c0 += kMinChunk) {
    const int64_t cn = nb - c0 < kMinChunk ? nb - c0 : kMinChunk;
    const float bias = a.bias && c0 == 0 ? a.bias[n] : 0.f;
    for (int64_t row = 0; row < a.M; ++row) {
      const float* xs = a.xsum + row * nb + c0;
      float s0 = 0.f, s1 = 0.f;
      int64_t b = 0;
      for (; b + 2 <= cn; b += 2) {
        s0 = std::fma(xs[b], _cvtsh_ss(a.wmt[(c0 + b) * a.N + n]), s0);
        s1 = std::fma(xs[b + 1], _cvtsh_ss(a.wmt[(c0 + b + 1) * a.N + n]), s1);
      }
      if (b < cn) s0 = std::fma(xs[b], _cvtsh_ss(a.wmt[(c0 + b) * a.N + n]), s0);
      float* o = a.out + row * a.N + n;
      *o = (*o + (s0 + s1)) + bias;
    }
  }
}

template <int R, bool Q4, bool kMins>
static inline void micro_rows(const QArgs& a, int64_t m0, int64_t n) {
  if constexpr (Q4) micro_q4<R, kMins>(a, m0, n);
  else micro_q8<R>(a, m0, n);
}

// Every row of column n, four at a time, then the rest (kMins: see micro_q4; ignored for Q8_0).
template <bool Q4, bool kMins>
static inline void column(const QArgs& a, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) micro_rows<4, Q4, kMins>(a, m, n);
  switch (a.M - m) {
    case 3: micro_rows<3, Q4, kMins>(a, m, n); break;
    case 2: micro_rows<2, Q4, kMins>(a, m, n); break;
    case 1: micro_rows<1, Q4, kMins>(a, m, n); break;
    default: break;
  }
}

static void gemm_rows_q4(const QArgs& a, int64_t n0, int64_t n1) {
  if (!a.wmt) {
    for (int64_t n = n0; n < n1; ++n) column<true, true>(a, n);
    return;
  }
  // In tiles of eight columns: each column's code terms, then the tile's min terms at once.
  for (int64_t t0 = n0; t0 < n1; t0 += 8) {
    const int64_t t1 = t0 + 8 <= n1 ? t0 + 8 : n1;
    for (int64_t n = t0; n < t1; ++n) column<true, false>(a, n);
    if (t1 - t0 == 8) min_terms8(a, t0);
    else for (int64_t n = t0; n < t1; ++n) min_terms1(a, n);
  }
}

static void gemm(const QArgs& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) {
    gemm_rows_q4(a, n0, n1);
    return;
  }
  for (int64_t n = n0; n < n1; ++n) column<false, true>(a, n);
}
