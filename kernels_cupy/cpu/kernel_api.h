// The kernels the decode stack (decode_stack.cpp) calls, as tables of function pointers that each kernel module
// hands out in a capsule (its `api()`), so the stack runs the very machine code the module path runs.
//
// Why not compile the kernels' sources into the stack again: that unit needed the attention's -march=native, and
// the GEMMs built that way ran slower than the GEMM module's own build (GCC 12 on a Zen 4: 25-40% with the CPU's
// tuning, up to 5% with generic tuning: bench/build_tuning.py); a second copy also had its own dispatch state (the
// attention module's set_kv_isa did not reach the stack's copy) and took most of a minute to compile. Through
// these tables a row's bits are the module path's by construction, and a kernel's dispatch state has one owner.
//
// Each table is a plain struct of pointers to the functions with the signatures below; a capsule is named after
// its table (kGemmApi, ...) so the stack refuses one from the wrong module. The modules are loaded once and never
// unloaded (Python extension modules), so the pointers stay valid for the process.
#pragma once

#include "torch_api.h"

#include <string>
#include <vector>

namespace kernel_api {

// kvgate_cpu_qgemm (qgemm.cpp): the block-quantized and fixed-order fp32 linears, and the LoRA deltas.
struct Gemm {
  torch::Tensor (*qlinear)(torch::Tensor x, torch::Tensor wq, torch::Tensor wd, c10::optional<torch::Tensor> wm,
                           c10::optional<torch::Tensor> bias, int64_t bits, c10::optional<torch::Tensor> wmt,
                           int64_t act_bits, bool wlanes);
  torch::Tensor (*flinear)(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
  void (*lora_add)(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> rows, std::vector<torch::Tensor> a,
                   std::vector<double> scale, std::vector<int64_t> s_group, std::vector<int64_t> s_cols,
                   std::vector<torch::Tensor> b);
};

// kvgate_cpu_paged_decode (paged_decode.cpp): the step's K/V rows into the cache, and attention over it.
struct Attention {
  void (*write_kv)(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots);
  torch::Tensor (*paged_decode)(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
};

// kvgate_cpu_fused_ops (fused_ops.cpp): the layer's small row-wise ops.
struct Fused {
  torch::Tensor (*rms_norm)(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps);
  void (*rope_)(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, int64_t heads,
                int64_t head_dim);
  torch::Tensor (*silu_mul)(torch::Tensor gate_up);
};

constexpr const char* kGemmApi = "kvgate.kernel_api.Gemm";
constexpr const char* kAttentionApi = "kvgate.kernel_api.Attention";
constexpr const char* kFusedApi = "kvgate.kernel_api.Fused";

// A module's table as a capsule (the table is a static of that module).
template <typename T>
pybind11::capsule export_api(const T* table, const char* name) {
  return pybind11::capsule(static_cast<const void*>(table), name);
}

// The table a capsule holds, checked to be the one named.
template <typename T>
const T* import_api(const pybind11::capsule& c, const char* name) {
  TORCH_CHECK(c.name() != nullptr && std::string(c.name()) == name, "expected a ", name, " capsule, got ",
              c.name() != nullptr ? c.name() : "an unnamed one");
  return c.get_pointer<const T>();
}

}  // namespace kernel_api
