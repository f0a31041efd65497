// fp32 linear with one fixed summation order: out (M, N) = x (M, K) @ w (N, K)^T (+ bias (N,)), the linear layer of
// `--quantization none`. torch's F.linear (MKL sgemm) sums each output element in an order that depends on M
// (gemv for one row, blocked kernels for many), so a token's hidden state would depend on what shares its step;
// here every output element is computed by the same sequence of operations whatever M, the tiling, the thread
// count or the thread split, and whatever the instruction-set path.
//
// Numerics, per output element out[m][n] (x = row m of x, w = row n of w):
//   1. eight fp32 lanes a0..a7, all +0;
//   2. for k0 = 0, 8, 16, ... while k0 + 8 <= K: a_j = fma(x[k0 + j], w[k0 + j], a_j) for j = 0..7;
//   3. if K % 8 = r != 0, one more such step over x and w padded with +0 past K: lanes j < r take
//      fma(x[k0 + j], w[k0 + j], a_j), lanes j >= r take fma(+0, +0, a_j) (which only turns a -0 lane into +0);
//   4. s = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7));
//   5. out = s + bias[n] where there is a bias, else s.
// One chain per element: a micro-tile holds 8 to 12 of them at once, which covers the FMA latency.
// Tiling never enters the numerics: micro-tiles of 1-4 rows x 1-8 columns, column blocks, and passes over a long K
// (the 8 lanes stored and reloaded between passes, which rounds nothing) all run steps 1-5 as written.
//
// w stays in nn.Linear's own (N, K) row-major layout (the model holds its weights once, no packed copy). It may
// also be fp16 or bf16 (a LoRA adapter saved at 16 bits keeps its width: half the bytes a step reads): each weight
// is widened to fp32 exactly (F16C / a shift) as it is loaded, so the numerics are steps 1-5 on those fp32
// values, bit for bit what the fp32 copy of the same weights gives.
//
// Paths, picked once at run time (KVGATE_FGEMM_ISA=scalar narrows it, for tests): AVX2 + FMA (also on AVX-512
// machines: same numerics, and 8 lanes are the definition) and a scalar reference emulating the lanes with
// std::fma. Both are bit-identical (the build uses -ffp-contract=off; every fma here is explicit).
// The torch-free core is namespace fgemm; the torch binding (flinear, fgemm_isa) is at the end.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace fgemm {

// Weight storage: fp32, or 16-bit raw bits (IEEE half, bfloat16) read through w16.
enum class WType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

struct Args {
  int64_t M, N, K;
  const float* x;     // (M, K) row-major
  const float* w;     // (N, K) row-major fp32 (wt kF32)
  const float* bias;  // (N,) or null
  float* out;         // (M, N) row-major
  WType wt = WType::kF32;
  const uint16_t* w16 = nullptr;  // (N, K) row-major 16-bit bits (wt kF16 / kBF16)
};

// Exact widening of the 16-bit weights (every fp16 and bf16 value is an fp32 value).
static inline float to_f32(float v) { return v; }
static inline float to_f32(BF16 v) {
  const uint32_t b = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
static inline float to_f32(F16 v) {  // IEEE half -> float, subnormals, infinities and NaN payloads included
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  uint32_t e = (v.bits >> 10) & 0x1fu, m = v.bits & 0x3ffu, b;
  if (e == 0 && m == 0) {
    b = sign;
  } else if (e == 0) {  // subnormal: m * 2^-24, normalised
    e = 113;
    while (!(m & 0x400u)) m <<= 1, --e;
    b = sign | (e << 23) | ((m & 0x3ffu) << 13);
  } else if (e == 31) {
    b = sign | 0x7f800000u | (m << 13);
  } else {
    b = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

enum Isa : int { kScalar = 0, kAvx2 = 1 };

// Columns a thread's share is rounded to: a multiple of every micro-tile width below (3, 4, 6, 8), so a split
// between threads never leaves a narrow remainder tile in the middle of N.
static constexpr int64_t kColGroup = 24;

namespace scalar {
// The reference: steps 1-5 above, one element at a time.
template <typename W>
static inline float dot(const float* x, const W* w, int64_t K) {
  float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8)
    for (int j = 0; j < 8; ++j) a[j] = std::fma(x[k0 + j], to_f32(w[k0 + j]), a[j]);
  if (k0 < K) {
    for (int j = 0; j < 8; ++j) {
      const bool in = k0 + j < K;
      a[j] = std::fma(in ? x[k0 + j] : 0.f, in ? to_f32(w[k0 + j]) : 0.f, a[j]);
    }
  }
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Output columns [n0, n1) for all rows.
template <typename W>
static void gemm(const Args& a, const W* w, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      const float s = dot(a.x + m * a.K, w + n * a.K, a.K);
      a.out[m * a.N + n] = a.bias ? s + a.bias[n] : s;
    }
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// Lanes j < r all ones: _mm256_maskload_ps then reads x/w[k0 + j] there and +0 elsewhere (step 3), without
// touching memory past K.
static inline __m256i tail_mask(int64_t r) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Step 4's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a0+a4, a1+a5, a2+a6, a3+a7
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // (a0+a4)+(a2+a6), (a1+a5)+(a3+a7)
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One 8-wide step of an R x C micro-tile at offset k of each row (kTail: the masked loads of step 3). The
// smaller side's vectors are loaded once and held, the other side's loaded once each and used by its R or C
// FMAs: R + C loads for R * C FMAs, and the accumulators plus operands fit the 16 ymm registers.
template <bool kTail>
static inline __attribute__((always_inline)) __m256 load8(const float* p, __m256i mask) {
  return kTail ? _mm256_maskload_ps(p, mask) : _mm256_loadu_ps(p);
}

// 16-bit weights: eight of them widened exactly; the tail copies the lanes the mask keeps into zeroed bits (+0).
static inline __attribute__((always_inline)) __m128i load8_bits(const uint16_t* p, __m256i mask, bool tail) {
  if (!tail) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(t, p, sizeof(uint16_t) * __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(mask))));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
}

template <bool kTail>
static inline __attribute__((always_inline)) __m256 load8(const F16* p, __m256i mask) {
  return _mm256_cvtph_ps(load8_bits(reinterpret_cast<const uint16_t*>(p), mask, kTail));
}

template <bool kTail>
static inline __attribute__((always_inline)) __m256 load8(const BF16* p, __m256i mask) {
  const __m256i wide = _mm256_cvtepu16_epi32(load8_bits(reinterpret_cast<const uint16_t*>(p), mask, kTail));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <int R, int C, bool kTail, typename W>
static inline __attribute__((always_inline)) void step(__m256 (&acc)[R][C], const float* x, const W* w, int64_t K,
                                                        int64_t k, __m256i mask) {
  if constexpr (C <= R) {  // hold the weights, stream the rows
    __m256 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = load8<kTail>(w + c * K + k, mask);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = load8<kTail>(x + r * K + k, mask);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  } else {  // hold the rows, stream the weights
    __m256 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = load8<kTail>(x + r * K + k, mask);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wv = load8<kTail>(w + c * K + k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
}

// Where a micro-tile writes: its R x C outputs (row stride ldo) after the last pass over K, else its R * C
// 8-lane accumulators (stash) for the next pass.
struct Dest {
  const float* bias;  // (C,) or null
  float* out;
  int64_t ldo;
  float* stash;       // R * C * 8 floats
};

// One pass of a micro-tile, rows x + r K against weight rows w + c K (r < R, c < C), over k in [k0, k1): k1 is
// K on the last pass, else a multiple of 8. The accumulators start at +0 on the first pass and are carried
// between passes through d.stash: a store and a load round nothing, so the passes sum exactly as one does.
template <int R, int C, typename W>
static void tile(const float* x, const W* w, int64_t K, int64_t k0, int64_t k1, const Dest& d) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(d.stash + (r * C + c) * 8);
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) step<R, C, false, W>(acc, x, w, K, k, __m256i{});
  if (k < k1) step<R, C, true, W>(acc, x, w, K, k, tail_mask(k1 - k));  // step 3: the K tail, padded with +0
  if (k1 < K) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) _mm256_store_ps(d.stash + (r * C + c) * 8, acc[r][c]);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = hsum(acc[r][c]);
      d.out[r * d.ldo + c] = d.bias ? s + d.bias[c] : s;
    }
}

// Micro-tile width for R rows: 12 accumulators (4x3, 3x4, 2x6), or 8 for a single row (a gemv: bound by the
// weight bytes, not the FMAs).
template <int R>
struct Width {
  static constexpr int C = R == 4 ? 3 : R == 3 ? 4 : R == 2 ? 6 : 8;
};

// The last `rem` (< C) columns of a row block: tile<R, rem>.
template <int R, int C, typename W>
static void tail_tile(int64_t rem, const float* x, const W* w, int64_t K, int64_t k0, int64_t k1, const Dest& d) {
  if constexpr (C > 1) {
    if (rem == C - 1) tile<R, C - 1, W>(x, w, K, k0, k1, d);
    else tail_tile<R, C - 1, W>(rem, x, w, K, k0, k1, d);
  }
}

// One pass over k in [k0, k1) of rows [m, m + R) against columns [n0, n1): the row block's x (R x (k1 - k0))
// stays in L1 while the columns go by. stash: (n1 - n0) * R * 8 floats, 32-byte aligned.
template <int R, typename W>
static void row_block(const Args& a, const W* w, int64_t m, int64_t n0, int64_t n1, int64_t k0, int64_t k1,
                      float* stash) {
  constexpr int C = Width<R>::C;
  const int64_t K = a.K;
  const float* x = a.x + m * K;
  for (int64_t n = n0; n < n1; n += C) {
    const Dest d{a.bias ? a.bias + n : nullptr, a.out + m * a.N + n, a.N, stash + (n - n0) * R * 8};
    if (n + C <= n1) tile<R, C, W>(x, w + n * K, K, k0, k1, d);
    else tail_tile<R, C, W>(n1 - n, x, w + n * K, K, k0, k1, d);
  }
}

template <int R, typename W>
static void row_block_passes(const Args& a, const W* w, int64_t m, int64_t n0, int64_t n1, int64_t kc,
                             float* stash) {
  int64_t k0 = 0;
  do {  // at least one pass: K = 0 still writes its outputs (+0, then the bias)
    const int64_t k1 = k0 + kc < a.K ? k0 + kc : a.K;
    row_block<R, W>(a, w, m, n0, n1, k0, k1, stash);
    k0 = k1;
  } while (k0 < a.K);
}

// Output columns [n0, n1) for all rows. Column blocks of nb keep their weights (nb x K) in L2 while every row
// block of x walks them, so each weight is read from memory once per call. Where K is long, each row block
// goes over K in passes of kKC so that its x (4 x kKC) stays in L1 beside the weight rows streaming by.
template <typename W>
static void gemm(const Args& a, const W* w, int64_t n0, int64_t n1) {
  constexpr int64_t kL2Bytes = 256 * 1024;  // half of Zen 3's L2: room for the x row blocks and the output
  constexpr int64_t kKC = 512;              // a multiple of 8
  constexpr int64_t kMaxNb = kL2Bytes / (4 * kKC) / kColGroup * kColGroup;
  alignas(32) float stash[kMaxNb * 4 * 8];  // (nb, 4 rows, 8 lanes) at most: 15 KiB
  const int64_t kc = a.K > kKC ? kKC : a.K;
  int64_t nb = kL2Bytes / (4 * (a.K > 0 ? a.K : 1)) / kColGroup * kColGroup;
  if (nb < kColGroup) nb = kColGroup;
  if (kc < a.K && nb > kMaxNb) nb = kMaxNb;  // only passes use the stash
  for (int64_t b = n0; b < n1; b += nb) {
    const int64_t e = b + nb < n1 ? b + nb : n1;
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) row_block_passes<4, W>(a, w, m, b, e, kc, stash);
    switch (a.M - m) {
      case 3: row_block_passes<3, W>(a, w, m, b, e, kc, stash); break;
      case 2: row_block_passes<2, W>(a, w, m, b, e, kc, stash); break;
      case 1: row_block_passes<1, W>(a, w, m, b, e, kc, stash); break;
      default: break;
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

static Isa detect_isa() {
  __builtin_cpu_init();
  // F16C (the 16-bit weights' widening) came with AVX2 on every x86 CPU, as qgemm_core.h also takes it.
  const Isa best = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? kAvx2 : kScalar;
  const char* want = std::getenv("KVGATE_FGEMM_ISA");  // can only narrow: never a path the CPU lacks
  if (want && std::strcmp(want, "scalar") == 0) return kScalar;
  return best;
}

static Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

static inline const char* isa_name(Isa i) { return i == kAvx2 ? "avx2" : "scalar"; }

// Output columns [n0, n1) for all rows; callers split N across threads (any split gives the same bits).
template <typename W>
static void gemm_as(const Args& a, const W* w, int64_t n0, int64_t n1) {
  if (isa() == kAvx2) avx2::gemm<W>(a, w, n0, n1);
  else scalar::gemm<W>(a, w, n0, n1);
}

static void gemm(const Args& a, int64_t n0, int64_t n1) {
  switch (a.wt) {
    case WType::kF16: gemm_as(a, reinterpret_cast<const F16*>(a.w16), n0, n1); break;
    case WType::kBF16: gemm_as(a, reinterpret_cast<const BF16*>(a.w16), n0, n1); break;
    default: gemm_as(a, a.w, n0, n1); break;
  }
}

}  // namespace fgemm

#ifndef FGEMM_CORE_ONLY  // the torch binding; define FGEMM_CORE_ONLY for the core alone
#include "torch_api.h"

#include <string>

// The core's weight type of a tensor dtype: fp32, fp16 or bf16 (nullopt: not a weight dtype the core reads).
[[maybe_unused]] static c10::optional<fgemm::WType> fgemm_wtype(c10::ScalarType t) {
  if (t == torch::kFloat32) return fgemm::WType::kF32;
  if (t == torch::kFloat16) return fgemm::WType::kF16;
  if (t == torch::kBFloat16) return fgemm::WType::kBF16;
  return c10::nullopt;
}

// Args for out (M, N) = x (M, K) @ w^T with w a contiguous (N, K) tensor of a dtype fgemm_wtype accepts.
[[maybe_unused]] static fgemm::Args fgemm_args(int64_t M, int64_t N, int64_t K, const float* x, const torch::Tensor& w,
                                               const float* bias, float* out) {
  const fgemm::WType wt = *fgemm_wtype(w.scalar_type());
  if (wt == fgemm::WType::kF32) return fgemm::Args{M, N, K, x, w.data_ptr<float>(), bias, out};
  return fgemm::Args{M, N, K, x, nullptr, bias, out, wt, reinterpret_cast<const uint16_t*>(w.data_ptr())};
}

// x (M, K) fp32 -> (M, N) fp32 against w (N, K) fp32, fp16 or bf16 (+ bias (N,)), in the fixed order described at the
// top (16-bit weights widened exactly).
// [[maybe_unused]]: decode_stack.cpp includes this through qgemm.cpp without its module block.
[[maybe_unused]] static torch::Tensor flinear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "flinear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous (M, K) fp32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && fgemm_wtype(w.scalar_type()).has_value(),
              "w must be contiguous (N, K) fp32, fp16 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w must be (N, K) with x's K = ", K, ", got ", w.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->numel() == N &&
                    bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "bias must be contiguous (N,) fp32");
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const fgemm::Args a = fgemm_args(M, N, K, x.data_ptr<float>(), w, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                   out.data_ptr<float>());
  // Split columns in groups of kColGroup: each thread reads the whole x and its own weight rows. The grain keeps
  // a thread's share at >= ~64k multiply-adds, below which starting threads costs more than it saves.
  const int64_t groups = (N + fgemm::kColGroup - 1) / fgemm::kColGroup;
  const int64_t per_group = fgemm::kColGroup * M * (K > 0 ? K : 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_group);
  at::parallel_for(0, groups, grain, [&](int64_t b, int64_t e) {
    fgemm::gemm(a, b * fgemm::kColGroup, std::min(e * fgemm::kColGroup, N));
  });
  return out;
}

[[maybe_unused]] static std::string fgemm_isa() { return fgemm::isa_name(fgemm::isa()); }
#endif  // FGEMM_CORE_ONLY
