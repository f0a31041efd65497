// torch binding of the block-quantized GEMM (qgemm_core.h): the linear layer of `--quantization int8|int4`.
#include "kernel_api.h"
#include "torch_api.h"

#include "qgemm_core.h"
#include "fgemm.h"
#include "lora_add.h"

static torch::Tensor half_scales(const torch::Tensor& t, int64_t n, int64_t nb, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == nb, name, " must be (N, K/32)");
  TORCH_CHECK(t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kFloat32, name, " must be fp16 or fp32");
  return t.to(torch::kHalf).contiguous();  // no copy when already contiguous fp16
}

// qlinear's A16 half, arguments checked and scales fp16 (qlinear).
static torch::Tensor qlinear16(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wd,
                               const c10::optional<torch::Tensor>& wm, const c10::optional<torch::Tensor>& bias,
                               int64_t bits, bool wlanes) {
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  const int64_t qs = qgemm::a16_code_stride(K), ss = qgemm::a16_scale_stride(K);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;  // a step that samples no row (only partial prefill chunks) has an empty head
  // (M rounded up to whole AMX tiles, qs) codes in qgemm_a16.h's layout (rows past M: any value, never used)
  auto qa = torch::empty({qgemm::a16_code_rows(M), qs}, x.options().dtype(torch::kInt16));
  auto sa = torch::empty({M, ss}, x.options());                        // (M, ss) scales, zero-padded
  auto xs = torch::empty({M, ss}, x.options());                        // (M, ss) scale * sum of codes
  const float* xp = x.data_ptr<float>();
  int16_t* qap = qa.data_ptr<int16_t>();
  float* sap = sa.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    qgemm::quantize_rows16(xp + b * K, e - b, b, M, K, static_cast<int>(bits), qap + b * qs, qs, sap + b * ss,
                           xsp + b * ss, ss, wlanes);
  });
  qgemm::QArgs16 a{M, N, K, bits, qap, qs, sap, xsp, ss, reinterpret_cast<const uint8_t*>(wq.data_ptr()),
                         reinterpret_cast<const uint16_t*>(wd.data_ptr()),
                         bits == 4 ? reinterpret_cast<const uint16_t*>(wm->data_ptr()) : nullptr,
                         bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>()};
  a.wlanes = wlanes;
  // Columns split over threads as in the A8 path; every output's arithmetic is independent of the split.
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) { qgemm::gemm16(a, b, e); });
  return out;
}

// x (M, K) fp32 -> (M, N) fp32 against weights in blocks of 32 (layout in qgemm_core.h).
// wmt: optional (K/32, N) fp16, the 4-bit minimums transposed; with it the SIMD paths add the min terms eight
// columns at a time (qgemm_impl.h, min_terms8): on Zen 3, 9-23% off a 16-row call on one thread, 0-10% on two
// (bench/RESULTS.md, 2026-11-24). Owners keep it beside wm.
// act_bits 16: int16 activations, the A16 kernel (qgemm_a16.h, numerics there); wmt is then not read (the A16
// kernel takes the minimums of eight blocks of a row from wm).
// wlanes: wq is pack_lanes' copy of the codes (qgemm_core.h, pack_lanes_q4 / _q8), for act_bits 16 on the AVX2
// and VNNI paths (qgemm::packed_codes_ok).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor wq, torch::Tensor wd, c10::optional<torch::Tensor> wm,
                      c10::optional<torch::Tensor> bias, int64_t bits, c10::optional<torch::Tensor> wmt,
                      int64_t act_bits = 8, bool wlanes = false) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be (M, K) fp32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits must be 8 or 16");
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
  TORCH_CHECK(!wlanes || (act_bits == 16 && qgemm::packed_codes_ok()),
              "packed weights (wlanes) are for the A16 kernel's AVX2 and VNNI paths; this process runs ",
              qgemm::isa_name(qgemm::isa()));
  if (act_bits == 16) return qlinear16(x, wq, wd, wm, bias, bits, wlanes);
  if (wmt.has_value()) {
    TORCH_CHECK(bits == 4, "wmt is for 4-bit weights only");
    TORCH_CHECK(wmt->dim() == 2 && wmt->size(0) == nb && wmt->size(1) == N && wmt->is_contiguous() &&
                    wmt->scalar_type() == torch::kHalf, "wmt must be contiguous (K/32, N) fp16");
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

// Block codes -> a packed copy for qlinear(..., wlanes=true) (qgemm_core.h, pack_lanes_q4 / pack_lanes_q8):
// 4-bit (N, K/2) uint8 or 8-bit (N, K) int8, as BlockWeight holds them.
torch::Tensor pack_lanes(const torch::Tensor& wq, int64_t K) {
  TORCH_CHECK(K > 0 && K % 32 == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(wq.dim() == 2 && wq.is_contiguous(), "wq must be contiguous (N, K/2) uint8 or (N, K) int8");
  const bool q4 = wq.scalar_type() == torch::kUInt8 && wq.size(1) == K / 2;
  const bool q8 = wq.scalar_type() == torch::kInt8 && wq.size(1) == K;
  TORCH_CHECK(q4 || q8, "wq must be contiguous (N, K/2) uint8 or (N, K) int8");
  auto out = torch::empty_like(wq);
  if (q4) qgemm::pack_lanes_q4(wq.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), wq.size(0), K);
  else qgemm::pack_lanes_q8(wq.data_ptr<int8_t>(), out.data_ptr<int8_t>(), wq.size(0), K);
  return out;
}

std::string isa() { return qgemm::isa_name(qgemm::isa()); }

// The decode stack's way in (qlinear, flinear and lora_add as this module built them): kernel_api.h.
static const kernel_api::Gemm kApiTable{&qlinear, &flinear, &lora_add};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api", [] { return kernel_api::export_api(&kApiTable, kernel_api::kGemmApi); },
        "this module's kernels for the decode stack (kernel_api.h)");
  m.def("qlinear", &qlinear, "x @ W^T with W in 4/8-bit blocks of 32 (CPU)", py::arg("x"), py::arg("wq"),
        py::arg("wd"), py::arg("wm"), py::arg("bias"), py::arg("bits"), py::arg("wmt") = py::none(),
        py::arg("act_bits") = 8, py::arg("wlanes") = false);
  m.def("pack_lanes", &pack_lanes, "block codes packed for qlinear(..., wlanes=True)", py::arg("wq"),
        py::arg("K"));
  m.def("isa", &isa, "the instruction-set path chosen at run time");
  m.def("packed_codes_ok", &qgemm::packed_codes_ok, "whether qlinear takes pack_lanes' codes (wlanes) here");
  m.def("flinear", &flinear, "x @ W^T (+ b) in fp32 with one fixed summation order (CPU)", py::arg("x"),
        py::arg("w"), py::arg("bias") = py::none());
  m.def("fgemm_isa", &fgemm_isa, "the instruction-set path of flinear, chosen at run time");
  m.def("lora_add", &lora_add, "a step's LoRA deltas on one projection, every adapter group in one call (CPU)",
        py::arg("x"), py::arg("y"), py::arg("rows"), py::arg("a"), py::arg("scale"), py::arg("s_group"),
        py::arg("s_cols"), py::arg("b"));
}
