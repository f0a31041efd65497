// Batched multi-LoRA for one projection of one step, every adapter group in one launch each (SGMV style):
//   shrink:  h[i, k] = sum_j A_g[k, j] x[row_i, j]                      (fp32, every target's rows of A stacked)
//   expand:  y[row_i, lo:hi] += T((B_s h[i, r_lo:r_hi]) * scale_g)     (PEFT's order, as workers/lora/batch.py)
// where i runs over the step's LoRA rows (gathered), g = the adapter group of row i and s the slices (PEFT modules)
// of g's adapter on this projection. Base rows are not in the gather and are never touched.
//
// Determinism: a row's bits must not depend on what else is in the step. Every output element is summed by a
// fixed chain whose shape depends only on `in` (shrink) or the rank (expand), never on how many rows or groups
// the launch covers: no atomics, no split over rows, one writer per element.
//
// Per-step tables (built by kernels_cupy/lora_cuda.py, the Python side mirrors LORA_REC/LORA_MAX_SLICES):
//   row_map (n, 2) int32: row i's flat row of x/y and its group g.
//   meta (G, LORA_REC) int64, one record a group for this (layer, projection):
//     [0] A's device address ((R, in) fp32, row-major), [1] R (0: the adapter does not target this projection),
//     [2] scale as fp32 bits, [3] number of slices, then LORA_MAX_SLICES x (B's address ((hi-lo, r) fp32),
//     lo, hi, r_lo, r_hi).
//
// Thread/block mapping:
//   lora_shrink: grid (n, ceil(r_cap / KVG_NUM_WARPS)), KVG_THREADS threads. Warp w of CTA (i, c) computes
//     h[i, k] for k = c * KVG_NUM_WARPS + w: lane l sums j = l, l + 32, l + 64, ... in that order (one fp32 FMA
//     chain), then warp_sum's fixed xor tree (offsets 16, 8, 4, 2, 1) adds the 32 lanes; lane 0 stores.
//   lora_expand: grid (n, ceil(out / KVG_THREADS)), KVG_THREADS threads. Thread t of CTA (i, c) owns column
//     o = c * KVG_THREADS + t of row i: it finds the slice of g holding o (slices are disjoint), sums
//     k = 0 .. r-1 in order (one FMA chain), multiplies by the scale, rounds to T and adds to y in fp32.
#include "common.cuh"

#define LORA_MAX_SLICES 3  // q, k, v on qkv_proj: the most PEFT modules one fused projection holds
#define LORA_REC (4 + 5 * LORA_MAX_SLICES)

template <typename T>
__global__ void __launch_bounds__(KVG_THREADS) lora_shrink(
    const T* __restrict__ x,            // (T, in) activations, row-major
    const int* __restrict__ row_map,    // (n, 2) flat row, group
    const i64* __restrict__ meta,       // (G, LORA_REC) group records of this layer and projection
    float* __restrict__ h,              // (n, r_cap) shrink output, fp32
    int in,                             // x's row length (= A's)
    int r_cap)                          // h's row length: the largest R of the step
{
    const int i = blockIdx.x;
    const int warp = threadIdx.x / KVG_WARP, lane = threadIdx.x % KVG_WARP;
    const int k = blockIdx.y * KVG_NUM_WARPS + warp;
    const i64* rec = meta + (i64)row_map[2 * i + 1] * LORA_REC;
    if (k >= (int)rec[1]) return;  // warp-uniform: the whole warp leaves, warp_sum below stays full
    const T* xr = x + (i64)row_map[2 * i] * in;
    const float* ar = reinterpret_cast<const float*>(rec[0]) + (i64)k * in;
    float acc = 0.0f;
    for (int j = lane; j < in; j += KVG_WARP) acc = __fmaf_rn(to_float(xr[j]), ar[j], acc);
    acc = warp_sum(acc);
    if (lane == 0) h[(i64)i * r_cap + k] = acc;
}

template <typename T>
__global__ void __launch_bounds__(KVG_THREADS) lora_expand(
    T* __restrict__ y,                  // (T, out) base projection output, updated in place
    const int* __restrict__ row_map,    // (n, 2) flat row, group
    const i64* __restrict__ meta,       // (G, LORA_REC) group records of this layer and projection
    const float* __restrict__ h,        // (n, r_cap) lora_shrink's output
    int out,                            // y's row length
    int r_cap)                          // h's row length
{
    const int i = blockIdx.x;
    const int o = blockIdx.y * KVG_THREADS + threadIdx.x;
    if (o >= out) return;
    const i64* rec = meta + (i64)row_map[2 * i + 1] * LORA_REC;
    if (rec[1] == 0) return;
    const int n_slices = (int)rec[3];
    for (int s = 0; s < n_slices; ++s) {
        const i64* sl = rec + 4 + 5 * s;
        const int lo = (int)sl[1], hi = (int)sl[2], r_lo = (int)sl[3], r = (int)sl[4] - r_lo;
        if (o < lo || o >= hi) continue;
        const float* br = reinterpret_cast<const float*>(sl[0]) + (i64)(o - lo) * r;
        const float* hr = h + (i64)i * r_cap + r_lo;
        float acc = 0.0f;
        for (int k = 0; k < r; ++k) acc = __fmaf_rn(br[k], hr[k], acc);
        // batch.py: d = (B h) * scale (fp32), y += d.to(y.dtype): d rounded to T, then the add rounded to T.
        // The _rn intrinsics keep the multiply and the add two roundings: for T = float a plain `y + acc * s`
        // would be contracted into one FMA, which the CPU reference does not do.
        const float d = to_float(from_float<T>(__fmul_rn(acc, __int_as_float((int)rec[2]))));
        T* yp = y + (i64)row_map[2 * i] * out + o;
        *yp = from_float<T>(__fadd_rn(to_float(*yp), d));
        return;  // slices are disjoint: no other one holds o
    }
}
