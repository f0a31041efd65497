// Paged decode attention for the CPU: one query token per sequence, K/V read straight from the paged
// cache through the block table, so each cached K/V row is read exactly once (the torch path gathers the
// blocks into a padded copy first, which triples the memory traffic that bounds decode on a CPU).
//
// Work split: one work item per (sequence n, KV head h); the G = Hq / Hkv query heads that share the KV
// head are handled together so every K/V row loaded from memory serves all of them (GQA). Items are
// spread over threads with at::parallel_for. Two passes per item: scores, then softmax-weighted V sum;
// the scores buffer (G x L floats) is small next to the K/V it summarises.
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

  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D), tmp(D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t n = w / Hkv, h = w % Hkv, L = sl[n];
      const float* qn = qp + (n * Hq + h * G) * D;  // the G query heads of KV head h: (G, D)
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = static_cast<int64_t>(bt[n * MAXB + t / BS]) * BS + t % BS;
        float rs;
        const float* kr = row_f32(kp + (row * Hkv + h) * W, tmp.data(), D, &rs);
        const float s = rs * sc;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qn + g * D, kr, D) * s;
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context, max-subtracted
        float* s = scores.data() + g * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = static_cast<int64_t>(bt[n * MAXB + t / BS]) * BS + t % BS;
        float rs;
        const float* vr = row_f32(vp + (row * Hkv + h) * W, tmp.data(), D, &rs);
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, vr, scores[g * L + t] * rs, D);
      }
      std::copy(acc.begin(), acc.end(), op + (n * Hq + h * G) * D);
    }
  });
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over block tables (CPU, fp32 queries)");
  m.def("set_kv_isa", &set_kv_isa, "int8 KV path: auto, avx2 or scalar; returns the one chosen");
}
