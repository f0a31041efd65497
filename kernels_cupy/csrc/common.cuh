// Shared device helpers for the kvgate paged-attention kernels.
//
// Self-contained on purpose: no #include of CUDA headers, so the same text compiles under NVRTC (CuPy
// RawModule, where host headers do not exist and cuda_bf16.h may not be shipped with the wheel) and under
// nvcc (the compile tests). 16-bit types are stored as raw bits and converted with PTX `cvt`, which needs
// sm_80+ for bf16 rounding; sm_80 is our floor anyway.
#pragma once

// Launch geometry shared by every attention kernel; kernels_cupy/kernels.py mirrors these numbers and
// the emulation in tests/kernel_emulate.py walks exactly this mapping.
#define KVG_WARP 32
#define KVG_NUM_WARPS 4                      // warps per CTA: 128 threads
#define KVG_THREADS (KVG_WARP * KVG_NUM_WARPS)
#define KVG_TG 2                             // lanes that share one key token in the q.k dot product
#define KVG_TILE (KVG_WARP / KVG_TG)         // key tokens one warp scores per step (16)
#define KVG_MAX_QH 8                         // query heads handled by one CTA at most (GQA group slice)

typedef long long i64;

struct half_t { unsigned short bits; };      // IEEE binary16, raw bits
struct bf16_t { unsigned short bits; };      // bfloat16, raw bits

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
    // bf16 is the high half of an fp32: widening is exact and a shift.
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);

template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));  // round to nearest even, like torch .to()
    return h;
}

template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));  // sm_80+
    return h;
}

// N elements loaded or stored as one aligned access (16 bytes at most): the alignment lets the compiler
// emit a single vector instruction (ld.global.v4.u32 for 16 bytes) instead of N scalar loads.
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N> __device__ __forceinline__ Vec<T, N> zero_vec() {
    Vec<T, N> z;
#pragma unroll
    for (int i = 0; i < N; ++i) z.v[i] = from_float<T>(0.0f);
    return z;
}

// Our own int min: NVRTC offers no host headers, and not every NVRTC version pre-declares ::min.
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = KVG_WARP / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}
