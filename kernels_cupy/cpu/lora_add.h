// A step's LoRA deltas on one projection in one call (workers/lora/batch.py's loop, moved here): for each adapter
// group g (its rows of the flat batch) and each slice s of the projection g's adapter targets,
//   y[rows_g, lo_s:hi_s] += ((x[rows_g] A_g^T)[:, rlo_s:rhi_s] B_s^T) * scale_g
// with the Python loop's arithmetic exactly: both products through fgemm's fixed-order core (flinear's numerics,
// whatever the rows or the split), the scale as one fp32 multiply, the add one fp32 rounding. Groups run on the
// threads side by side (a row is in one group and a group's slices write disjoint columns: no two writers of an
// element), so the Python loop's ~10 small calls a group and projection (13,200 a step at 8 adapters) become one.
// Included by qgemm.cpp after fgemm.h.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

// x (T, in), y (T, out): fp32, contiguous. Per group: rows (n,) int64, a (n_t * r, in), scale. Per slice (in group
// order): its group, columns [lo, hi) of y, columns [rlo, rhi) of the shrink, b (hi - lo, rhi - rlo). a and b are
// fp32, or fp16/bf16 (an adapter saved at 16 bits keeps its width; fgemm widens each weight exactly).
[[maybe_unused]] static void lora_add(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> rows,
                                      std::vector<torch::Tensor> a, std::vector<double> scale,
                                      std::vector<int64_t> s_group, std::vector<int64_t> s_cols,
                                      std::vector<torch::Tensor> b) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() && y.is_contiguous() &&
                  x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32,
              "x (T, in) and y (T, out): contiguous fp32 with one row each");
  const int64_t G = static_cast<int64_t>(rows.size()), S = static_cast<int64_t>(b.size());
  TORCH_CHECK(static_cast<int64_t>(a.size()) == G && static_cast<int64_t>(scale.size()) == G, "one a, scale a group");
  TORCH_CHECK(static_cast<int64_t>(s_group.size()) == S && static_cast<int64_t>(s_cols.size()) == 4 * S,
              "a group and (lo, hi, rlo, rhi) a slice");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(rows[g].scalar_type() == torch::kInt64 && rows[g].is_contiguous() && a[g].is_contiguous() &&
                    fgemm_wtype(a[g].scalar_type()).has_value() && a[g].dim() == 2 && a[g].size(1) == K,
                "group ", g, ": rows int64, a (R, in) contiguous fp32, fp16 or bf16");
    const int64_t* r = rows[g].data_ptr<int64_t>();
    for (int64_t i = 0; i < rows[g].numel(); ++i) TORCH_CHECK(0 <= r[i] && r[i] < T, "row out of range");
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t g = s_group[s], lo = s_cols[4 * s], hi = s_cols[4 * s + 1], rlo = s_cols[4 * s + 2],
                  rhi = s_cols[4 * s + 3];
    TORCH_CHECK(0 <= g && g < G && 0 <= lo && lo < hi && hi <= N && 0 <= rlo && rlo < rhi && rhi <= a[g].size(0),
                "slice ", s, ": bad group or columns");
    TORCH_CHECK(b[s].is_contiguous() && fgemm_wtype(b[s].scalar_type()).has_value() && b[s].dim() == 2 &&
                    b[s].size(0) == hi - lo && b[s].size(1) == rhi - rlo,
                "slice ", s, ": b must be (hi - lo, rhi - rlo) contiguous fp32, fp16 or bf16");
  }
  for (int64_t s = 1; s < S; ++s) TORCH_CHECK(s_group[s - 1] <= s_group[s], "slices must come in group order");
  std::vector<int64_t> first(G + 1, 0);  // slices of group g: [first[g], first[g + 1]) (they come in group order)
  for (int64_t s = 0; s < S; ++s) ++first[s_group[s] + 1];
  for (int64_t g = 0; g < G; ++g) first[g + 1] += first[g];
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> xs, h, hs, d;  // a group's rows of x (n, in), its shrink (n, R), a slice of it, a delta
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = rows[g].numel(), R = a[g].size(0);
      const int64_t* r = rows[g].data_ptr<int64_t>();
      if (n == 0 || first[g] == first[g + 1]) continue;
      xs.resize(n * K), h.resize(n * R);
      for (int64_t i = 0; i < n; ++i) std::copy_n(xp + r[i] * K, K, xs.data() + i * K);  // (n, in): exact copies
      fgemm::gemm(fgemm_args(n, R, K, xs.data(), a[g], nullptr, h.data()), 0, R);
      const float sc = static_cast<float>(scale[g]);  // torch's mul_ by a Python float: the scalar as fp32
      for (int64_t s = first[g]; s < first[g + 1]; ++s) {
        const int64_t lo = s_cols[4 * s], hi = s_cols[4 * s + 1], rlo = s_cols[4 * s + 2], rr = s_cols[4 * s + 3] - rlo;
        hs.resize(n * rr), d.resize(n * (hi - lo));
        for (int64_t i = 0; i < n; ++i) std::copy_n(h.data() + i * R + rlo, rr, hs.data() + i * rr);
        fgemm::gemm(fgemm_args(n, hi - lo, rr, hs.data(), b[s], nullptr, d.data()), 0, hi - lo);
        for (int64_t i = 0; i < n; ++i) {
          float* yr = yp + r[i] * N + lo;
          const float* dr = d.data() + i * (hi - lo);
          for (int64_t j = 0; j < hi - lo; ++j) yr[j] += dr[j] * sc;
        }
      }
    }
  });
}
