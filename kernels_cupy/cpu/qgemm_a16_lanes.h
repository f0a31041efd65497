// The A16 kernel for many rows (M >= kLaneRows: prefill, batched decode): the lane layout. Included after
// qgemm_a16.h (numerics there, unchanged here: every layout yields the same exact block sums isum) inside the
// instruction-set namespaces of qgemm_core.h; no STL. Also the A16 entry points, which pick the layout by M.
//
// Layout (activations: quantize_rows16_lanes; weights: widen_column), one row of the call:
// - groups g < ngl of 8 blocks: 16 steps of 16 int16; step s, 32-bit lane j, word h holds element e(s, h) of
//   block 8g + j (zeros for blocks past nb):
//     Q4: s = 4q + t, e = 4q + 2h + (0, 16, 1, 17)[t]      Q8: s = 2q + t, e = 4q + 2h + t
//   which is how the weight bytes of 8 blocks widen after one 32-bit transpose (widen_group_q4 / _q8). A row's
//   group is 16 vpmaddwd summed straight into its 8 block sums, no reduction.
// - a tail of rem = nb % 8 in 1..4 blocks (K = 576 has 18 blocks: 2 full groups and 2 blocks) in a span group
//   instead of a group padded to 8 blocks (which spends 16 steps on 2 blocks): span = 1, 2 or 4 (rem rounded
//   up), 32 * span codes, laid out per instruction set (qgemm_a16_tail.h): 512-bit (VNNI) spreads each block
//   over S = 8 / span lanes of a 256-bit step, 2 * span steps; 256-bit (AVX2) over H = 4 / span lanes of a
//   128-bit step, 4 * span steps, so that one vpmaddwd serves two columns (one a half). Either way the tail ends
//   like any group: blocks 8 * ngl + i in lanes i, d = m = sa = xsum = 0 past nb. Lanes past rem then hold
//   some integer; times d * sa = 0 it adds a signed zero, which leaves the fp32 lane as it was (it starts at
//   +0, and a sum is -0 only when both terms are), as numerics 3's padding blocks do.
//
// Blocking: each thread widens its columns once a call, a panel at a time (kPanel16 bytes, L2-resident); for
// each block of rows (kRowBlock16 bytes of codes, L2) each micro-tile of kColsLanes columns (L1) runs over
// the block's micro-tiles of kRowsLanes rows.

static constexpr int64_t kGroup16 = 256;  // int16 codes a group of 8 blocks (16 steps of 16)

// Where a row's blocks are in the lane layout of K (above).
struct Lanes16 {
  int64_t nb;    // blocks a row
  int64_t ngl;   // groups of 8 lanes (the last one padded when nb % 8 > 4)
  int span;      // 1, 2 or 4: the span group's width; 0: none
  int64_t wlen;  // int16 codes a row or column: ngl * 256 + 32 * span
};

static inline Lanes16 lanes16(int64_t K) {
  const int64_t nb = K / QK, rem = nb % 8;
  const int span = rem == 0 || rem > 4 ? 0 : rem == 1 ? 1 : rem == 2 ? 2 : 4;
  const int64_t ngl = nb / 8 + (rem > 4 ? 1 : 0);
  return Lanes16{nb, ngl, span, ngl * kGroup16 + 32 * span};
}

// Element e(s, h) of a full group (above).
static inline int lane_elem(int bits, int s, int h) {
  if (bits == 8) return 4 * (s / 2) + 2 * h + s % 2;
  static const int off[4] = {0, 16, 1, 17};
  return 4 * (s / 4) + 2 * h + off[s % 4];
}

// Tail block i's 32 codes in natural order (c) -> their words of the span group t (fixed-size copies).
#if QG_VNNI
// Step s (16 words), lanes i S .. i S + S - 1 hold elements 2 S s .. 2 S s + 2 S - 1, in order (S = 8 / SPAN).
template <int SPAN>
static inline void to_span(const int16_t* c, int i, int16_t* t) {
  constexpr int S = 8 / SPAN;
  for (int s = 0; s < 2 * SPAN; ++s) std::memcpy(t + 16 * s + 2 * S * i, c + 2 * S * s, 4 * S);
}
#else
// Step s (8 words, a 128-bit half), lanes i H .. i H + H - 1 hold elements 2 H s .. 2 H s + 2 H - 1, in order
// (H = 4 / SPAN, 4 * SPAN steps).
template <int SPAN>
static inline void to_span(const int16_t* c, int i, int16_t* t) {
  constexpr int H = 4 / SPAN;
  for (int s = 0; s < 4 * SPAN; ++s) std::memcpy(t + 8 * s + 2 * H * i, c + 2 * H * s, 4 * H);
}
#endif

static inline void to_span(const int16_t* c, int span, int i, int16_t* t) {
  switch (span) {
    case 1: to_span<1>(c, i, t); break;
    case 2: to_span<2>(c, i, t); break;
    default: to_span<4>(c, i, t); break;
  }
}

// The 8 lanes of a, which hold blocks (0, 2, 4, 6, 1, 3, 5, 7), in block order.
static inline __m256i lanes_in_order(__m256i a) {
  return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A full group's e(s, h) for `bits` (computed once a call) and the placing of a block's codes in the lane layout.
struct LaneElems {
  int e[16][2];
  explicit LaneElems(int bits) {
    for (int st = 0; st < 16; ++st) e[st][0] = lane_elem(bits, st, 0), e[st][1] = lane_elem(bits, st, 1);
  }
  // Block b's 32 codes in natural order (c) into lane b % 8 of its full group in the row's codes qr.
  void place(const int16_t* c, int64_t b, int16_t* qr) const {
    int16_t* g = qr + (b / 8) * kGroup16 + 2 * (b % 8);
    for (int st = 0; st < 16; ++st) g[st * 16] = c[e[st][0]], g[st * 16 + 1] = c[e[st][1]];
  }
};

// An empty asm on an accumulator: integer adds are associative, and GCC would otherwise rebalance a chain of
// madd-then-add into a tree with every product live at once (spilled to the stack: 2x slower).
static inline void keep_chain(__m256i& v) { __asm__("" : "+x"(v)); }

// rows x K floats -> q (rows, qs) int16 in the lane layout, sa and xsum (rows, ss), zero-padded.
static void quantize_rows16_lanes(const float* x, int64_t rows, int64_t K, int bits, int16_t* q, int64_t qs,
                                  float* sa, float* xsum, int64_t ss) {
  const Lanes16 L = lanes16(K);
  alignas(32) int16_t c[QK];
  const LaneElems lanes(bits);
  const int64_t full = 8 * L.ngl < L.nb ? 8 * L.ngl : L.nb;  // blocks in full (or padded) groups
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* qr = q + r * qs;
    std::memset(qr, 0, L.wlen * sizeof(int16_t));  // padding blocks
    for (int64_t b = 0; b < L.nb; ++b) {
      quantize_block16(x + r * K + b * QK, c, sa + r * ss + b, xsum + r * ss + b);
      if (b < full) {
        lanes.place(c, b, qr);
        continue;
      }
      to_span(c, L.span, static_cast<int>(b - full), qr + L.ngl * kGroup16);
    }
    for (int64_t b = L.nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}

#include "qgemm_a16_widen.h"

// NS steps of R rows (xg: each row's step 0) against C widened columns (wg likewise) into the block sums s.
// Each step's weights are loaded once for the R rows and its activations once for the C columns.
#if QG_VNNI && QG_ZMM
// 512-bit: one vpdpwssd takes two consecutive steps (adjacent in memory, 64 bytes: lanes 0-7 step st, lanes
// 8-15 step st + 1, blocks 0-7 in each half); the halves are added at the end. Integer adds: the block sums
// are the exact ones the 256-bit loop gives. NS is even (16 for a group, 2 * span for a span group).
static inline void keep_chain(__m512i& v) { __asm__("" : "+v"(v)); }

template <int R, int C, int NS>
static inline void lane_steps(const int16_t* const* xg, const int16_t* const* wg, __m256i s[R][C]) {
  static_assert(NS % 2 == 0, "steps come in pairs");
  __m512i z[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) z[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8  // fully: z must stay in registers
  for (int st = 0; st < NS; st += 2) {
    __m512i w[C];
    for (int j = 0; j < C; ++j) {
      w[j] = _mm512_load_si512(wg[j] + st * 16);
      keep_chain(w[j]);  // in a register: GCC would fold the load into each row's multiply (R loads, not 1)
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xg[r] + st * 16);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) z[r][j] = _mm512_dpwssd_epi32(z[r][j], w[j], x);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      s[r][j] = _mm256_add_epi32(_mm512_castsi512_si256(z[r][j]), _mm512_extracti64x4_epi64(z[r][j], 1));
}
#else
// 256-bit: a step a multiply-add into the block sums, VNNI's vpdpwssd (AVX512-VL; 32 registers hold a 4 x 3 tile)
// or AVX2's vpmaddwd + vpaddd (the 512-bit loop's integer sums, in another order: exact).
template <int R, int C, int NS>
static inline void lane_steps(const int16_t* const* xg, const int16_t* const* wg, __m256i s[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) s[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 16  // fully: s must stay in registers
  for (int st = 0; st < NS; ++st) {
    __m256i w[C];
    for (int j = 0; j < C; ++j) {
      w[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg[j] + st * 16));
      keep_chain(w[j]);  // in a register: GCC would fold the load into each row's multiply (R loads, not 1)
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg[r] + st * 16));
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
#if QG_VNNI
        s[r][j] = _mm256_dpwssd_epi32(s[r][j], w[j], x);
#else
        s[r][j] = _mm256_add_epi32(s[r][j], _mm256_madd_epi16(w[j], x));
        keep_chain(s[r][j]);
#endif
      }
    }
  }
}
#endif

// The end of group g (numerics 3): block sums s (lane j = block 8g + j) into the fp32 lanes acc.
template <int R, int C, bool Q4>
static inline void lane_group_end(const QArgs16& a, const Col16* c, int64_t m0, int64_t g, const __m256i s[R][C],
                                  __m256 acc[R][C]) {
  for (int j = 0; j < C; ++j) {
    const __m256 d8 = _mm256_load_ps(c[j].d + 8 * g);
    for (int r = 0; r < R; ++r) {
      const float* sa = a.sa + (m0 + r) * a.ss + 8 * g;
      acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][j]), _mm256_mul_ps(d8, _mm256_loadu_ps(sa)), acc[r][j]);
      if constexpr (Q4)
        acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(c[j].m + 8 * g), _mm256_loadu_ps(a.xsum + (m0 + r) * a.ss + 8 * g),
                                    acc[r][j]);
    }
  }
}

#include "qgemm_a16_tail.h"

// Rows m0 .. m0+R-1 against the C widened columns c (output columns n0 ..).
template <int R, int C, bool Q4>
static inline void micro_lanes(const QArgs16& a, const Lanes16& L, const Col16* c, int64_t m0, int64_t n0) {
  const int16_t* xr[R];
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    xr[r] = a.qa + (m0 + r) * a.qs;
    for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < L.ngl; ++g) {
    const int16_t* xg[R];
    const int16_t* wg[C];
    for (int r = 0; r < R; ++r) xg[r] = xr[r] + g * kGroup16;
    for (int j = 0; j < C; ++j) wg[j] = c[j].w + g * kGroup16;
    __m256i s[R][C];
    lane_steps<R, C, 16>(xg, wg, s);
    lane_group_end<R, C, Q4>(a, c, m0, g, s, acc);
  }
#if QG_VNNI
  switch (L.span) {
    case 1: lane_finish<R, C, Q4, 1>(a, c, L, xr, m0, n0, acc); break;
    case 2: lane_finish<R, C, Q4, 2>(a, c, L, xr, m0, n0, acc); break;
    case 4: lane_finish<R, C, Q4, 4>(a, c, L, xr, m0, n0, acc); break;
    default: lane_finish<R, C, Q4, 0>(a, c, L, xr, m0, n0, acc); break;
  }
#else
  switch (L.span) {
    case 1: span_group<R, C, Q4, 1>(a, c, L, xr, m0, acc); break;
    case 2: span_group<R, C, Q4, 2>(a, c, L, xr, m0, acc); break;
    case 4: span_group<R, C, Q4, 4>(a, c, L, xr, m0, acc); break;
    default: break;
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) store16(a, m0 + r, n0 + j, acc[r][j]);
#endif
}

// The micro-tile. 256-bit (16 ymm): 3 rows x 2 columns keeps the 6 block sums, the 6 fp32 lanes, 2 weight
// vectors and an activation vector in registers; 2 x 4 spilled its fp32 lanes to the stack at every group end and
// ran 6-8% slower at K = 576 on Zen 1 (2-4% at K = 1536; bench/RESULTS.md). VNNI (32 registers) keeps 2 x 4 on
// 512 bits and 4 x 3 on 256 (Zen 4: 1.07-1.12x of 2 x 4 and 3 x 4 at 16-512 rows).
#ifndef QG_A16_ROWS
#define QG_A16_ROWS (QG_VNNI ? (QG_ZMM ? 2 : 4) : 3)
#endif
#ifndef QG_A16_COLS
#define QG_A16_COLS (QG_VNNI ? (QG_ZMM ? 4 : 3) : 2)
#endif
static constexpr int kRowsLanes = QG_A16_ROWS;  // rows a micro-tile
static constexpr int kColsLanes = QG_A16_COLS;  // columns a micro-tile
#ifndef QG_A16_PANEL_KB
#define QG_A16_PANEL_KB 128
#endif
#ifndef QG_A16_ROWBLOCK_KB
#define QG_A16_ROWBLOCK_KB 128
#endif
static constexpr int64_t kPanel16 = QG_A16_PANEL_KB * 1024;        // bytes of widened columns a panel: L2 (512 KB on Zen 3)
static constexpr int64_t kRowBlock16 = QG_A16_ROWBLOCK_KB * 1024;  // bytes of activation codes a row block: L2 beside the panel

// Rows [m0, m1) against the C columns c (output columns from n): the columns' codes stay in L1 while the rows'
// stream from L2.
template <int C, bool Q4>
static inline void cols_rows(const QArgs16& a, const Lanes16& L, const Col16* c, int64_t m0, int64_t m1, int64_t n) {
  int64_t m = m0;
  for (; m + kRowsLanes <= m1; m += kRowsLanes) micro_lanes<kRowsLanes, C, Q4>(a, L, c, m, n);
  if constexpr (kRowsLanes > 2)
    for (; m + 2 <= m1; m += 2) micro_lanes<2, C, Q4>(a, L, c, m, n);
  for (; m < m1; ++m) micro_lanes<1, C, Q4>(a, L, c, m, n);
}

// The calling thread's panel buffer, at least `bytes` (32-byte aligned), kept for its next call: a fresh
// allocation of this size is an mmap and its page faults on every call (~10% of a 32-row decode step).
static char* panel_buffer(int64_t bytes) {
  static thread_local char* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (bytes > cap) {
    std::free(buf);
    cap = (bytes + 4095) / 4096 * 4096;
    buf = static_cast<char*>(std::aligned_alloc(64, static_cast<size_t>(cap)));
  }
  return buf;
}

template <bool Q4>
static void gemm16_lanes(const QArgs16& a, int64_t n0, int64_t n1) {
  const Lanes16 L = lanes16(a.K);
  const int64_t col_bytes = col16_bytes(L, a.ss);
  int64_t nc = kPanel16 / col_bytes / kColsLanes * kColsLanes;
  nc = nc < kColsLanes ? kColsLanes : nc;
  int64_t mc = kRowBlock16 / (2 * L.wlen);  // rows a block: their codes stay in L2 beside the panel
  mc = mc < kRowsLanes ? kRowsLanes : mc / kRowsLanes * kRowsLanes;
  char* panel = panel_buffer(nc * col_bytes + nc * static_cast<int64_t>(sizeof(Col16)));
  Col16* cols = reinterpret_cast<Col16*>(panel + nc * col_bytes);
  for (int64_t j = 0; j < nc; ++j) cols[j] = panel_col(panel + j * col_bytes, L, a.ss);
  for (int64_t n = n0; n < n1; n += nc) {
    const int64_t cn = n + nc < n1 ? nc : n1 - n;
    for (int64_t j = 0; j < cn; ++j) widen_column<Q4>(a, L, n + j, panel + j * col_bytes);
    for (int64_t m0 = 0; m0 < a.M; m0 += mc) {
      const int64_t m1 = m0 + mc < a.M ? m0 + mc : a.M;
      int64_t j = 0;
      for (; j + kColsLanes <= cn; j += kColsLanes) cols_rows<kColsLanes, Q4>(a, L, cols + j, m0, m1, n + j);
      for (; j < cn; ++j) cols_rows<1, Q4>(a, L, cols + j, m0, m1, n + j);
    }
  }
}

// --- Entry points: the pair layout below kLaneRows rows, the lane layout from there; on AVX2, packed 4-bit
// weights (QArgs16::wlanes) below kPackedRows (Q8: kPackedRows8) rows in qgemm_a16_packed.h's row tiles. ---

#if !QG_VNNI
#include "qgemm_a16_packed.h"
#endif

// (Calls on packed codes with few rows go to gemm16_packed from qgemm_core.h's dispatch, packed_tiles.)
static void gemm16(const QArgs16& a, int64_t n0, int64_t n1) {
  if (a.M < kLaneRows) {
    if (a.bits == 4) gemm16_pairs<true>(a, n0, n1);
    else gemm16_pairs<false>(a, n0, n1);
  } else {
    if (a.bits == 4) gemm16_lanes<true>(a, n0, n1);
    else gemm16_lanes<false>(a, n0, n1);
  }
}

// `lanes`: the call has M >= kLaneRows rows (qgemm_core.h decides, as rows may be a part of the call).
static void quantize_rows16(const float* x, int64_t rows, int64_t K, int bits, bool lanes, int16_t* q, int64_t qs,
                            float* sa, float* xsum, int64_t ss) {
  if (lanes) quantize_rows16_lanes(x, rows, K, bits, q, qs, sa, xsum, ss);
  else quantize_rows16_pairs(x, rows, K, bits, q, qs, sa, xsum, ss);
}
