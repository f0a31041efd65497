// Row-wise ops of the CUDA model path whose torch versions are not batch-invariant.
//
// torch's reductions pick their thread layout from the tensor's shape: a mean over the last dim splits each row
// across more threads when there are few rows, so the sum order of one row's RMSNorm changed with the number of
// rows in its step, and with it the row's bits (bench/RESULTS.md, the GPU determinism check). Here one CTA owns
// one row, always with the same 128 threads and the same order, whatever the number of rows.
//
// Kernel: rms_norm_rows<T>, T in {float, half_t, bf16_t} (the model dtype).
//   grid = (rows,), block = KVG_THREADS (128).
//   With delta: x[row] += delta[row] first, in place, rounded to T (x is the residual stream), as torch's
//   x.add_(delta) does. Then out[row] = w * T(x * rsqrt(mean(x^2) + eps)), in fp32, rounded to T at the same two
//   points as workers/models/fused.py::rms_norm_ref.
//   Sum order of mean(x^2), fixed per row: thread t sums elements t, t + 128, t + 256, ... in sequence; each
//   warp folds its lanes with warp_sum's xor tree; thread 0's order over the 4 warp sums is warp 0, 1, 2, 3.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(KVG_THREADS) rms_norm_rows(
    T* __restrict__ out,                  // (rows, H) contiguous
    T* __restrict__ x,                    // (rows, H) contiguous; updated in place when delta is given
    const T* __restrict__ delta,          // (rows, H) contiguous, or nullptr
    const T* __restrict__ w,              // (H,)
    int hidden,                           // H
    float eps)
{
    __shared__ float warp_sums[KVG_NUM_WARPS];
    __shared__ float inv_rms;
    const i64 base = (i64)blockIdx.x * hidden;
    const int warp = threadIdx.x / KVG_WARP, lane = threadIdx.x % KVG_WARP;

    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += KVG_THREADS) {
        T v = x[base + i];
        if (delta != nullptr) {
            v = from_float<T>(to_float(v) + to_float(delta[base + i]));
            x[base + i] = v;
        }
        const float f = to_float(v);
        ss = fmaf(f, f, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
#pragma unroll
        for (int k = 0; k < KVG_NUM_WARPS; ++k) total += warp_sums[k];
        inv_rms = rsqrtf(total / (float)hidden + eps);
    }
    __syncthreads();
    const float r = inv_rms;
    for (int i = threadIdx.x; i < hidden; i += KVG_THREADS) {
        const float h = to_float(from_float<T>(to_float(x[base + i]) * r));
        out[base + i] = from_float<T>(to_float(w[i]) * h);
    }
}
