// Block-quantized GEMM for the CPU, torch-free (qgemm.cpp binds it to torch; tests/test_quantization.py runs
// every instruction-set path against the scalar one).
//
// Weights (N, K) in blocks of 32 along K, K % 32 == 0:
//   bits 4 (Q4_1; Q4_0 maps onto it with m = -8 d): wq (N, K/2) u8 codes in GGUF nibble order,
//          wd (N, K/32) fp16 scales, wm (N, K/32) fp16 minimums: w = d * code + m
//   bits 8 (Q8_0):                                   wq (N, K) int8 codes, wd (N, K/32) fp16: w = d * code
// Scales are fp16 as in the GGUF file: a decode step is bound by the bytes it reads, and fp32 scales made a
// Q4_1 block 24 bytes instead of GGUF's 20 (the whole model 111 MB a step instead of 97).
// Activations are quantized per row and block of 32 to int8 (act_bits 8, see qgemm_impl.h) or int16 (act_bits 16,
// the default arithmetic; exact numerics in qgemm_a16.h, scalar reference scalar::quantize_rows16 / gemm16).
//
// Paths, picked once at run time from the CPU's features (KVGATE_QGEMM_ISA=scalar|avx2|vnni|vnni256|vnni512
// narrows it, for tests): AVX-512 VNNI (vpdpbusd on 256-bit vectors), AVX2 + FMA (vpmaddubsw + vpmaddwd), scalar; on top of
// VNNI, where the CPU has AMX-INT8 and Linux grants its tile state, the A16 kernel of calls from kAmxRows rows
// runs on AMX tiles (qgemm_a16_amx.h).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace qgemm {

struct QArgs {
  int64_t M, N, K, bits;
  const int8_t* qa;    // (M, K) activation codes
  const float* sa;     // (M, K/32) activation scales
  const float* xsum;   // (M, K/32) per-block sums of the quantized x (scale * sum of codes)
  const float* sa8;    // required by the SIMD 4-bit paths, else null: (M, K/64, 8) each block pair's scales, 4 copies each,
                       // and qa in pair order (qgemm_impl.h, quantize_rows_q4)
  const uint8_t* wq;   // weight codes, see above
  const uint16_t* wd;  // (N, K/32) fp16 bits
  const uint16_t* wm;  // (N, K/32) fp16 bits, or null (bits 8, or 4-bit weights given by wmt only)
  const uint16_t* wmt; // (K/32, N) fp16 bits, the same minimums transposed, or null. With it the SIMD paths add
                       // the min terms eight columns at a time (qgemm_impl.h, min_terms8)
  const float* bias;   // (N,) or null
  float* out;          // (M, N)
};

// The A16 kernel's arguments (qgemm_a16.h): int16 activations in its pair layout (SIMD) or natural order (scalar).
struct QArgs16 {
  int64_t M, N, K, bits;
  const int16_t* qa;   // (a16_code_rows(M), qs) activation codes; qs >= (K/32 rounded up to 8) * 32
  int64_t qs;          // row stride of qa, in int16
  const float* sa;     // (M, ss) activation scales, ss = K/32 rounded up to 8, zero past K/32
  const float* xsum;   // (M, ss) scale * sum of the block's codes, zero past K/32
  int64_t ss;          // row stride of sa and xsum
  const uint8_t* wq;   // weight codes, see above
  const uint16_t* wd;  // (N, K/32) fp16 bits
  const uint16_t* wm;  // (N, K/32) fp16 bits (bits 4), else null
  const float* bias;   // (N,) or null
  float* out;          // (M, N)
  bool wlanes = false; // wq's full groups of 8 blocks in lane order (pack_lanes_q4 / _q8); packed_codes_ok paths
};

// N rows of row_bytes: each full group of 8 blocks (gb bytes) with its bytes permuted (byte i of a group from
// byte from[i]), the last K/32 % 8 blocks of a row as they are. Done once, when a model's weights are loaded.
static inline void pack_groups(const uint8_t* src, uint8_t* dst, int64_t N, int64_t row_bytes, int64_t gb,
                               const int* from) {
  const int64_t full = row_bytes / gb;
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* s = src + n * row_bytes;
    uint8_t* d = dst + n * row_bytes;
    std::memcpy(d, s, static_cast<size_t>(row_bytes));
    for (int64_t g = 0; g < full; ++g)
      for (int64_t i = 0; i < gb; ++i) d[g * gb + i] = s[g * gb + from[i]];
  }
}

// 4-bit codes (N, K/2) in GGUF order -> the same bytes with each full group of 8 blocks (128 bytes) packed in
// lane order for the AVX2 A16 kernel (QArgs16::wlanes): byte 32 q + 4 j + t of a group is byte 4 q + t of its
// block j (q < 4, j < 8, t < 4), the 32-bit transpose the lane kernel otherwise does on every call
// (qgemm_a16_widen.h).
static inline void pack_lanes_q4(const uint8_t* src, uint8_t* dst, int64_t N, int64_t K) {
  int from[128];
  for (int q = 0; q < 4; ++q)
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) from[32 * q + 4 * j + t] = 16 * j + 4 * q + t;
  pack_groups(src, dst, N, K / 2, 128, from);
}

// 8-bit codes (N, K) likewise, each full group's 256 bytes as the lane layout's 16 steps (qgemm_a16_lanes.h,
// e(s, h) = 4 (s / 2) + 2 h + s % 2 for Q8), so that a step is 16 bytes that sign-extend to its 16 int16 words:
// byte 16 s + 2 j + h of a group is byte e(s, h) of its block j (s < 16, j < 8, h < 2).
static inline void pack_lanes_q8(const int8_t* src, int8_t* dst, int64_t N, int64_t K) {
  int from[256];
  for (int st = 0; st < 16; ++st)
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) from[16 * st + 2 * j + h] = 32 * j + 4 * (st / 2) + 2 * h + st % 2;
  pack_groups(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst), N, K, 256, from);
}

// The A16 activation codes' bound (numerics 1, qgemm_a16.h): 12-bit codes in int16, so that on AMX a Q4 block's
// code c = 16 h + l (l = c & 15, h = c >> 4 a signed byte) meets the weights w and 16 w (both bytes) in one tile
// product of 64 bytes (qgemm_a16_amx.h).
static constexpr float kCodeMax = 2047.0f;

// Row strides of the A16 activation buffers for K (any path and layout: whole groups of 8 blocks).
static inline int64_t a16_code_stride(int64_t K) { return (K / 32 + 7) / 8 * 256; }
// From this many rows the A16 SIMD kernel runs its lane layout (qgemm_a16_lanes.h), below it the pair layout (qgemm_a16.h).
static constexpr int64_t kLaneRows = 4;
#ifndef QG_PACKED_ROWS
#define QG_PACKED_ROWS 12
#endif
#ifndef QG_PACKED_ROWS8
#define QG_PACKED_ROWS8 24
#endif
// Below this many rows the AVX2 A16 kernel runs packed weights (QArgs16::wlanes) in row tiles of 3, widening them
// in registers (qgemm_a16_packed.h); from it in the lane kernel's L2 panel, which is faster from there on (Zen 1,
// bench/qgemm16_harness.cpp with the threshold lifted: Q4 packed 1.2x at 6 rows, 1.0x at 12, 0.8-0.9x at 64-512;
// Q8, whose panel widening transposes more, 1.03-1.13x at 16 rows, 1.0x at 32).
static constexpr int64_t kPackedRows = QG_PACKED_ROWS;
static constexpr int64_t kPackedRows8 = QG_PACKED_ROWS8;
static inline bool packed_rows_call(int64_t M, int64_t bits) { return M < (bits == 4 ? kPackedRows : kPackedRows8); }
#ifndef QG_PACKED_ROWS_VNNI
#define QG_PACKED_ROWS_VNNI 5
#endif
// On the VNNI path (without AMX: packed codes are never given to it) the same row tiles run below this many rows,
// Q4 and Q8: Zen 4, one thread in cache, the row tiles against the VNNI pair and lane kernels (GMAC/s, Q4 3072 x 576
// / Q8 960 x 576): 1 row 30 / 23 and 38 / 25, 3 rows 45 / 42 and 43 / 42, 4 rows 41 / 40 and 44 / 40, 8 rows
// 42 / 52 and 45 / 52 (bench/RESULTS.md).
static constexpr int64_t kPackedRowsVnni = QG_PACKED_ROWS_VNNI;
// From this many rows the A16 kernel runs on AMX tiles where amx_on() (below): a part-filled tile costs about
// its rows, and from 4 rows the tiles beat the 512-bit lane loop (M = 8: 1.6-1.75x; bench/RESULTS.md).
static constexpr int64_t kAmxRows = 4;
// Rows of the A16 codes buffer for M rows: whole AMX tiles of 16 (the last tile reads rows past M).
static inline int64_t a16_code_rows(int64_t M) { return (M + 15) / 16 * 16; }
static inline int64_t a16_scale_stride(int64_t K) { return (K / 32 + 7) / 8 * 8; }

enum Isa : int { kScalar = 0, kAvx2 = 1, kVnni = 2 };

namespace scalar {
// IEEE half -> float without F16C (the scalar path must run on any x86-64).
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: renormalise
    exp = 113u;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The largest |x_i| of a block of 32 (both scalar quantizers start here).
static inline float block_amax(const float* v) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  return amax;
}

static void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* scale, float* xsum) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * 32;
      const float amax = block_amax(v);
      const float d = amax / 127.0f, id = d != 0.f ? 1.0f / d : 0.f;
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) {
        const int8_t c = static_cast<int8_t>(std::nearbyint(v[i] * id));
        q[r * K + b * 32 + i] = c;
        s += c;
      }
      scale[r * nb + b] = d;
      xsum[r * nb + b] = d * static_cast<float>(s);
    }
  }
}

// Element i of weight block b of row n: a Q4 nibble (GGUF order: low nibbles are elements 0..15) or a Q8 code.
static inline int weight_code(const uint8_t* wq, int64_t bits, int64_t K, int64_t n, int64_t b, int i) {
  if (bits == 4) {
    const uint8_t byte = wq[n * (K / 2) + b * 16 + (i % 16)];
    return i < 16 ? (byte & 0x0F) : (byte >> 4);
  }
  return static_cast<int8_t>(wq[n * K + b * 32 + i]);
}

static void gemm(const QArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < a.M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        const int8_t* x = a.qa + m * a.K + b * 32;
        for (int i = 0; i < 32; ++i) dot += weight_code(a.wq, a.bits, a.K, n, b, i) * x[i];
        acc += static_cast<float>(dot) * half_to_float(a.wd[n * nb + b]) * a.sa[m * nb + b];
        if (a.bits == 4) acc += half_to_float(a.wmt ? a.wmt[b * a.N + n] : a.wm[n * nb + b]) * a.xsum[m * nb + b];
      }
      a.out[m * a.N + n] = acc + (a.bias ? a.bias[n] : 0.f);
    }
  }
}

// The A16 reference (numerics: qgemm_a16.h), codes in natural order: block b of row r at q + r * qs + 32 b.
static void quantize_rows16(const float* x, int64_t rows, int64_t K, int16_t* q, int64_t qs, float* sa, float* xsum,
                            int64_t ss) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * K + b * 32;
      const float amax = block_amax(v);
      const float s = amax / kCodeMax, id = s != 0.f ? 1.0f / s : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        float t = v[i] * id;
        t = t > -kCodeMax ? t : -kCodeMax;  // maxps then minps, operand for operand: NaN -> -kCodeMax
        t = t < kCodeMax ? t : kCodeMax;
        const int16_t c = static_cast<int16_t>(std::nearbyint(t));  // round to nearest even (default mode)
        q[r * qs + b * 32 + i] = c;
        sum += c;
      }
      sa[r * ss + b] = s;
      xsum[r * ss + b] = s * static_cast<float>(sum);
    }
    for (int64_t b = nb; b < ss; ++b) sa[r * ss + b] = 0.f, xsum[r * ss + b] = 0.f;
  }
}

// The exact integer dot of one weight block with one activation block (numerics 2).
static int32_t block_dot16(const QArgs16& a, int64_t n, int64_t b, const int16_t* x) {
  int32_t dot = 0;
  for (int i = 0; i < 32; ++i) dot += weight_code(a.wq, a.bits, a.K, n, b, i) * x[i];
  return dot;
}

// Eight lanes of blocks, padding blocks applied as +0 terms, the fixed tree, then the bias (numerics 3).
static void gemm16(const QArgs16& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32, ng = (nb + 7) / 8;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < ng; ++g) {
        for (int j = 0; j < 8; ++j) {
          const int64_t b = 8 * g + j;
          const bool real = b < nb;
          const int32_t isum = real ? block_dot16(a, n, b, a.qa + m * a.qs + b * 32) : 0;
          const float d = real ? half_to_float(a.wd[n * nb + b]) : 0.f;
          acc[j] = std::fma(static_cast<float>(isum), d * a.sa[m * a.ss + b], acc[j]);
          if (a.bits == 4) {
            const float mb = real ? half_to_float(a.wm[n * nb + b]) : 0.f;
            acc[j] = std::fma(mb, a.xsum[m * a.ss + b], acc[j]);
          }
        }
      }
      float v = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      if (a.bias) v += a.bias[n];
      a.out[m * a.N + n] = v;
    }
  }
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define QG_VNNI 0
#define QG_ZMM 0
#include "qgemm_impl.h"
#include "qgemm_a16.h"
#include "qgemm_a16_lanes.h"
#undef QG_ZMM
#undef QG_VNNI
}  // namespace avx2
#pragma GCC pop_options

// VNNI twice: the A16 lane kernel's multiplies on 512-bit vectors (vnni) or on 256-bit ones (vnni_ymm), the same
// layouts and bits; vnni_zmm() below picks one per CPU. Everything else is the same code in both.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
#define QG_VNNI 1
#define QG_ZMM 1
#include "qgemm_impl.h"
#include "qgemm_a16.h"
#include "qgemm_a16_lanes.h"
#undef QG_ZMM
#undef QG_VNNI
}  // namespace vnni
namespace vnni_ymm {
#define QG_VNNI 1
#define QG_ZMM 0
#include "qgemm_impl.h"
#include "qgemm_a16.h"
#include "qgemm_a16_lanes.h"
#undef QG_ZMM
#undef QG_VNNI
}  // namespace vnni_ymm
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "qgemm_a16_amx.h"
}  // namespace amx
#pragma GCC pop_options

static Isa detect_isa() {
  __builtin_cpu_init();
  Isa best = kScalar;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = kAvx2;
  if (best == kAvx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    best = kVnni;
  const char* want = std::getenv("KVGATE_QGEMM_ISA");  // can only narrow: never a path the CPU lacks
  if (want && std::strcmp(want, "scalar") == 0) return kScalar;
  if (want && std::strcmp(want, "avx2") == 0 && best >= kAvx2) return kAvx2;
  return best;
}

static Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

// The VNNI path's lane kernel on 512-bit vectors, or on 256-bit ones where those multiply faster: Zen 4 (AMD family
// 0x19, whose AVX-512 parts are Zen 4) issues a 512-bit vpdpwssd at 0.55 a cycle against 2.0 for the 256-bit one
// (independent chains: 18 against 32 int16 multiply-adds a cycle), and there the 512-bit loop ran 0.85-0.95x of
// the 256-bit one's 4 x 3 tile from 4 rows; on an Emerald Rapids neither led throughout (Q8 mostly 512 bits), so
// 512 bits stay the default elsewhere (bench/RESULTS.md). KVGATE_QGEMM_ISA=vnni256 / vnni512 picks one (tests run both).
static bool detect_vnni_zmm() {
  const char* want = std::getenv("KVGATE_QGEMM_ISA");
  if (want && std::strcmp(want, "vnni256") == 0) return false;
  if (want && std::strcmp(want, "vnni512") == 0) return true;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return true;
  const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return true;
  const unsigned base = (eax >> 8) & 0xFu, family = base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
  return family != 0x19u;
}

static bool vnni_zmm() {
  static const bool zmm = detect_vnni_zmm();
  return zmm;
}

// AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), and Linux's permission for the tile data state, asked once
// for the process (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18): without it the first tile
// instruction would kill the process. On top of the VNNI path only (KVGATE_QGEMM_ISA=vnni switches it off).
static bool detect_amx() {
  if (isa() != kVnni) return false;
  const char* want = std::getenv("KVGATE_QGEMM_ISA");
  if (want && std::strncmp(want, "vnni", 4) == 0) return false;  // vnni, vnni256, vnni512
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

static bool amx_on() {
  static const bool on = detect_amx();
  return on;
}

// Whether an A16 call of M rows on packed codes (QArgs16::wlanes) runs the packed row tiles of qgemm_a16_packed.h
// (AVX2 code, on the AVX2 and the VNNI paths alike) or the lane kernel, which widens packed groups.
static bool packed_tiles(int64_t M, int64_t bits) { return isa() == kVnni ? M < kPackedRowsVnni : packed_rows_call(M, bits); }

// Whether packed codes may be given to this process's A16 kernel: its AVX2 or VNNI path, not AMX (whose tiles read
// the GGUF's order) nor the scalar one.
static bool packed_codes_ok() { return isa() >= kAvx2 && !amx_on(); }

static inline const char* isa_name(Isa i) {
  if (i == kVnni) return amx_on() ? "avx512-vnni+amx" : vnni_zmm() ? "avx512-vnni" : "avx512-vnni-ymm";
  return i == kAvx2 ? "avx2" : "scalar";
}

// Activations for the 4-bit SIMD kernels: the same codes as quantize_rows in block-pair order, plus sa8.
static void quantize_rows_q4(const float* x, int64_t rows, int64_t K, int8_t* q, float* s, float* xsum, float* sa8) {
  switch (isa()) {
    case kVnni: vnni::quantize_rows_q4(x, rows, K, q, s, xsum, sa8); break;
    case kAvx2: avx2::quantize_rows_q4(x, rows, K, q, s, xsum, sa8); break;
    default: break;  // the scalar path reads natural order (quantize_rows): callers never get here
  }
}

static void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* q, float* s, float* xsum) {
  switch (isa()) {
    case kVnni: vnni::quantize_rows(x, rows, K, q, s, xsum); break;
    case kAvx2: avx2::quantize_rows(x, rows, K, q, s, xsum); break;
    default: scalar::quantize_rows(x, rows, K, q, s, xsum); break;
  }
}

// Output columns [n0, n1) for all rows; callers split N across threads.
static void gemm(const QArgs& a, int64_t n0, int64_t n1) {
  switch (isa()) {
    case kVnni: vnni::gemm(a, n0, n1); break;
    case kAvx2: avx2::gemm(a, n0, n1); break;
    default: scalar::gemm(a, n0, n1); break;
  }
}

// A16 activations: the pair or lane layout for `bits` on the SIMD paths, natural order on the scalar one (qgemm_a16.h),
// AMX's tiles (qgemm_a16_amx.h). Rows r0 .. r0+rows-1 of a call of M rows (M picks the layout): x, q, sa and xsum
// point at row r0 (the AMX tiles place a row by its index in the call).
// wlanes: the call's weights are packed (QArgs16::wlanes), which only the AVX2 path takes (qlinear checks).
static void quantize_rows16(const float* x, int64_t rows, int64_t r0, int64_t M, int64_t K, int bits, int16_t* q,
                            int64_t qs, float* sa, float* xsum, int64_t ss, bool wlanes = false) {
  const bool lanes = M >= kLaneRows;
  if (wlanes && packed_tiles(M, bits)) return avx2::quantize_rows16_packed(x, rows, K, bits, q, qs, sa, xsum, ss);
  if (M >= kAmxRows && amx_on())
    return amx::quantize_rows16_tiles(x, rows, r0, K, q - r0 * qs, qs, sa, xsum, ss, bits == 4);
  switch (isa()) {
    case kVnni: vnni::quantize_rows16(x, rows, K, bits, lanes, q, qs, sa, xsum, ss); break;
    case kAvx2: avx2::quantize_rows16(x, rows, K, bits, lanes, q, qs, sa, xsum, ss); break;
    default: scalar::quantize_rows16(x, rows, K, q, qs, sa, xsum, ss); break;
  }
}

// A16 output columns [n0, n1) for all rows; callers split N across threads.
static void gemm16(const QArgs16& a, int64_t n0, int64_t n1) {
  if (a.M >= kAmxRows && amx_on()) return amx::gemm16(a, n0, n1);
  if (a.wlanes && packed_tiles(a.M, a.bits)) return avx2::gemm16_packed(a, n0, n1);  // AVX2 code, either path
  switch (isa()) {
    case kVnni: vnni_zmm() ? vnni::gemm16(a, n0, n1) : vnni_ymm::gemm16(a, n0, n1); break;
    case kAvx2: avx2::gemm16(a, n0, n1); break;
    default: scalar::gemm16(a, n0, n1); break;
  }
}

}  // namespace qgemm
