// The decoder layers of a step in one call: for a single stream of SmolLM2 the Python path ran ~12 module and
// kernel calls a layer (360 a step), ~4 ms of dispatch against ~7 ms of arithmetic. Here the same kernels run in
// the same order with the same arithmetic, called from C++ with the GIL released.
//
// The kernels are the other modules' own: each hands out a table of function pointers (kernel_api.h), bound
// once by `bind` (kernels_cupy/cpu/stack.py), so the stack runs the module path's machine code, with its
// instruction-set choice, and cannot drift from it. (It used to compile their sources again in one unit, with the
// attention's -march=native, which made its GEMMs slower than the module's: kernel_api.h.) This unit is glue only:
// no kernel of its own, built without -march=native.
//
// Every row attends as a decode row (row j of a prompt chunk sees the context up to itself, through the paged
// kernel), and every kernel's result for a row is independent of the other rows of the step, so prefill chunks,
// decodes and verify steps all run here. The Python side (workers/models/decode_stack.py) decides when a step
// may: fp32 activations, a KV cache the kernels read, every projection a block or fp32 linear. It is checked
// against the module path by tests/test_decode_stack.py.
//
// LoRA: a step may carry adapter groups (rows of the flat batch and the adapter they run). After each projection
// the stack calls lora_add (lora_add.h, through the GEMM module's table) with exactly the arguments
// workers/lora/batch.py's module path passes it, so a row's bits are the same on both paths
// (tests/test_lora_stack.py); the adapters' weights are held by reference in a LoraAdapter built once per adapter
// load (workers/models/decode_stack.py caches it).
#include "kernel_api.h"
#include "torch_api.h"

#include <memory>
#include <vector>

namespace decode_stack {

// The kernel modules' tables, set once by bind() before any Stack is built (stack.py's load_stack).
static const kernel_api::Gemm* g_gemm = nullptr;
static const kernel_api::Attention* g_attn = nullptr;
static const kernel_api::Fused* g_fused = nullptr;

// gemm, attention, fused: the `api()` capsules of kvgate_cpu_qgemm, kvgate_cpu_paged_decode, kvgate_cpu_fused_ops.
// All three checked before any is set: a wrong capsule changes nothing.
void bind(const pybind11::capsule& gemm, const pybind11::capsule& attention, const pybind11::capsule& fused) {
  const auto* g = kernel_api::import_api<kernel_api::Gemm>(gemm, kernel_api::kGemmApi);
  const auto* a = kernel_api::import_api<kernel_api::Attention>(attention, kernel_api::kAttentionApi);
  const auto* f = kernel_api::import_api<kernel_api::Fused>(fused, kernel_api::kFusedApi);
  g_gemm = g, g_attn = a, g_fused = f;
}

// One projection: GGUF-style blocks (bits 4 or 8, the qgemm kernel, activations at act_bits 8 or 16) or an fp32
// weight (bits 0, the fixed-order fp32 kernel flinear): the same calls as the module path's BlockLinear and
// DenseLinear, so both give the same bits.
struct Linear {
  int64_t bits = 0, act_bits = 16;
  bool wlanes = false;  // wq packed for the AVX2 A16 kernel (qlinear's wlanes)
  torch::Tensor wq, wd, wm, wmt, bias, dense;  // undefined where the layer has none

  torch::Tensor operator()(const torch::Tensor& x) const {  // (T, in) -> (T, out)
    const c10::optional<torch::Tensor> b = bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
    if (bits == 0) return g_gemm->flinear(x.contiguous(), dense, b);
    const c10::optional<torch::Tensor> m = wm.defined() ? c10::optional<torch::Tensor>(wm) : c10::nullopt;
    const c10::optional<torch::Tensor> mt = wmt.defined() ? c10::optional<torch::Tensor>(wmt) : c10::nullopt;
    return g_gemm->qlinear(x, wq, wd, m, b, bits, mt, act_bits, wlanes);
  }
};

struct Layer {
  torch::Tensor norm1, norm2;  // (H,) fp32
  Linear qkv, o, gate_up, down;
};

// The stack's projections in the order the Python side lists an adapter's weights (per layer qkv, o, gate_up, down).
enum Proj : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kProjs = 4 };

// One adapter's pairs on one projection (workers/lora/adapter.py's LoraProj): a undefined where it targets none.
struct LoraProj {
  torch::Tensor a;               // (n_targets * r, in) fp32, fp16 or bf16: every target's A stacked
  std::vector<torch::Tensor> b;  // per slice (hi - lo, r)
  std::vector<int64_t> cols;     // per slice lo, hi, rlo, rhi (lora_add's s_cols)
};

// An adapter's weights on every layer and projection, by reference (no copies): built once per adapter load so a
// step passes only a handle per group. lora_add checks every shape against the step's x and y at each call.
class LoraAdapter {
 public:
  // a, b, cols: per layer and projection (layer * 4 + Proj): the stacked A (None: not targeted), the slices' B
  // and their (lo, hi, rlo, rhi); scale: lora_alpha / r as the module path passes it.
  LoraAdapter(double scale, const std::vector<c10::optional<torch::Tensor>>& a,
              const std::vector<std::vector<torch::Tensor>>& b, const std::vector<std::vector<int64_t>>& cols)
      : scale_(scale) {
    TORCH_CHECK(a.size() % kProjs == 0 && b.size() == a.size() && cols.size() == a.size(),
                "an A, its B list and its columns for each of the 4 projections of every layer");
    for (size_t i = 0; i < a.size(); ++i) {
      LoraProj p;
      if (a[i].has_value()) p.a = *a[i], p.b = b[i], p.cols = cols[i];
      TORCH_CHECK(p.cols.size() == 4 * p.b.size() && (p.a.defined() || p.b.empty()),
                  "projection ", i, ": (lo, hi, rlo, rhi) for each B, and B only with an A");
      projs_.push_back(std::move(p));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(projs_.size()) / kProjs; }
  double scale() const { return scale_; }
  const LoraProj& proj(size_t layer, Proj j) const { return projs_[layer * kProjs + j]; }

 private:
  double scale_;
  std::vector<LoraProj> projs_;
};

// A step's adapter groups: group g's rows (n_g,) int64 of the flat batch run adapters[g].
struct LoraStep {
  const std::vector<std::shared_ptr<LoraAdapter>>& adapters;
  const std::vector<torch::Tensor>& rows;

  // y (T, out) += every group's delta on projection j of layer l, for x (T, in) its input: lora_add with the
  // groups and slices in the order workers/lora/batch.py assembles them (groups not targeting j left out).
  void add(size_t l, Proj j, const torch::Tensor& x, torch::Tensor& y) const {
    std::vector<torch::Tensor> rs, a, b;
    std::vector<double> scale;
    std::vector<int64_t> s_group, s_cols;
    for (size_t g = 0; g < adapters.size(); ++g) {
      const LoraProj& p = adapters[g]->proj(l, j);
      if (!p.a.defined()) continue;
      s_group.insert(s_group.end(), p.b.size(), static_cast<int64_t>(rs.size()));
      s_cols.insert(s_cols.end(), p.cols.begin(), p.cols.end());
      b.insert(b.end(), p.b.begin(), p.b.end());
      rs.push_back(rows[g]);
      a.push_back(p.a);
      scale.push_back(adapters[g]->scale());
    }
    if (!rs.empty()) g_gemm->lora_add(x.contiguous(), y, rs, a, scale, s_group, s_cols, b);
  }
};

class Stack {
 public:
  // tensors: per layer norm1, norm2, then for qkv, o, gate_up, down in turn: wq, wd, wm, wmt, bias, dense (None
  // where absent); bits: per layer the four projections' widths (0: fp32 `dense`); act_bits: their activation
  // widths (8 or 16; ignored for bits 0); wlanes: whether their wq is packed (qlinear's wlanes).
  Stack(const std::vector<c10::optional<torch::Tensor>>& tensors, const std::vector<int64_t>& bits,
        const std::vector<int64_t>& act_bits, const std::vector<int64_t>& wlanes, int64_t hq, int64_t hkv,
        int64_t head_dim, double eps)
      : hq_(hq), hkv_(hkv), d_(head_dim), eps_(eps) {
    TORCH_CHECK(g_gemm != nullptr && g_attn != nullptr && g_fused != nullptr,
                "bind() the kernel modules' tables before building a Stack");
    TORCH_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0 && head_dim > 0 && head_dim % 2 == 0, "bad head layout");
    TORCH_CHECK(tensors.size() % 26 == 0 && bits.size() * 26 == tensors.size() * 4 && act_bits.size() == bits.size() &&
                    wlanes.size() == bits.size(),
                "26 tensors and 4 widths a layer");
    auto get = [&](size_t i) { return tensors[i].has_value() ? *tensors[i] : torch::Tensor(); };
    for (size_t l = 0; l < tensors.size() / 26; ++l) {
      const size_t t0 = l * 26;
      Layer layer;
      layer.norm1 = get(t0), layer.norm2 = get(t0 + 1);
      Linear* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (size_t j = 0; j < 4; ++j) {
        Linear& lin = *lins[j];
        const size_t b = t0 + 2 + 6 * j;
        lin.bits = bits[l * 4 + j], lin.act_bits = act_bits[l * 4 + j], lin.wlanes = wlanes[l * 4 + j] != 0;
        lin.wq = get(b), lin.wd = get(b + 1), lin.wm = get(b + 2), lin.wmt = get(b + 3), lin.bias = get(b + 4);
        lin.dense = get(b + 5);
        TORCH_CHECK(lin.bits == 0 ? lin.dense.defined() : (lin.wq.defined() && lin.wd.defined()),
                    "layer ", l, " projection ", j, ": weights missing for its width");
      }
      TORCH_CHECK(layer.norm1.defined() && layer.norm2.defined(), "layer ", l, ": norm weights missing");
      layers_.push_back(std::move(layer));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: (T, H) fp32, the residual stream after the embedding, updated in place as the module path does;
  // returns the last layer's MLP output (T, H), which the final norm adds. T rows, each attending as a decode
  // row: block_tables (T, MAXB) int32 its sequence's table, seq_lens (T,) int32 the context it sees (itself included),
  // slots (T,) int64, positions (T,) int64; k_caches/v_caches per layer (NB, BS, Hkv, D) fp32; cos/sin the
  // (max_len, D) rope tables. lora_adapters / lora_rows: the step's adapter groups (empty: no LoRA rows).
  torch::Tensor forward(torch::Tensor x, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens, const torch::Tensor& slots, const torch::Tensor& positions,
                        const torch::Tensor& cos, const torch::Tensor& sin, double scale,
                        const std::vector<std::shared_ptr<LoraAdapter>>& lora_adapters,
                        const std::vector<torch::Tensor>& lora_rows) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: (T, H) fp32");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one K/V cache a layer");
    const int64_t t = x.size(0);
    TORCH_CHECK(block_tables.size(0) == t && seq_lens.numel() == t && slots.numel() == t && positions.numel() == t,
                "one table row, length, slot and position per row of x");
    TORCH_CHECK(lora_adapters.size() == lora_rows.size(), "one rows tensor per LoRA group");
    for (const auto& ad : lora_adapters)
      TORCH_CHECK(ad && ad->num_layers() == num_layers(), "a LoRA adapter must cover the stack's layers");
    const LoraStep lora{lora_adapters, lora_rows};
    torch::Tensor delta;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const c10::optional<torch::Tensor> prev = delta.defined() ? c10::optional<torch::Tensor>(delta) : c10::nullopt;
      torch::Tensor a = attention(l, x, prev, k_caches[l], v_caches[l], block_tables, seq_lens, slots, positions,
                                  cos, sin, scale, lora);  // (T, H)
      delta = mlp(l, x, a, lora);  // x += a inside the norm
    }
    return delta;
  }

 private:
  // Layer l's attention block on x + prev (the previous MLP output, added inside the norm): o_proj's output (T, H).
  // The projections' LoRA deltas go in where the module path's project() adds them: qkv's before the rope.
  torch::Tensor attention(size_t l, torch::Tensor& x, const c10::optional<torch::Tensor>& prev,
                          const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& slots, const torch::Tensor& positions,
                          const torch::Tensor& cos, const torch::Tensor& sin, double scale,
                          const LoraStep& lora) const {
    const Layer& ly = layers_[l];
    const int64_t t = x.size(0), qw = hq_ * d_, kw = hkv_ * d_;
    torch::Tensor h = g_fused->rms_norm(x, prev, ly.norm1, eps_);  // (T, H)
    torch::Tensor qkv = ly.qkv(h);                                 // (T, (Hq + 2 Hkv) D)
    lora.add(l, kQkv, h, qkv);
    g_fused->rope_(qkv, cos, sin, positions, hq_ + hkv_, d_);
    g_attn->write_kv(qkv.narrow(1, qw, kw).view({t, hkv_, d_}), qkv.narrow(1, qw + kw, kw).view({t, hkv_, d_}),
                     k_cache, v_cache, slots);
    torch::Tensor q = qkv.narrow(1, 0, qw).reshape({t, hq_, d_}).contiguous();  // (T, Hq, D)
    torch::Tensor attn =
        g_attn->paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale).view({t, qw});  // (T, Hq D)
    torch::Tensor a = ly.o(attn);  // (T, H)
    lora.add(l, kO, attn, a);
    return a;
  }

  // Layer l's MLP block on x += a (inside the norm, as the module path's rms_norm does): down_proj's output (T, H).
  torch::Tensor mlp(size_t l, torch::Tensor& x, const torch::Tensor& a, const LoraStep& lora) const {
    const Layer& ly = layers_[l];
    torch::Tensor h = g_fused->rms_norm(x, a, ly.norm2, eps_);  // (T, H)
    torch::Tensor gate_up = ly.gate_up(h);                         // (T, 2 I)
    lora.add(l, kGateUp, h, gate_up);
    torch::Tensor act = g_fused->silu_mul(gate_up);  // (T, I)
    torch::Tensor out = ly.down(act);       // (T, H)
    lora.add(l, kDown, act, out);
    return out;
  }

  int64_t hq_, hkv_, d_;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace decode_stack

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind", &decode_stack::bind, "the kernel modules' api() capsules: GEMM, attention, fused ops (once)",
        pybind11::arg("gemm"), pybind11::arg("attention"), pybind11::arg("fused"));
  pybind11::class_<decode_stack::LoraAdapter, std::shared_ptr<decode_stack::LoraAdapter>>(m, "LoraAdapter")
      .def(pybind11::init<double, const std::vector<c10::optional<torch::Tensor>>&,
                          const std::vector<std::vector<torch::Tensor>>&, const std::vector<std::vector<int64_t>>&>())
      .def("num_layers", &decode_stack::LoraAdapter::num_layers);
  pybind11::class_<decode_stack::Stack>(m, "Stack")
      .def(pybind11::init<const std::vector<c10::optional<torch::Tensor>>&, const std::vector<int64_t>&,
                          const std::vector<int64_t>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t,
                          double>())
      .def("num_layers", &decode_stack::Stack::num_layers)
      .def("forward", &decode_stack::Stack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the decoder layers of a step (with its LoRA groups); returns the last MLP output", pybind11::arg("x"),
           pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("block_tables"),
           pybind11::arg("seq_lens"), pybind11::arg("slots"), pybind11::arg("positions"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("scale"),
           pybind11::arg("lora_adapters") = std::vector<std::shared_ptr<decode_stack::LoraAdapter>>(),
           pybind11::arg("lora_rows") = std::vector<torch::Tensor>());
}
