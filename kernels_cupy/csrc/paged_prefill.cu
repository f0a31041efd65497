// Paged prefill attention for chunks whose earlier tokens are already in the cache (chunked prefill,
// prefix-cache hits): query row r of a chunk of qlen tokens sits at absolute position ctx + r, with
// ctx = seq_len - qlen, and sees keys at positions <= ctx + r: full attention over the cached prefix,
// causal inside the chunk. K/V (including the chunk's own, written by reshape_and_cache first) are read
// from the paged cache through the block table. fp32 accumulation, online softmax.
//
// Kernel: paged_prefill<TQ, T, D, BS, QH>: TQ (query and output) and T (KV cache) in {float, half_t, bf16_t},
// D in {32, 64, 128, 256}, BS a power of two, QH = query heads per CTA (a divisor of Hq / Hkv, at most 8 and
// at most 512 / D).
//
// CTA mapping: grid = (Hq / QH, num_prefills, ceil(max_query_len / 4)), block = 4 warps (128 threads).
//   blockIdx.x -> QH query heads sharing one KV head (each K/V tile read serves all of them).
//   blockIdx.y -> prefill sequence first_seq + y (prefills follow the decodes in the batch).
//   blockIdx.z, warp w -> query row r = z * 4 + w of that sequence's chunk. A warp owns a whole row and
//                 runs the same tile loop as decode over keys [0, ctx + r], so no cross-warp merge or
//                 barrier is needed. The 4 warps of a CTA are consecutive rows: they stream the same K/V
//                 tiles nearly in lockstep and L1 serves most of the repeats.
// This is a CUDA-core kernel, not a tensor-core flash-attention: correct for any chunk, fast enough for the
// moderate chunk sizes the scheduler hands out; a tensor-core version is future work.
#include "attend.cuh"

template <typename TQ, typename T, int D, int BS, int QH>
__global__ void __launch_bounds__(KVG_THREADS) paged_prefill(
    TQ* __restrict__ out,                   // (T_total, Hq, D) contiguous
    const TQ* __restrict__ query,           // (T_total, Hq, D) strides (q_stride_t, q_stride_h, 1)
    const T* __restrict__ k_cache,          // (NB, BS, Hkv, D) contiguous, already holding this step's K
    const T* __restrict__ v_cache,          // (NB, BS, Hkv, D) contiguous
    const int* __restrict__ block_tables,   // (B, max_blocks)
    const int* __restrict__ seq_lens,       // (B,) context length after this step (cached + new)
    const int* __restrict__ query_start_loc,// (B + 1,) sequence i owns query rows [qsl[i], qsl[i + 1])
    int first_seq,                          // index of the first prefill sequence (= num_decodes)
    int max_blocks,                         // columns of block_tables
    int num_kv_heads,                       // Hkv
    i64 q_stride_t,                         // query stride between tokens, in elements
    i64 q_stride_h,                         // query stride between heads, in elements
    float scale_log2)                       // softmax scale * log2(e)
{
    constexpr int DPL = D / KVG_WARP;
    __shared__ float q_s[KVG_NUM_WARPS][QH * D];        // (4, QH, D) each warp's scaled query row

    const int num_heads = gridDim.x * QH;
    const int head0 = blockIdx.x * QH;
    const int kv_head = head0 / (num_heads / num_kv_heads);
    const int seq = first_seq + blockIdx.y;
    const int q0 = query_start_loc[seq];
    const int qlen = query_start_loc[seq + 1] - q0;
    const int len = seq_lens[seq];
    const int warp = threadIdx.x / KVG_WARP, lane = threadIdx.x % KVG_WARP;
    const int r = blockIdx.z * KVG_NUM_WARPS + warp;
    if (r >= qlen) return;  // warp-uniform; this kernel has no CTA-wide barrier

    const i64 row = q0 + r;
    for (int i = lane; i < QH * D; i += KVG_WARP) {
        const int h = i / D, d = i % D;
        q_s[warp][i] = to_float(query[row * q_stride_t + (head0 + h) * q_stride_h + d]) * scale_log2;
    }
    __syncwarp();

    const int limit = len - qlen + r + 1;  // keys [0, ctx + r] are visible
    WarpState<D, QH> st;
    init_state(st);
    attend_tiles<T, D, BS, QH>(k_cache, v_cache, block_tables + (i64)seq * max_blocks, kv_head, num_kv_heads,
                               q_s[warp], 0, (limit + KVG_TILE - 1) / KVG_TILE, 1, limit, st);
    finish_warp(st);

#pragma unroll
    for (int h = 0; h < QH; ++h) {
        Vec<TQ, DPL> o;
#pragma unroll
        for (int e = 0; e < DPL; ++e) o.v[e] = from_float<TQ>(st.acc[h][e] / st.l[h]);
        *reinterpret_cast<Vec<TQ, DPL>*>(out + (row * num_heads + head0 + h) * D + lane * DPL) = o;
    }
}
