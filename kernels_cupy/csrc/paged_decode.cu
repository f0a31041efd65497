// Paged decode attention: one query token per sequence against its whole cached context, for many sequences
// of different lengths at once, GQA-aware, fp32 accumulation, online softmax.
//
// Kernels (templates; the host instantiates them through NVRTC name expressions, see kernels_cupy/kernels.py):
//   paged_decode<TQ, T, D, BS, QH>        whole context per CTA, writes the output directly
//   paged_decode_split<TQ, T, D, BS, QH>  split-K: context cut into partitions of partition_size tokens, each
//                                         CTA writes its partition's (max, sum, normalised partial output)
//   paged_decode_reduce<TQ, D>            combines the partitions of each (sequence, head) into the output
// TQ (query and output) and T (KV cache) in {float, half_t, bf16_t}: a bf16 cache under an fp32 model keeps
// its fp32 query; D (head_dim) in {32, 64, 128, 256}; BS (block size) a power of two; QH = query heads per
// CTA, a divisor of Hq / Hkv, at most 8 (and at most 512 / D).
//
// CTA mapping: grid = (Hq / QH, num_decodes, num_partitions), block = 4 warps (128 threads).
//   blockIdx.x -> query heads [x * QH, x * QH + QH), which all share KV head (x * QH) / (Hq / Hkv): one CTA
//                 streams that KV head's K/V from HBM once for all QH heads. Decode is bandwidth-bound, so
//                 under GQA this is the difference between reading the cache once or Hq / Hkv times.
//   blockIdx.y -> decode sequence = query row (decodes are the first rows of the batch, one token each).
//   blockIdx.z -> context partition (split-K only). Small batches with long contexts otherwise leave most
//                 SMs idle: Hq / QH * num_decodes CTAs can be fewer than the SM count.
//   warp w     -> tiles w, w + 4, w + 8, ... (16 tokens each) of the CTA's range, with its own online-softmax
//                 state. Warps never wait for each other inside the loop; their states are merged once,
//                 through shared memory, at the end.
#include "attend.cuh"

template <typename TQ, typename T, int D, int BS, int QH, bool SPLIT>
__device__ __forceinline__ void decode_cta(
    TQ* __restrict__ out,                   // (T_total, Hq, D) contiguous; decode rows [0, num_decodes)
    float* __restrict__ tmp_out,            // (num_decodes, Hq, P, D) split only: normalised partial outputs
    float* __restrict__ max_logits,         // (num_decodes, Hq, P) split only: partition max (log2 domain)
    float* __restrict__ exp_sums,           // (num_decodes, Hq, P) split only: partition sum of exp2(s - max)
    const TQ* __restrict__ query,           // (T_total, Hq, D) strides (q_stride_t, q_stride_h, 1)
    const T* __restrict__ k_cache,          // (NB, BS, Hkv, D) contiguous
    const T* __restrict__ v_cache,          // (NB, BS, Hkv, D) contiguous
    const int* __restrict__ block_tables,   // (B, max_blocks)
    const int* __restrict__ seq_lens,       // (B,) context length including this step's token
    int max_blocks,                         // columns of block_tables
    int num_kv_heads,                       // Hkv
    i64 q_stride_t,                         // query stride between tokens, in elements
    i64 q_stride_h,                         // query stride between heads, in elements
    float scale_log2,                       // softmax scale * log2(e)
    int partition_size)                     // tokens per partition, a multiple of 16 (split only)
{
    constexpr int DPL = D / KVG_WARP;
    __shared__ float q_s[QH * D];                        // (QH, D) scaled query
    __shared__ float m_s[KVG_NUM_WARPS][QH];             // per-warp running max
    __shared__ float l_s[KVG_NUM_WARPS][QH];             // per-warp running sum
    __shared__ float o_s[KVG_NUM_WARPS][QH][D];          // per-warp unnormalised output

    const int num_heads = gridDim.x * QH;
    const int head0 = blockIdx.x * QH;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int seq = blockIdx.y;
    const int len = seq_lens[seq];
    const int start = SPLIT ? blockIdx.z * partition_size : 0;
    if (start >= len) return;  // partition past this sequence's end: CTA-uniform, before any barrier
    const int end = SPLIT ? imin(len, start + partition_size) : len;
    const int warp = threadIdx.x / KVG_WARP, lane = threadIdx.x % KVG_WARP;

    for (int i = threadIdx.x; i < QH * D; i += KVG_THREADS) {
        const int h = i / D, d = i % D;
        q_s[i] = to_float(query[seq * q_stride_t + (head0 + h) * q_stride_h + d]) * scale_log2;
    }
    __syncthreads();

    WarpState<D, QH> st;
    init_state(st);
    attend_tiles<T, D, BS, QH>(k_cache, v_cache, block_tables + (i64)seq * max_blocks, kv_head, num_kv_heads, q_s,
                               start / KVG_TILE + warp, (end + KVG_TILE - 1) / KVG_TILE, KVG_NUM_WARPS, end, st);
    finish_warp(st);

#pragma unroll
    for (int h = 0; h < QH; ++h) {
        if (lane == 0) {
            m_s[warp][h] = st.m[h];
            l_s[warp][h] = st.l[h];
        }
#pragma unroll
        for (int e = 0; e < DPL; ++e) o_s[warp][h][lane * DPL + e] = st.acc[h][e];
    }
    __syncthreads();

    // Merge the 4 warp states; thread i owns output element (h, d) = (i / D, i % D). A warp that saw no
    // tile has m = -inf, l = 0, acc = 0 and drops out through exp2(-inf) = 0; warp 0 always saw one.
    for (int i = threadIdx.x; i < QH * D; i += KVG_THREADS) {
        const int h = i / D, d = i % D;
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < KVG_NUM_WARPS; ++w) m = fmaxf(m, m_s[w][h]);
        float l = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < KVG_NUM_WARPS; ++w) {
            const float c = exp2f(m_s[w][h] - m);
            l += l_s[w][h] * c;
            o += o_s[w][h][d] * c;
        }
        if (SPLIT) {
            const i64 idx = ((i64)seq * num_heads + head0 + h) * gridDim.z + blockIdx.z;
            tmp_out[idx * D + d] = o / l;
            if (d == 0) {
                max_logits[idx] = m;
                exp_sums[idx] = l;
            }
        } else {
            out[((i64)seq * num_heads + head0 + h) * D + d] = from_float<TQ>(o / l);
        }
    }
}

template <typename TQ, typename T, int D, int BS, int QH>
__global__ void __launch_bounds__(KVG_THREADS) paged_decode(
    TQ* __restrict__ out,                   // (T_total, Hq, D) contiguous
    const TQ* __restrict__ query,           // (T_total, Hq, D) strides (q_stride_t, q_stride_h, 1)
    const T* __restrict__ k_cache,          // (NB, BS, Hkv, D)
    const T* __restrict__ v_cache,          // (NB, BS, Hkv, D)
    const int* __restrict__ block_tables,   // (B, max_blocks)
    const int* __restrict__ seq_lens,       // (B,)
    int max_blocks,                         // columns of block_tables
    int num_kv_heads,                       // Hkv
    i64 q_stride_t,                         // query stride between tokens, in elements
    i64 q_stride_h,                         // query stride between heads, in elements
    float scale_log2)                       // softmax scale * log2(e)
{
    decode_cta<TQ, T, D, BS, QH, false>(out, nullptr, nullptr, nullptr, query, k_cache, v_cache, block_tables, seq_lens,
                                    max_blocks, num_kv_heads, q_stride_t, q_stride_h, scale_log2, 0);
}

template <typename TQ, typename T, int D, int BS, int QH>
__global__ void __launch_bounds__(KVG_THREADS) paged_decode_split(
    float* __restrict__ tmp_out,            // (num_decodes, Hq, P, D), P = gridDim.z
    float* __restrict__ max_logits,         // (num_decodes, Hq, P)
    float* __restrict__ exp_sums,           // (num_decodes, Hq, P)
    const TQ* __restrict__ query,           // (T_total, Hq, D) strides (q_stride_t, q_stride_h, 1)
    const T* __restrict__ k_cache,          // (NB, BS, Hkv, D)
    const T* __restrict__ v_cache,          // (NB, BS, Hkv, D)
    const int* __restrict__ block_tables,   // (B, max_blocks)
    const int* __restrict__ seq_lens,       // (B,)
    int max_blocks,                         // columns of block_tables
    int num_kv_heads,                       // Hkv
    i64 q_stride_t,                         // query stride between tokens, in elements
    i64 q_stride_h,                         // query stride between heads, in elements
    float scale_log2,                       // softmax scale * log2(e)
    int partition_size)                     // tokens per partition, a multiple of 16
{
    decode_cta<TQ, T, D, BS, QH, true>(nullptr, tmp_out, max_logits, exp_sums, query, k_cache, v_cache, block_tables,
                                   seq_lens, max_blocks, num_kv_heads, q_stride_t, q_stride_h, scale_log2,
                                   partition_size);
}

// grid = (Hq, num_decodes), block = 128 threads; thread d (strided by 128) owns output dim d of one
// (sequence, head). The partition count per sequence is small (context / partition_size), so every thread
// rereads the per-partition max and sum (broadcast loads) instead of staging them in shared memory.
template <typename TQ, int D>
__global__ void __launch_bounds__(KVG_THREADS) paged_decode_reduce(
    TQ* __restrict__ out,                   // (T_total, Hq, D) contiguous; decode rows [0, num_decodes)
    const float* __restrict__ tmp_out,      // (num_decodes, Hq, P, D)
    const float* __restrict__ max_logits,   // (num_decodes, Hq, P)
    const float* __restrict__ exp_sums,     // (num_decodes, Hq, P)
    const int* __restrict__ seq_lens,       // (B,)
    int max_partitions,                     // P: partitions of the longest context (grid.z of the split kernel)
    int partition_size)                     // tokens per partition
{
    const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
    const int parts = (seq_lens[seq] + partition_size - 1) / partition_size;  // >= 1: decodes have len >= 1
    const i64 base = ((i64)seq * num_heads + head) * max_partitions;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float m = neg_inf();
        for (int p = 0; p < parts; ++p) m = fmaxf(m, max_logits[base + p]);
        float l = 0.0f, o = 0.0f;
        for (int p = 0; p < parts; ++p) {
            const float c = exp_sums[base + p] * exp2f(max_logits[base + p] - m);
            l += c;
            o += c * tmp_out[(base + p) * D + d];
        }
        out[((i64)seq * num_heads + head) * D + d] = from_float<TQ>(o / l);
    }
}
