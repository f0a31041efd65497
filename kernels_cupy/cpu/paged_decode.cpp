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

#include <algorithm>
#include <cmath>
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

// q:            (N, Hq, D)        fp32, contiguous
// k_cache:      (NB, BS, Hkv, D)  fp32, contiguous
// v_cache:      (NB, BS, Hkv, D)  fp32, contiguous
// block_tables: (N, MAXB)         int32, physical block ids
// seq_lens:     (N,)              int32, context length of each sequence (>= 1)
// returns       (N, Hq, D)        fp32
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), MAXB = block_tables.size(1);
  const int64_t G = Hq / Hkv;
  auto bt_c = block_tables.contiguous();
  auto sl_c = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = bt_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t n = w / Hkv, h = w % Hkv, L = sl[n];
      const float* qn = qp + (n * Hq + h * G) * D;  // the G query heads of KV head h: (G, D)
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = static_cast<int64_t>(bt[n * MAXB + t / BS]) * BS + t % BS;
        const float* kr = kp + (row * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qn + g * D, kr, D) * sc;
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
        const float* vr = vp + (row * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, vr, scores[g * L + t], D);
      }
      std::copy(acc.begin(), acc.end(), op + (n * Hq + h * G) * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over block tables (CPU, fp32)");
}
