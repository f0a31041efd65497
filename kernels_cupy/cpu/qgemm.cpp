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
torch::Tensor qlinear(torch::Tensor x, torch::Tensor wq, torch::Tensor wd, c10::optional<torch::Tensor> wm,
                      c10::optional<torch::Tensor> bias, int64_t bits) {
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
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be (N,) fp32");
  }
  auto out = torch::empty({M, N}, x.options());
  auto qa = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto sa = torch::empty({M, nb}, x.options());
  auto xs = torch::empty({M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qap = qa.data_ptr<int8_t>();
  float* sap = sa.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    qgemm::quantize_rows(xp + b * K, e - b, K, qap + b * K, sap + b * nb, xsp + b * nb);
  });
  qgemm::QArgs a{M, N, K, bits, qap, sap, xsp, reinterpret_cast<const uint8_t*>(wq.data_ptr()),
                 reinterpret_cast<const uint16_t*>(wd.data_ptr()),
                 bits == 4 ? reinterpret_cast<const uint16_t*>(wm->data_ptr()) : nullptr,
                 bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>()};
  // Split output columns: every thread reads the whole (small) activation block and its own weight rows,
  // so each weight byte is read from memory once per call.
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) { qgemm::gemm(a, b, e); });
  return out;
}

std::string isa() { return qgemm::isa_name(qgemm::isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ W^T with W in 4/8-bit blocks of 32 (CPU)");
  m.def("isa", &isa, "the instruction-set path chosen at run time");
}
