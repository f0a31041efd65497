// torch binding of the block-quantized GEMM (qgemm_core.h): the linear layer of `--quantization int8|int4`.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "qgemm_core.h"

static torch::Tensor half_scales(const torch::Tensor& t, int64_t n, int64_t nb, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == nb, name, " must be (N, K/32)");
  TORCH_CHECK(t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kFloat32, name, " must be fp16 or fp32");
  return t.to(torch::kHalf).contiguous();  // no copy when already contiguous fp16
}

// x (M, K) fp32 -> (M, N) fp32 against weights in blocks of 32 (layout in qgemm_core.h).
// wmt: optional (K/32, N) fp16, the 4-bit minimums transposed; with it the SIMD paths add the min terms eight
// columns at a time (qgemm_impl.h, min_terms8): on Zen 3, 9-23% off a 16-row call on one thread, 0-10% on two
// (bench/RESULTS.md, 2026-11-24). Owners keep it beside wm.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor wq, torch::Tensor wd, c10::optional<torch::Tensor> wm,
                      c10::optional<torch::Tensor> bias, int64_t bits, c10::optional<torch::Tensor> wmt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be (M, K) fp32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(wq.is_contiguous() && wq.element_size() == 1 && wq.size(1) == (bits == 4 ? K / 2 : K),
              "wq must be contiguous (N, K/2) or (N, K) bytes");
  // Scales are read as fp16 (the GGUF's own width). fp32 scales (tests) are narrowed here, which is exact for
  // every BlockWeight: quantize() and from_gguf() only make fp16-representable scales.
  wd = half_scales(wd, N, nb, "wd");
  if (bits == 4) {
    TORCH_CHECK(wm.has_value(), "4-bit weights need wm (N, K/32)");
    wm = half_scales(*wm, N, nb, "wm");
  }
  if (wmt.has_value()) {
    TORCH_CHECK(bits == 4, "wmt is for 4-bit weights only");
    TORCH_CHECK(wmt->dim() == 2 && wmt->size(0) == nb && wmt->size(1) == N && wmt->is_contiguous() &&
                    wmt->scalar_type() == torch::kHalf, "wmt must be contiguous (K/32, N) fp16");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be (N,) fp32");
  }
  auto out = torch::empty({M, N}, x.options());
  auto qa = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto sa = torch::empty({M, nb}, x.options());
  auto xs = torch::empty({M, nb}, x.options());
  // 4-bit weights on a SIMD path: activations in block-pair order with sa8 (qgemm_impl.h, quantize_rows_q4).
  const bool pairs = bits == 4 && qgemm::isa() != qgemm::kScalar;
  const int64_t np = nb / 2;
  auto sa8 = torch::empty({pairs ? M * np * 8 : 0}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qap = qa.data_ptr<int8_t>();
  float* sap = sa.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  float* s8p = sa8.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    if (pairs) qgemm::quantize_rows_q4(xp + b * K, e - b, K, qap + b * K, sap + b * nb, xsp + b * nb, s8p + b * np * 8);
    else qgemm::quantize_rows(xp + b * K, e - b, K, qap + b * K, sap + b * nb, xsp + b * nb);
  });
  qgemm::QArgs a{M, N, K, bits, qap, sap, xsp, pairs ? s8p : nullptr, reinterpret_cast<const uint8_t*>(wq.data_ptr()),
                 reinterpret_cast<const uint16_t*>(wd.data_ptr()),
                 bits == 4 ? reinterpret_cast<const uint16_t*>(wm->data_ptr()) : nullptr,
                 wmt.has_value() ? reinterpret_cast<const uint16_t*>(wmt->data_ptr()) : nullptr,
                 bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>()};
  // Split output columns: every thread reads the whole (small) activation block and its own weight rows,
  // so each weight byte is read from memory once per call.
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) { qgemm::gemm(a, b, e); });
  return out;
}

// One weight row (nb blocks) to fp32; m null: Q8_0 codes, else Q4_1 nibbles (GGUF order: low nibbles are
// elements 0..15 of a block, high nibbles 16..31).
static void dequant_row_scalar(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t nb, float* dst) {
  for (int64_t j = 0; j < nb; ++j, dst += 32) {
    const float dj = qgemm::scalar::half_to_float(d[j]);
    if (!m) {
      for (int i = 0; i < 32; ++i) dst[i] = dj * static_cast<float>(static_cast<int8_t>(q[j * 32 + i]));
      continue;
    }
    const float mj = qgemm::scalar::half_to_float(m[j]);
    for (int i = 0; i < 16; ++i) {
      dst[i] = dj * static_cast<float>(q[j * 16 + i] & 0x0F) + mj;
      dst[i + 16] = dj * static_cast<float>(q[j * 16 + i] >> 4) + mj;
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) static void dequant_row_avx2(const uint8_t* q, const uint16_t* d,
                                                                     const uint16_t* m, int64_t nb, float* dst) {
  for (int64_t j = 0; j < nb; ++j, dst += 32) {
    const __m256 dv = _mm256_set1_ps(_cvtsh_ss(d[j]));
    const __m256 mv = _mm256_set1_ps(m ? _cvtsh_ss(m[j]) : 0.f);
    __m128i part[4];  // 4 x 8 codes as the low 8 bytes of each
    if (m) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16));
      const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
      part[0] = lo, part[1] = _mm_srli_si128(lo, 8), part[2] = hi, part[3] = _mm_srli_si128(hi, 8);
      for (int k = 0; k < 4; ++k)
        _mm256_storeu_ps(dst + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k])), dv, mv));
    } else {
      for (int k = 0; k < 4; ++k) {
        part[k] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * 32 + 8 * k));
        _mm256_storeu_ps(dst + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[k])), dv));
      }
    }
  }
}

// The (N, K) fp32 weights the blocks stand for, written into `out` (reused between calls: a fresh tensor of
// megabytes per call would cost page faults). For long prefill chunks, where an fp32 GEMM (torch's BLAS) beats
// the block kernel's int8 arithmetic by more than the de-quantization costs (workers/models/linear.py).
torch::Tensor dequant(torch::Tensor wq, torch::Tensor wd, c10::optional<torch::Tensor> wm, int64_t bits,
                      torch::Tensor out) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t N = wq.size(0), K = wq.size(1) * (bits == 4 ? 2 : 1), nb = K / 32;
  TORCH_CHECK(wq.is_contiguous() && wq.element_size() == 1, "wq must be contiguous bytes");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.scalar_type() == torch::kFloat32 && out.numel() >= N * K,
              "out must be a contiguous 1-D fp32 buffer of at least N * K elements");
  wd = half_scales(wd, N, nb, "wd");
  if (bits == 4) {
    TORCH_CHECK(wm.has_value(), "4-bit weights need wm (N, K/32)");
    wm = half_scales(*wm, N, nb, "wm");
  }
  const uint8_t* q = reinterpret_cast<const uint8_t*>(wq.data_ptr());
  const uint16_t* d = reinterpret_cast<const uint16_t*>(wd.data_ptr());
  const uint16_t* m = bits == 4 ? reinterpret_cast<const uint16_t*>(wm->data_ptr()) : nullptr;
  float* o = out.data_ptr<float>();
  const bool avx2 = qgemm::isa() != qgemm::kScalar;
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const uint16_t* mn = m ? m + n * nb : nullptr;
      if (avx2) dequant_row_avx2(q + n * row_bytes, d + n * nb, mn, nb, o + n * K);
      else dequant_row_scalar(q + n * row_bytes, d + n * nb, mn, nb, o + n * K);
    }
  });
  return out.narrow(0, 0, N * K).view({N, K});
}

std::string isa() { return qgemm::isa_name(qgemm::isa()); }

#ifndef KVGATE_ONE_TU  // decode_stack.cpp includes this file for its functions, not its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ W^T with W in 4/8-bit blocks of 32 (CPU)", py::arg("x"), py::arg("wq"),
        py::arg("wd"), py::arg("wm"), py::arg("bias"), py::arg("bits"), py::arg("wmt") = py::none());
  m.def("dequant", &dequant, "the fp32 weights of 4/8-bit blocks, into a reused buffer (CPU)");
  m.def("isa", &isa, "the instruction-set path chosen at run time");
}
#endif
