// reshape_and_cache: write this step's new K/V rows into the paged caches through the slot mapping.
//
// Kernel: reshape_and_cache<TI, TC>: K/V of type TI (the model's dtype) stored as TC (the cache's dtype),
// each in {float, half_t, bf16_t}; converting here saves a separate cast kernel for a bf16 cache under an
// fp32 model.
// CTA mapping: grid = (T_new,): one CTA per new token; block = min(round_up(Hkv * D, 32), 512) threads.
//   Thread i (strided by blockDim) copies element (h, d) = (i / D, i % D) of the token's K and V. In the
//   cache a slot's Hkv * D elements are contiguous (layout (NB, BS, Hkv, D), so slot s starts at s * Hkv * D),
//   and consecutive threads take consecutive elements: both the strided source reads (one head row at a
//   time) and the destination writes are coalesced. The copy is tiny next to attention, so it stays scalar
//   and accepts any source strides (K/V arrive as views of a fused qkv projection).
#include "common.cuh"

template <typename TI, typename TC>
__global__ void __launch_bounds__(512) reshape_and_cache(
    const TI* __restrict__ key,             // (T_new, Hkv, D) strides (key_stride_t, key_stride_h, 1)
    const TI* __restrict__ value,           // (T_new, Hkv, D) strides (value_stride_t, value_stride_h, 1)
    TC* __restrict__ k_cache,               // (NB, BS, Hkv, D) contiguous
    TC* __restrict__ v_cache,               // (NB, BS, Hkv, D) contiguous
    const i64* __restrict__ slot_mapping,   // (T_new,) flat slot = block_id * BS + offset; < 0: padding, skipped
    int num_kv_heads,                       // Hkv
    int head_dim,                           // D
    i64 key_stride_t,                       // key stride between tokens, in elements
    i64 key_stride_h,                       // key stride between heads, in elements
    i64 value_stride_t,                     // value stride between tokens, in elements
    i64 value_stride_h)                     // value stride between heads, in elements
{
    const int t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;
    const int n = num_kv_heads * head_dim;
    const i64 dst = slot * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        k_cache[dst + i] = from_float<TC>(to_float(key[t * key_stride_t + h * key_stride_h + d]));
        v_cache[dst + i] = from_float<TC>(to_float(value[t * value_stride_t + h * value_stride_h + d]));
    }
}
