// The warp-level inner loop shared by decode and prefill: score key tiles of one sequence against QH query
// heads and fold them into a running (online-softmax) state, reading K/V through the block table.
//
// Scores live in the log2 domain: the query is pre-multiplied by scale * log2(e), so exp(x*scale) becomes
// exp2f(s), one MUFU instruction. Accumulation is fp32 whatever T is.
#pragma once
#include "common.cuh"

// Running state of one warp for QH query heads. Every lane holds:
//   m[h]        running max score; identical on all lanes (it comes out of a full-warp max)
//   l[h]        running sum of exp2(s - m) over the tokens this lane's thread group scored; the groups are
//               summed only once, in finish_warp, instead of once per tile
//   acc[h][e]   running sum of p * v for output dim (lane * DPL + e), DPL = D / 32
template <int D, int QH>
struct WarpState {
    float m[QH];
    float l[QH];
    float acc[QH][D / KVG_WARP];
};

template <int D, int QH>
__device__ __forceinline__ void init_state(WarpState<D, QH>& st) {
#pragma unroll
    for (int h = 0; h < QH; ++h) {
        st.m[h] = neg_inf();
        st.l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < D / KVG_WARP; ++e) st.acc[h][e] = 0.0f;
    }
}

// Element offset of token `pos` of a sequence in a (NB, BS, Hkv, D) cache, kv head 0. `tile_block` is the
// block id of pos's tile when BS >= TILE (then every token of the tile lives in that block), else unused.
template <int BS>
__device__ __forceinline__ i64 token_offset(const int* __restrict__ table, i64 tile_block, int pos,
                                            i64 blk_stride, i64 tok_stride) {
    const i64 block = BS >= KVG_TILE ? tile_block : (i64)table[pos / BS];
    return block * blk_stride + (i64)(pos % BS) * tok_stride;
}

// Score tiles tile_begin, tile_begin + tile_step, ... < tile_end. Tile i is token positions
// [i * TILE, i * TILE + TILE) of the sequence; positions >= limit are masked. Callers guarantee
// tile_end <= ceil(limit / TILE), so the first token of every visited tile is visible and the running max
// is finite after the first tile (no -inf - -inf = NaN).
//
// Thread mapping inside the warp, and why:
//   q.k  lane = group * TG + sub (TG = 2). Group g owns token (tile * TILE + g). Its TG lanes split the head
//        dim into 16-byte vectors interleaved as vector (j * TG + sub), so at each step j the two lanes of a
//        group read 32 contiguous bytes (a whole sector) of that token's K row, and the warp has 16 rows in
//        flight at once. Partial dots meet with log2(TG) xor-shuffles.
//   p.v  lane owns output dims [lane * DPL, lane * DPL + DPL): per token the warp reads the token's V row
//        as one coalesced D * sizeof(T)-byte access; the token's probability comes from lane t * TG by a
//        shuffle. Lanes keep disjoint output dims, so no reduction is needed for acc until the CTA merge.
//   Masked positions are clamped to limit - 1 for the loads (always a real token of this sequence, so the
//   loads need no branch and never touch unwritten or foreign cache slots); their p is exactly 0.
template <typename T, int D, int BS, int QH>
__device__ __forceinline__ void attend_tiles(
    const T* __restrict__ k_cache,     // (NB, BS, Hkv, D) contiguous
    const T* __restrict__ v_cache,     // (NB, BS, Hkv, D) contiguous
    const int* __restrict__ table,     // (max_blocks,) this sequence's row of block_tables
    int kv_head,                       // KV head shared by the QH query heads
    int num_kv_heads,                  // Hkv
    const float* q_s,                  // (QH, D) shared memory: query * scale * log2(e)
    int tile_begin, int tile_end, int tile_step,
    int limit,                         // keys at positions >= limit are invisible
    WarpState<D, QH>& st)
{
    constexpr int VEC = 16 / (int)sizeof(T);           // elements per 16-byte K load
    constexpr int NKV = D / (KVG_TG * VEC);            // K vectors per lane per token
    constexpr int DPL = D / KVG_WARP;                  // output dims per lane
    static_assert(D % (KVG_TG * VEC) == 0 && D % KVG_WARP == 0, "head_dim must be a multiple of 32");
    static_assert(QH >= 1 && QH <= KVG_MAX_QH, "1..8 query heads per CTA");

    const int lane = threadIdx.x % KVG_WARP;
    const int group = lane / KVG_TG, sub = lane % KVG_TG;
    const i64 tok_stride = (i64)num_kv_heads * D;      // elements between tokens of a block
    const i64 blk_stride = (i64)BS * tok_stride;       // elements between blocks
    const i64 head_off = (i64)kv_head * D;

    for (int tile = tile_begin; tile < tile_end; tile += tile_step) {
        // ---- q.k for token `pos` of this lane's group
        const int pos = tile * KVG_TILE + group;
        const bool valid = pos < limit;
        const int kpos = valid ? pos : limit - 1;
        // With BS >= 16 a tile never straddles two blocks (both are powers of two): one table read per tile.
        const i64 tile_block = BS >= KVG_TILE ? (i64)table[(tile * KVG_TILE) / BS] : 0;
        const T* krow = k_cache + token_offset<BS>(table, tile_block, kpos, blk_stride, tok_stride) + head_off;
        Vec<T, VEC> kv[NKV];
#pragma unroll
        for (int j = 0; j < NKV; ++j) kv[j] = load_vec<T, VEC>(krow + (j * KVG_TG + sub) * VEC);

        float s[QH];
#pragma unroll
        for (int h = 0; h < QH; ++h) {
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < NKV; ++j) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) dot += q_s[h * D + (j * KVG_TG + sub) * VEC + e] * to_float(kv[j].v[e]);
            }
#pragma unroll
            for (int off = KVG_TG / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            s[h] = valid ? dot : neg_inf();
        }

        // ---- online softmax: tile max over the 16 groups (lanes of a group already agree)
        float p[QH];
#pragma unroll
        for (int h = 0; h < QH; ++h) {
            float mt = s[h];
#pragma unroll
            for (int off = KVG_TG; off < KVG_WARP; off *= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
            const float m_new = fmaxf(st.m[h], mt);
            const float alpha = exp2f(st.m[h] - m_new);  // 0 on the first tile (m = -inf)
            p[h] = exp2f(s[h] - m_new);                   // 0 for masked tokens
            st.l[h] = st.l[h] * alpha + p[h];
#pragma unroll
            for (int e = 0; e < DPL; ++e) st.acc[h][e] *= alpha;
            st.m[h] = m_new;
        }

        // ---- p.v: token by token, each lane its DPL output dims
#pragma unroll
        for (int t = 0; t < KVG_TILE; ++t) {
            const int vpos = imin(tile * KVG_TILE + t, limit - 1);
            const T* vrow = v_cache + token_offset<BS>(table, tile_block, vpos, blk_stride, tok_stride) + head_off;
            const Vec<T, DPL> vv = load_vec<T, DPL>(vrow + lane * DPL);
#pragma unroll
            for (int h = 0; h < QH; ++h) {
                const float pt = __shfl_sync(0xffffffffu, p[h], t * KVG_TG);
#pragma unroll
                for (int e = 0; e < DPL; ++e) st.acc[h][e] += pt * to_float(vv.v[e]);
            }
        }
    }
}

// Sum l over the thread groups: lanes with sub == 0 contribute (both lanes of a group hold the same p).
template <int D, int QH>
__device__ __forceinline__ void finish_warp(WarpState<D, QH>& st) {
    const int sub = (threadIdx.x % KVG_WARP) % KVG_TG;
#pragma unroll
    for (int h = 0; h < QH; ++h) st.l[h] = warp_sum(sub == 0 ? st.l[h] : 0.0f);
}
