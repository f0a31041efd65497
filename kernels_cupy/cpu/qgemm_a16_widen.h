// Weight columns widened to the A16 lane layout (qgemm_a16_lanes.h describes it), once a call per column, into
// a thread's panel. Included by qgemm_a16_lanes.h inside the instruction-set namespaces of qgemm_core.h; no STL.

// Vector q lane j = bytes 4q .. 4q + 3 of block j -> its 4 steps of the lane layout at dst + 64 q.
static inline void widen_lanes_q4(const __m256i d[4], int16_t* dst) {
  const __m256i nib = _mm256_set1_epi16(0x000F);
  for (int q = 0; q < 4; ++q) {
    __m256i* o = reinterpret_cast<__m256i*>(dst + 4 * q * 16);
    _mm256_store_si256(o, _mm256_and_si256(d[q], nib));                           // lo(4q), lo(4q+2)
    _mm256_store_si256(o + 1, _mm256_and_si256(_mm256_srli_epi16(d[q], 4), nib));  // hi(4q), hi(4q+2)
    _mm256_store_si256(o + 2, _mm256_and_si256(_mm256_srli_epi16(d[q], 8), nib));  // lo(4q+1), lo(4q+3)
    _mm256_store_si256(o + 3, _mm256_srli_epi16(d[q], 12));                        // hi(4q+1), hi(4q+3)
  }
}

// 8 Q4 blocks (128 bytes) -> 16 steps of the lane layout at dst (256 int16).
static inline void widen_group_q4(const uint8_t* w, int16_t* dst) {
  __m256i y[4];
  for (int k = 0; k < 4; ++k) y[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * k));
  // 32-bit transpose: d[q] lane j = bytes 4q..4q+3 of block j.
  const __m256i a = _mm256_unpacklo_epi32(y[0], y[1]), b = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i c = _mm256_unpacklo_epi32(y[2], y[3]), e = _mm256_unpackhi_epi32(y[2], y[3]);
  const __m256i d[4] = {lanes_in_order(_mm256_unpacklo_epi64(a, c)), lanes_in_order(_mm256_unpackhi_epi64(a, c)),
                        lanes_in_order(_mm256_unpacklo_epi64(b, e)), lanes_in_order(_mm256_unpackhi_epi64(b, e))};
  widen_lanes_q4(d, dst);
}

// 8 Q4 blocks packed in lane order (QArgs16::wlanes: the transpose above done once, at load) -> dst.
static inline void widen_group_q4_packed(const uint8_t* w, int16_t* dst) {
  __m256i d[4];
  for (int q = 0; q < 4; ++q) d[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * q));
  widen_lanes_q4(d, dst);
}

// 8 Q8 blocks packed in lane order (pack_lanes_q8: 16 steps of 16 bytes) -> dst.
static inline void widen_group_q8_packed(const uint8_t* w, int16_t* dst) {
  for (int st = 0; st < 16; ++st)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 16 * st),
                       _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * st))));
}

// 8 Q8 blocks (256 bytes) -> 16 steps of the lane layout at dst (256 int16).
static inline void widen_group_q8(const uint8_t* w, int16_t* dst) {
  __m256i y[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) y[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * k));
  for (int k = 0; k < 8; k += 2) {  // [b d0, b' d0, b d1, b' d1 | d4, d5] and [d2, d3 | d6, d7]
    t[k] = _mm256_unpacklo_epi32(y[k], y[k + 1]);
    t[k + 1] = _mm256_unpackhi_epi32(y[k], y[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {  // four blocks' dwords (0 | 4), (1 | 5), (2 | 6), (3 | 7)
    u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m256i lo = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);  // dword q of blocks 0..7
    const __m256i hi = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);  // dword q + 4
    __m256i* o = reinterpret_cast<__m256i*>(dst);
    _mm256_store_si256(o + 2 * q, _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8));  // bytes 4q, 4q+2
    _mm256_store_si256(o + 2 * q + 1, _mm256_srai_epi16(lo, 8));                  // bytes 4q+1, 4q+3
    _mm256_store_si256(o + 2 * (q + 4), _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8));
    _mm256_store_si256(o + 2 * (q + 4) + 1, _mm256_srai_epi16(hi, 8));
  }
}

// A widened column of a panel: w (wlen) int16 in the lane layout, d and m (ss) fp32, zero past nb.
struct Col16 {
  const int16_t* w;
  const float* d;
  const float* m;
};

// Bytes of a widened column's codes, rounded up so that its scales start 64-byte aligned.
static inline int64_t col16_code_bytes(const Lanes16& L) { return (L.wlen * 2 + 63) / 64 * 64; }
// Bytes of one widened column in a panel (w, then d, then m), a multiple of 64: every column's codes start on
// a cache line (the 512-bit loop's aligned loads).
static inline int64_t col16_bytes(const Lanes16& L, int64_t ss) { return (col16_code_bytes(L) + 8 * ss + 63) / 64 * 64; }

static inline Col16 panel_col(char* p, const Lanes16& L, int64_t ss) {
  const float* d = reinterpret_cast<const float*>(p + col16_code_bytes(L));
  return Col16{reinterpret_cast<const int16_t*>(p), d, d + ss};
}

// Weight column n -> its widened copy at p (col16_bytes).
template <bool Q4>
static void widen_column(const QArgs16& a, const Lanes16& L, int64_t n, char* p) {
  const int64_t ss = a.ss;
  const int64_t nb = L.nb, gb = Q4 ? 4 * QK : 8 * QK;  // gb: bytes a group
  const uint8_t* wn = a.wq + n * (Q4 ? a.K / 2 : a.K);
  int16_t* w = reinterpret_cast<int16_t*>(p);
  for (int64_t g = 0; g < L.ngl; ++g) {
    const uint8_t* src = wn + g * gb;
    alignas(32) uint8_t wt[8 * QK];
    if (8 * (g + 1) > nb) {  // a padded last group: the row's bytes end with its last block
      std::memset(wt, 0, sizeof wt);
      std::memcpy(wt, src, (nb - 8 * g) * gb / 8);
      src = wt;
    }
    if constexpr (Q4) {
      if (a.wlanes && src != wt) widen_group_q4_packed(src, w + g * kGroup16);  // a full group: packed
      else widen_group_q4(src, w + g * kGroup16);
    } else {
      if (a.wlanes && src != wt) widen_group_q8_packed(src, w + g * kGroup16);
      else widen_group_q8(src, w + g * kGroup16);
    }
  }
  if (L.span) {  // the span group, from each tail block's codes in natural order
    const int64_t first = 8 * L.ngl;
    int16_t* t = w + L.ngl * kGroup16;
    std::memset(t, 0, 64 * L.span);
    for (int i = 0; first + i < nb; ++i) {
      alignas(32) int16_t nat[QK];  // the block's codes in natural order
      const uint8_t* blk = wn + (first + i) * gb / 8;
      __m256i* nv = reinterpret_cast<__m256i*>(nat);
      if constexpr (Q4) {  // byte e: element e in its low nibble, element e + 16 in its high one
        const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)), nib = _mm_set1_epi8(0x0F);
        _mm256_store_si256(nv, _mm256_cvtepu8_epi16(_mm_and_si128(y, nib)));
        _mm256_store_si256(nv + 1, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(y, 4), nib)));
      } else {
        _mm256_store_si256(nv, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
        _mm256_store_si256(nv + 1, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16))));
      }
      to_span(nat, L.span, i, t);
    }
  }
  float* d = reinterpret_cast<float*>(p + col16_code_bytes(L));
  float* m = d + ss;
  const uint16_t* dn = a.wd + n * nb;
  const uint16_t* mn = Q4 ? a.wm + n * nb : nullptr;
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    _mm256_store_ps(d + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dn + b))));
    if constexpr (Q4) _mm256_store_ps(m + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b))));
  }
  for (; b < ss; ++b) {
    d[b] = b < nb ? _cvtsh_ss(dn[b]) : 0.f;
    m[b] = Q4 && b < nb ? _cvtsh_ss(mn[b]) : 0.f;
  }
}
