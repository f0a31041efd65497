// The A16 kernel on Intel AMX (AMX-INT8 tiles) for calls of kAmxRows (4) rows or more, where the CPU has AMX and
// Linux grants the tile state (qgemm_core.h, amx_on). Included once, inside qgemm_core.h's namespace amx and a
// `#pragma GCC target` region with AVX-512 and AMX; no STL. Uses the vnni namespace's A16 helpers.
//
// Numerics: qgemm_a16.h's, bit for bit. AMX multiplies bytes, so each code c (|c| <= 2047) is split in bytes and
// the tiles give each block's exact int32 sum isum = sum_i w_i c_i:
// - Q4 (weights 0..15): c = 16 h + l (h = c >> 4, a signed byte; l = c & 15). An A row of a block is its 32 l then
//   its 32 h, a B column the block's 32 w then 32 (16 w) (<= 240: a byte), so ONE 64-byte TDPBSUD gives
//   sum w l + sum 16 w h = isum: one tile product and one C tile a block and half of 16 columns.
// - Q8 (weights -127..127: 16 w is no byte): c = 256 hi + lo (hi = c >> 8 signed, lo = c & 255 unsigned); two
//   tile products, TDPBSSD and TDPBUSD, give S_hi and S_lo, and isum = 256 S_hi + S_lo in the epilogue.
// The fp32 epilogue is numerics 3 lane for lane: block b into lane b % 8, in block order. Padding blocks are
// skipped: they add fma(0, 0, acc) = acc + 0, which changes nothing, as an accumulator that starts at +0 never
// becomes -0 (x + y is -0 only when both are).
//
// Layouts:
// - activations (quantize_rows16_tiles): the A tiles themselves, so that each is 1 KB read in order: rows
//   16t .. 16t+15 (tile t) at byte 32 t qs of qa (where its rows would start), block b at 1024 b: Q4: row r at
//   64 r, its 32 l bytes then its 32 h bytes; Q8: the 16 rows' lo bytes (32 each, natural order), then their hi
//   bytes. 16 nb 64 = 32 K <= 32 qs bytes a tile. The codes buffer has whole tiles of rows (a16_code_rows); rows
//   past M are read and their results dropped.
// - weights (pack_chunk, once a call per 32 columns): for block b and each half of 16 columns, a B tile of 64-byte
//   rows, row k holding weights 4k .. 4k+3 of block b of each column c at bytes 4c .. 4c+3 (natural order: Q4
//   bytes 4k .. 4k+3 give elements 4k .. 4k+3 in their low nibbles and 16 + 4k .. in their high ones). Q4: 16 rows,
//   8 of w and 8 of 16 w; Q8: 8 rows. The blocks' scales d and minimums m beside them, as fp32 rows of 16 columns.
// - C tiles: per block, a tile of 16 rows x 16 int32 a half (Q8: two, lo and hi) stored to a slot of a small ring
//   for the epilogue, which adds the block into lane b % 8 of each output's 8 lane accumulators (L1, 16 KB).

using vnni::QK;
// Q4's single tile product needs h = c >> 4 in a signed byte: codes of 12 bits at most (qgemm_core.h, kCodeMax).
static_assert(kCodeMax <= 2047.0f, "Q4 on AMX splits a code as 16 h + l with h a signed byte");
static constexpr int64_t kChunk = 32;         // columns a pass: two halves of 16
// Bytes of C a block (a ring slot): 2 halves x (Q8: lo and hi) x 16 x 16 int32, plus 3 cache lines, so that the
// slots do not sit at a 4 KB stride (4K aliasing between one slot's loads and the next one's tile stores).
template <bool Q4> static constexpr int64_t kBlockTiles = (Q4 ? 2048 : 4096) + 192;
static constexpr int64_t kBlockW = 2048;      // bytes of B a block: 2 halves x (Q4: 16, Q8: 8) rows x 64
static constexpr int64_t kHalfW = 1024;       // where a block's second half starts in B

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Q8: tiles 0-3: C (lo h0, hi h0, lo h1, hi h1), rows x 64 bytes; 4, 5: A (lo, hi), rows x 32; 6, 7: B (h0, h1),
// 8 x 64. Q4: C in 0 and 2, A (l | h) in 4, rows x 64; B in 6 and 7, 16 x 64. rows < 16 for a call's last,
// part-filled row tile: its tile instructions then do that much work.
template <bool Q4>
static inline void configure_tiles(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : Q4 ? 16 : 8);
    c.colsb[t] = (t == 4 || t == 5) && !Q4 ? 32 : 64;
  }
  _tile_loadconfig(&c);
}

// The live columns of a half of 16 whose first w columns are real (w may be <= 0 or >= 16).
static inline __mmask16 half_mask(int64_t w) {
  return static_cast<__mmask16>(w >= 16 ? 0xFFFFu : w <= 0 ? 0u : (1u << w) - 1u);
}

// Rows r0 .. r0+rows-1 of the call (x, sa, xsum at row r0; q at row 0) -> their codes' bytes in the A tiles
// (above) for Q4 or Q8 weights, sa and xsum (rows, ss) zero-padded (numerics 1).
static void quantize_rows16_tiles(const float* x, int64_t rows, int64_t r0, int64_t K, int16_t* q, int64_t qs,
                                  float* sa, float* xsum, int64_t ss, bool q4) {
  const int64_t nb = K / QK;
  const int shift = q4 ? 4 : 8;  // c = 2^shift hi + lo
  const int64_t row_bytes = q4 ? 64 : 32, hi_at = q4 ? 32 : 512;
  const __m256i low = _mm256_set1_epi16(static_cast<int16_t>((1 << shift) - 1));
  alignas(32) int16_t c[QK];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = r0 + r;
    uint8_t* qt = reinterpret_cast<uint8_t*>(q) + (m / 16) * 32 * qs + (m % 16) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      vnni::quantize_block16(x + r * K + b * QK, c, sa + r * ss + b, xsum + r * ss + b);
      const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
      const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(c + 16));
      // packs work per 128-bit lane: [c0 0..7, c1 0..7 | c0 8..15, c1 8..15]; the permute restores the order.
      // |c| <= 2047: hi fits a signed byte for either shift, so packs never saturates.
      const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(c0, low), _mm256_and_si256(c1, low));
      const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(c0, shift), _mm256_srai_epi16(c1, shift));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qt + b * 1024), _mm256_permute4x64_epi64(lo, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qt + b * 1024 + hi_at), _mm256_permute4x64_epi64(hi, 0xD8));
    }
    for (int64_t b = nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}

// Columns [n, n + cn), cn <= 32, -> B tiles wt (nb x kBlockW) and scales dv, mv ((2 nb) x 16 fp32: half h,
// block b at row h nb + b); columns past cn are zeros. Each B row of w is one gather of a dword from 16 columns
// (Q4: and its row of 16 w the same dword's nibbles moved to the high halves of their bytes).
template <bool Q4>
static void pack_chunk(const QArgs16& a, int64_t n, int64_t cn, uint8_t* wt, float* dv, float* mv) {
  const int64_t nb = a.K / QK, row = Q4 ? a.K / 2 : a.K;  // bytes a weight row
  const __m512i nib = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i cols = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(row)));     // a column's codes
  const __m512i scl = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(2 * nb)));  // its fp16 scales
  for (int64_t h = 0; 16 * h < kChunk; ++h) {
    const __mmask16 keep = half_mask(cn - 16 * h);
    const int64_t c0 = n + 16 * h;
    const uint8_t* wq = a.wq + (keep ? c0 * row : 0);
    for (int64_t b = 0; b < nb; ++b) {
      __m512i* t = reinterpret_cast<__m512i*>(wt + b * kBlockW + kHalfW * h);  // rows of 64 bytes
      if constexpr (Q4) {
        for (int k = 0; k < 4; ++k) {
          const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, cols, wq + b * 16 + 4 * k, 1);
          _mm512_store_si512(t + k, _mm512_and_si512(v, nib));                              // w of 4k ..
          _mm512_store_si512(t + k + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));    // w of 16 + 4k ..
          _mm512_store_si512(t + k + 8, _mm512_and_si512(_mm512_slli_epi16(v, 4), high));   // 16 w of 4k ..
          _mm512_store_si512(t + k + 12, _mm512_and_si512(v, high));                        // 16 w of 16 + 4k ..
        }
      } else {
        for (int k = 0; k < 8; ++k)
          _mm512_store_si512(t + k, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, cols, wq + b * 32 + 4 * k, 1));
      }
      // fp16 scales: a dword gathered a column, its low half kept
      const uint8_t* dp = reinterpret_cast<const uint8_t*>(a.wd + (keep ? c0 * nb : 0) + b);
      const __m512i dw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, scl, dp, 1);
      _mm512_store_ps(dv + (h * nb + b) * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw)));
      if constexpr (Q4) {
        const uint8_t* mp = reinterpret_cast<const uint8_t*>(a.wm + (keep ? c0 * nb : 0) + b);
        const __m512i mw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, scl, mp, 1);
        _mm512_store_ps(mv + (h * nb + b) * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mw)));
      } else {
        _mm512_store_ps(mv + (h * nb + b) * 16, _mm512_setzero_ps());
      }
    }
  }
}

// Block b's C tiles for rows m0 .. m0+15 against the packed chunk wt, stored to c (kBlockTiles<Q4> bytes).
template <bool Q4>
static inline void block_tiles(const QArgs16& a, int64_t m0, int64_t b, const uint8_t* wt, int32_t* c) {
  const uint8_t* at = reinterpret_cast<const uint8_t*>(a.qa) + m0 * 2 * a.qs + b * 1024;  // tile m0 / 16, block b
  _tile_loadd(6, wt + b * kBlockW, 64);
  _tile_loadd(7, wt + b * kBlockW + kHalfW, 64);
  if constexpr (Q4) {
    _tile_zero(0);
    _tile_zero(2);
    _tile_loadd(4, at, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(2, 4, 7);
    _tile_stored(0, c, 64);
    _tile_stored(2, c + 256, 64);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, at, 32);
    _tile_loadd(5, at + 512, 32);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    _tile_dpbusd(2, 4, 7);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// Block b's share of the epilogue for the job's rows (rows of the tile at m0) and halves: numerics 3, block b into
// lane b % 8 of each output's accumulators acc ((row, half, lane) x 16 fp32, kept in L1 across the job's blocks),
// from the block's C tiles at c. The lanes see their blocks in block order, as a row at a time over every block
// would give them: the same bits.
template <bool Q4>
static inline void epilogue_block(const QArgs16& a, const int32_t* c, const float* dv, const float* mv, int64_t m0,
                                  int64_t rows, int64_t halves, int64_t b, __m512* acc) {
  const int64_t nb = a.K / QK, lane = b % 8;
  for (int64_t h = 0; h < halves; ++h) {
    const __m512 d = _mm512_load_ps(dv + (h * nb + b) * 16);
    const __m512 mn = _mm512_load_ps(mv + (h * nb + b) * 16);
    const int32_t* ch = c + h * (Q4 ? 256 : 512);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const __m512i s = Q4 ? _mm512_load_si512(ch + r * 16)
                           : _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + 256 + r * 16), 8),
                                              _mm512_load_si512(ch + r * 16));
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.sa[m * a.ss + b]));
      __m512* p = acc + (r * 2 + h) * 8 + lane;
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ds, b < 8 ? _mm512_setzero_ps() : *p);
      if constexpr (Q4) v = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[m * a.ss + b]), v);
      *p = v;
    }
  }
}

// The job's outputs: each (row, half)'s 8 lanes in numerics 3's tree, the bias, 16 (masked) outputs.
static inline void epilogue_out(const QArgs16& a, const __m512* acc, int64_t m0, int64_t rows, int64_t n, int64_t cn) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < 2; ++h) {
      const __mmask16 keep = half_mask(cn - 16 * h);
      if (!keep) continue;
      const __m512* l = acc + (r * 2 + h) * 8;
      __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                               _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])));
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, a.bias + n + 16 * h));
      _mm512_mask_storeu_ps(a.out + (m0 + r) * a.N + n + 16 * h, keep, v);
    }
  }
}

// C tiles stay in L1: a block's tiles go to a ring of kRing slots and its epilogue runs kLag blocks later, when the
// stores are done, so they are read back from L1 soon after. (The tile unit does not run beside the epilogue's
// 512-bit FP ops on Sapphire Rapids: bench/amx_overlap.cpp; a block costs tiles + epilogue.) Holding a whole
// job's tiles instead (nb slots: 40 KB for Q4, 77 KB for Q8 at K = 576, double-buffered, so in L2) made the
// head's Q8 calls 1.1-1.3x slower at 32 rows; Q4 calls take the same time either way (bench/RESULTS.md).
static constexpr int64_t kLag = 2, kRing = 3;

// Output columns [n0, n1) for every row: 32 columns a pass (packed once), each tile of 16 rows in turn: for each
// block its tile products, then the epilogue of the block kLag before it.
template <bool Q4>
static void gemm16_tiles(const QArgs16& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / QK, slot = nb * kBlockW + kRing * kBlockTiles<Q4> + 2 * 2 * nb * 16 * 4;
  char* buf = vnni::panel_buffer(slot);
  uint8_t* wt = reinterpret_cast<uint8_t*>(buf);
  int32_t* ring = reinterpret_cast<int32_t*>(buf + nb * kBlockW);
  float* dv = reinterpret_cast<float*>(buf + nb * kBlockW + kRing * kBlockTiles<Q4>);
  float* mv = dv + 2 * nb * 16;
  alignas(64) __m512 acc[16 * 2 * 8];  // (row, half, lane) x 16 fp32
  if (nb < 8)  // lanes past nb are never written: they stay 0 (the others start at their first block)
    for (int64_t i = 0; i < 16 * 2 * 8; ++i) acc[i] = _mm512_setzero_ps();
  auto slot_at = [&](int64_t b) { return ring + (b % kRing) * (kBlockTiles<Q4> / 4); };
  int rows = 16;
  configure_tiles<Q4>(rows);
  for (int64_t n = n0; n < n1; n += kChunk) {
    const int64_t cn = n + kChunk < n1 ? kChunk : n1 - n, halves = cn > 16 ? 2 : 1;
    pack_chunk<Q4>(a, n, cn, wt, dv, mv);
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int tr = static_cast<int>(a.M - m0 < 16 ? a.M - m0 : 16);
      if (tr != rows) configure_tiles<Q4>(rows = tr);  // (a new configuration clears the tiles: none is live here)
      for (int64_t b = 0; b < nb + kLag; ++b) {
        if (b < nb) block_tiles<Q4>(a, m0, b, wt, slot_at(b));
        if (b >= kLag) epilogue_block<Q4>(a, slot_at(b - kLag), dv, mv, m0, tr, halves, b - kLag, acc);
      }
      epilogue_out(a, acc, m0, tr, n, cn);
    }
  }
  _tile_release();
}

static void gemm16(const QArgs16& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) gemm16_tiles<true>(a, n0, n1);
  else gemm16_tiles<false>(a, n0, n1);
}
