// Fused elementwise ops of a decoder layer, fp32, for the CPU: what torch runs as 5-10 small ops each
// (RMSNorm with its residual add, rotary embedding of q and k in place, SiLU(gate) * up) in one pass.
// Each function body is compiled twice by gcc's target_clones, for AVX2 and for the baseline ISA, and the
// loader picks the clone at run time from the CPU's features (an ifunc), so one binary runs everywhere.
// References in torch: workers/models/fused.py; tests/test_fused_ops.py compares the two.
#include "kernel_api.h"
#include "torch_api.h"
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>

#include "simd_exp.h"

#define KV_CLONES __attribute__((target_clones("avx2", "default")))

namespace {

constexpr int kLanes = 8;  // 8 partial sums: vectorizes to one AVX2 register without -ffast-math

KV_CLONES float sum_sq(const float* x, int64_t n) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

KV_CLONES void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);  // same association as the torch reference
}

KV_CLONES void add_row(float* x, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += d[i];
}

KV_CLONES void rope_head(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// SiLU(g) * up; the AVX2 row below uses the vectorised exp (simd_exp.h): with libm's expf a 16-row decode
// step's SiLU (16 x 1536 elements) cost 0.34 ms a layer.
void silu_mul_row_scalar(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = kvgate_simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));  // exp(-g)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  silu_mul_row_scalar(g + i, u + i, out + i, n - i);
}

using SiluFn = void (*)(const float*, const float*, float*, int64_t);

SiluFn silu_fn() {  // picked once from the CPU's features; KVGATE_FUSED_ISA=scalar keeps libm (tests compare)
  static const SiluFn f = [] {
    __builtin_cpu_init();
    const char* want = std::getenv("KVGATE_FUSED_ISA");
    const bool scalar = want != nullptr && std::strcmp(want, "scalar") == 0;
    return !scalar && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? silu_mul_row_avx2
                                                                                     : silu_mul_row_scalar;
  }();
  return f;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1, name,
              ": fp32 (T, N) with contiguous rows expected");
}

}  // namespace

// out = w * x * rsqrt(mean(x^2) + eps) per row; with `delta`, x += delta first (in place: the residual).
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  check_rows(x, "x");
  const int64_t t = x.size(0), n = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.numel() == n && w.dtype() == torch::kFloat32, "w: fp32 (N,)");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == t && delta->size(1) == n, "delta: same shape as x");
  }
  auto out = torch::empty({t, n}, x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), ds = delta ? delta->stride(0) : 0;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = xp + r * xs;
      if (dp) add_row(row, dp + r * ds, n);
      float inv = 1.f / std::sqrt(sum_sq(row, n) / n + static_cast<float>(eps));
      scale_row(row, wp, inv, op + r * n, n);
    }
  });
  return out;
}

// Rotary embedding (the rotate-half form) of the first `heads` heads of each row of `qkv`, in place.
// cos/sin: the (max_len, D) tables built once at load; positions: (T,) int64.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, int64_t heads,
           int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim, "cos/sin: (L, D)");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.numel() == qkv.size(0), "positions: (T,)");
  TORCH_CHECK(heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "heads * head_dim exceeds the row");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t t = qkv.size(0), rs = qkv.stride(0), len = cos.size(0);
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(pp[r] >= 0 && pp[r] < len, "position out of the rope table");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t h = 0; h < heads; ++h)
        rope_head(xp + r * rs + h * head_dim, cp + pp[r] * head_dim, sp + pp[r] * head_dim, head_dim / 2);
  });
}

// (T, 2I) [gate | up] -> (T, I) silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), i2 = gate_up.size(1), inter = i2 / 2;
  TORCH_CHECK(i2 % 2 == 0, "gate_up: an even number of columns");
  auto out = torch::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rs = gate_up.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    const SiluFn f = silu_fn();
    for (int64_t r = b; r < e; ++r) f(gp + r * rs, gp + r * rs + inter, op + r * inter, inter);
  });
  return out;
}

// The index of the first maximum of x[0..n), torch.argmax's answer: the first NaN where there is one (NaN
// ranks above everything), else the first element equal to the maximum (-0 and +0 are equal, as for torch's
// `>`). Max and equality are exact, so the lane order changes nothing.
__attribute__((target("avx2"))) static int64_t argmax_avx2(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float m8[8];
  _mm256_store_ps(m8, mx);
  float m = m8[0];
  for (int l = 1; l < 8; ++l) m = m8[l] > m ? m8[l] : m;
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // n == 0 never reaches here (argmax_rows refuses it)
}

static int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

// (S, V) fp32 -> (S,) int64: torch.argmax(x, dim=-1), bit for bit, each row on one thread. torch's reduction
// took ~1 ms for 32 rows of SmolLM2's 49,152 logits on 2 threads, ~3% of a decode step.
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "logits");
  TORCH_CHECK(x.size(1) > 0, "logits: at least one column");
  const int64_t s = x.size(0), v = x.size(1), rs = x.stride(0);
  auto out = torch::empty({s}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx2 = __builtin_cpu_supports("avx2");
  at::parallel_for(0, s, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = avx2 ? argmax_avx2(xp + r * rs, v) : argmax_scalar(xp + r * rs, v);
  });
  return out;
}

// The decode stack's way in (rms_norm, rope_ and silu_mul as this module built them): kernel_api.h.
static const kernel_api::Fused kApiTable{&rms_norm, &rope_, &silu_mul};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api", [] { return kernel_api::export_api(&kApiTable, kernel_api::kFusedApi); },
        "this module's kernels for the decode stack (kernel_api.h)");
  m.def("rms_norm", &rms_norm, "RMSNorm of x (after x += delta, in place, where given)");
  m.def("rope_", &rope_, "rotary embedding of the first heads of each row, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of (S, V) fp32 rows");
}
