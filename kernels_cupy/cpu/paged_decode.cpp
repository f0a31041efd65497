// Paged decode attention for the CPU: one query token per sequence, K/V read straight from the paged
// cache through the block table, so each cached K/V row is read exactly once (the torch path gathers the
// blocks into a padded copy first, which triples the memory traffic that bounds decode on a CPU).
//
// Work split: one work item per (sequence n, KV head h), or per (n, h, context chunk) when there are too few
// items to keep the threads busy (a single stream); the G = Hq / Hkv query heads that share the KV head are
// handled together so every K/V row loaded from memory serves all of them (GQA). Items are spread over
// threads with at::parallel_for. Two passes per item: scores, then softmax-weighted V sum; the scores
// buffer (G x L floats) is small next to the K/V it summarises. Chunks are merged by their max and sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float* acc, const float* x, float p, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * x[i];
}

// A K/V row as fp32 times a row scale (*scale): fp32 rows are used in place (scale 1); bf16 rows (a cache
// stored at half the bytes, which is what decode on a CPU is bound by) are widened into `tmp` (bf16 -> fp32
// is a 16-bit shift); int8 rows (kernels_cupy/kv_quant.py: D codes, then the row's fp32 scale) have their
// codes widened into `tmp` and their scale returned, which the caller folds into the score or the softmax
// weight, so a row is de-quantized on the fly in L1 and no de-quantized copy of the context is ever made.
static inline const float* row_f32(const float* src, float*, int64_t, float* scale) {
  *scale = 1.f;
  return src;
}
static inline const float* row_f32(const at::BFloat16* src, float* tmp, int64_t d, float* scale) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(u[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    tmp[i] = f;
  }
  *scale = 1.f;
  return tmp;
}

// int8 codes -> fp32, two paths picked at run time (set_kv_isa; "auto": AVX2 where the CPU has it).
static void codes_scalar(const int8_t* c, float* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(c[i]);
}

__attribute__((target("avx2"))) static void codes_avx2(const int8_t* c, float* out, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {  // 8 codes: sign-extend to int32, convert, store
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  for (; i < d; ++i) out[i] = static_cast<float>(c[i]);
}

using CodesFn = void (*)(const int8_t*, float*, int64_t);
static std::atomic<CodesFn> g_codes{nullptr};

static CodesFn pick_codes(const std::string& isa) {
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (isa == "scalar" || (isa == "auto" && !avx2)) return codes_scalar;
  if (isa == "avx2" || isa == "auto") {
    TORCH_CHECK(avx2, "this CPU has no AVX2");
    return codes_avx2;
  }
  TORCH_CHECK(false, "kv isa must be auto, avx2 or scalar, got ", isa);
}

// Selects the int8 path; returns its name. KVGATE_KV_ISA (auto|avx2|scalar) sets the first choice.
std::string set_kv_isa(const std::string& isa) {
  CodesFn f = pick_codes(isa);
  g_codes.store(f);
  return f == codes_avx2 ? "avx2" : "scalar";
}

static CodesFn codes_fn() {
  CodesFn f = g_codes.load();
  if (f == nullptr) {
    const char* env = std::getenv("KVGATE_KV_ISA");
    f = pick_codes(env != nullptr && *env ? env : "auto");
    g_codes.store(f);
  }
  return f;
}

static inline const float* row_f32(const int8_t* src, float* tmp, int64_t d, float* scale) {
  std::memcpy(scale, src + d, sizeof(float));  // the row's scale follows its d codes (unaligned)
  codes_fn()(src, tmp, d);
  return tmp;
}

// exp(x) for x <= 0 (softmax after the max is subtracted), in plain C so `omp simd` vectorises it for the
// build's instruction set (the build is -march=native): 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p
// Cephes' degree-5 polynomial (relative error ~2e-7, as std::exp's float rounding). Below -87.3 -> 0.
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
  x = std::fmax(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: exact n * hi
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#include "paged_decode_avx2.h"

// One work item's share of a softmax: the G query heads of one KV head over context rows [t0, t1). Leaves
// acc (G, D) = sum_t exp(s_t - m) v_t, and m, l (G) = the rows' max score and sum_t exp(s_t - m), so chunks
// of one sequence merge exactly (flash-decoding's split-K).
template <typename KV>
static void attend_rows(const float* qn, const KV* kp, const KV* vp, const int32_t* bt, int64_t t0, int64_t t1,
                        int64_t BS, int64_t Hkv, int64_t h, int64_t W, int64_t D, int64_t G, float sc,
                        float* scores, float* tmp, float* acc, float* m, float* l) {
#ifdef KVGATE_DECODE_AVX2
  if (codes_fn() == codes_avx2) {  // set_kv_isa("scalar") keeps the portable loops (tests compare the two)
    switch (D) {
      case 16: return avx2dec::attend<KV, 2>(qn, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, sc, scores, acc, m, l);
      case 32: return avx2dec::attend<KV, 4>(qn, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, sc, scores, acc, m, l);
      case 64: return avx2dec::attend<KV, 8>(qn, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, sc, scores, acc, m, l);
      case 128: return avx2dec::attend<KV, 16>(qn, kp, vp, bt, t0, t1, BS, Hkv, h, W, G, sc, scores, acc, m, l);
      default: break;
    }
  }
#endif
  const int64_t L = t1 - t0;
  // Rows walk the block table incrementally: a division by the (run-time) block size per row cost more than
  // the row's arithmetic.
  int64_t blk = t0 / BS, off = t0 % BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = static_cast<int64_t>(bt[blk]) * BS + off;
    if (++off == BS) { off = 0; ++blk; }
    float rs;
    const float* kr = row_f32(kp + (row * Hkv + h) * W, tmp, D, &rs);
    const float s = rs * sc;
    for (int64_t g = 0; g < G; ++g) scores[g * L + (t - t0)] = dot(qn + g * D, kr, D) * s;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;  // not std::fmax: a libm call per element
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) { sg[t] = exp_neg(sg[t] - mx); sum += sg[t]; }
    m[g] = mx;
    l[g] = sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  blk = t0 / BS, off = t0 % BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = static_cast<int64_t>(bt[blk]) * BS + off;
    if (++off == BS) { off = 0; ++blk; }
    float rs;
    const float* vr = row_f32(vp + (row * Hkv + h) * W, tmp, D, &rs);
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, vr, scores[g * L + (t - t0)] * rs, D);
  }
}

// Context chunks per sequence: 1 unless there are fewer (sequence, KV head) items than twice the threads
// (a single stream has Hkv items, 3 for SmolLM2 on 2 threads: one thread would do two thirds of the work);
// never chunks under 64 rows, whose merge would cost more than the balance gains.
static int64_t chunks_per_seq(int64_t items, int64_t max_len) {
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  if (items >= want) return 1;
  return std::max<int64_t>(1, std::min<int64_t>((want + items - 1) / items, max_len / 64));
}

// q:            (N, Hq, D)        fp32, contiguous
// k_cache:      (NB, BS, Hkv, W)  fp32 or bf16 (W = D), or int8 (W = D + 4: codes, then the fp32 scale)
// v_cache:      (NB, BS, Hkv, W)  same dtype and shape as k_cache
// block_tables: (N, MAXB)         int32, physical block ids
// seq_lens:     (N,)              int32, context length of each sequence (>= 1)
// returns       (N, Hq, D)        fp32
template <typename KV>
static void paged_decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), W = k_cache.size(3), MAXB = block_tables.size(1);
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(W == (std::is_same<KV, int8_t>::value ? D + 4 : D), "cache rows do not match the head size");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && Hq % Hkv == 0, "cache shapes or head counts disagree");
  auto bt_c = block_tables.contiguous();
  auto sl_c = seq_lens.contiguous();
  const float* qp = q.data_ptr<float>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int32_t* bt = bt_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  int64_t max_len = 1;
  for (int64_t n = 0; n < N; ++n) max_len = std::max<int64_t>(max_len, sl[n]);
  const int64_t C = chunks_per_seq(N * Hkv, max_len);
  // Per item (n, h, c): acc (G, D), then m (G) and l (G); merged per (n, h) below when C > 1.
  std::vector<float> part(C > 1 ? N * Hkv * C * G * (D + 2) : 0);

  at::parallel_for(0, N * Hkv * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, tmp(D), own(G * (D + 2));
    for (int64_t w = begin; w < end; ++w) {
      const int64_t n = w / (Hkv * C), h = (w / C) % Hkv, c = w % C, L = sl[n];
      const int64_t t0 = L * c / C, t1 = L * (c + 1) / C;
      float* slot = C > 1 ? part.data() + w * G * (D + 2) : own.data();
      scores.resize(G * std::max<int64_t>(t1 - t0, 1));
      if (t1 > t0) {
        attend_rows<KV>(qp + (n * Hq + h * G) * D, kp, vp, bt + n * MAXB, t0, t1, BS, Hkv, h, W, D, G, sc,
                        scores.data(), tmp.data(), slot, slot + G * D, slot + G * D + G);
      } else {  // an empty chunk (a context shorter than C): contributes nothing to the merge
        std::fill(slot, slot + G * D, 0.f);
        std::fill(slot + G * D, slot + G * D + G, -INFINITY);
        std::fill(slot + G * D + G, slot + G * (D + 2), 0.f);
      }
      if (C == 1) {
        float* o = op + (n * Hq + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.f / slot[G * D + G + g];
          for (int64_t i = 0; i < D; ++i) o[g * D + i] = slot[g * D + i] * inv;
        }
      }
    }
  });
  if (C == 1) return;
  for (int64_t nh = 0; nh < N * Hkv; ++nh) {  // merge the chunks: rescale each by exp(m_c - max m)
    const int64_t n = nh / Hkv, h = nh % Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY, lsum = 0.f;
      for (int64_t c = 0; c < C; ++c) mx = std::fmax(mx, part[(nh * C + c) * G * (D + 2) + G * D + g]);
      float* o = op + (n * Hq + h * G + g) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const float* slot = part.data() + (nh * C + c) * G * (D + 2);
        const float m = slot[G * D + g];
        if (m == -INFINITY) continue;
        const float f = std::exp(m - mx);
        lsum += slot[G * D + G + g] * f;
        axpy(o, slot + g * D, f, D);
      }
      const float inv = 1.f / lsum;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "queries must be fp32");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  auto out = torch::empty_like(q);
  if (k_cache.dtype() == torch::kFloat32) {
    paged_decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (k_cache.dtype() == torch::kBFloat16) {
    paged_decode_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (k_cache.dtype() == torch::kInt8) {
    paged_decode_impl<int8_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "KV cache must be fp32, bf16 or int8");
  }
  return out;
}

#include "kv_write.h"  // write_kv: the step's K/V rows into their cache slots, every cache dtype

#ifndef KVGATE_ONE_TU  // decode_stack.cpp includes this file for its functions, not its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "the step's K/V rows into their cache slots: fp32, bf16 or int8 (CPU)");
  m.def("paged_decode", &paged_decode, "paged decode attention over block tables (CPU, fp32 queries)");
  m.def("set_kv_isa", &set_kv_isa, "int8 KV path: auto, avx2 or scalar; returns the one chosen");
}
#endif
