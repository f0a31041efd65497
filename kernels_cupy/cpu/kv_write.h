// The step's new K and V rows into their paged cache slots, for every cache dtype the CPU kernels read:
// fp32 (copied), bf16 and fp16 (rounded to nearest even, as torch's .to()) and int8 (kernels_cupy/kv_quant.py:
// D codes, then the row's fp32 scale). Each row is rounded with kv_quant.quantize's arithmetic, operation for
// operation (fp32 max of |x|, scale = max / 127, inverse 1 / scale or 0, codes = nearbyint(x * inverse)
// clamped to +-127), so the module path, the decode stack and the torch reference write identical bytes.
// Included by paged_decode.cpp (and through it by decode_stack.cpp).
#pragma once

#include "torch_api.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kv_write {

static inline void store(const float* x, float* dst, int64_t d) { std::memcpy(dst, x, d * sizeof(float)); }

static inline void store(const float* x, at::BFloat16* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = c10::BFloat16(x[i]);  // round to nearest even, as torch
}

static inline void store(const float* x, at::Half* dst, int64_t d) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  // F16C rounds to nearest even as torch does, 8 at a time (c10::Half is bit arithmetic per element); eight with a
  // NaN go through c10::Half, whose NaN is always 0x7E00 where F16C keeps part of the payload.
  for (; i + 8 <= d; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) {
      for (int64_t j = i; j < i + 8; ++j) dst[j] = c10::Half(x[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < d; ++i) dst[i] = c10::Half(x[i]);  // round to nearest even, as torch
}

// dst: d codes, then the 4 bytes of the fp32 scale (the row is d + 4 int8).
static inline void store(const float* x, int8_t* dst, int64_t d) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float a = std::fabs(x[i]);
    if (a > amax || std::isnan(a)) amax = a;  // NaN propagates, as torch's amax
  }
  const float scale = amax / 127.0f;
  const float inv = scale > 0.f ? 1.0f / scale : 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float c = std::nearbyint(x[i] * inv);
    dst[i] = static_cast<int8_t>(c < -127.f ? -127.f : (c > 127.f ? 127.f : c));
  }
  std::memcpy(dst + d, &scale, sizeof scale);
}

template <typename KV>
static void rows(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                 torch::Tensor& v_cache, const int64_t* slots, int64_t width) {
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
  KV* kc = k_cache.data_ptr<KV>();
  KV* vc = v_cache.data_ptr<KV>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  // Rows in parallel where a step has many (a prompt chunk's): each writes its own slot, so the split changes no
  // byte; a decode step's few rows stay on the calling thread (at::parallel_for runs below one grain inline).
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        store(kp + t * key.stride(0) + h * key.stride(1), kc + (slots[t] * H + h) * width, D);
        store(vp + t * value.stride(0) + h * value.stride(1), vc + (slots[t] * H + h) * width, D);
      }
    }
  });
}

}  // namespace kv_write

// key, value: (T, Hkv, D) fp32 (any strides: rows of the fused qkv projection); caches (NB, BS, Hkv, W): fp32,
// bf16 or fp16 (W = D), or int8 (W = D + 4); slots: (T,) int64 flat slot = block * BS + offset. One call per layer
// instead of the reference's conversion and two index_copy_ with their views and dtype checks.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(key.scalar_type() == torch::kFloat32 && value.scalar_type() == torch::kFloat32, "fp32 K/V rows");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == torch::kInt64, "layout");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2);
  const bool int8 = k_cache.scalar_type() == torch::kInt8;
  const int64_t W = int8 ? D + 4 : D;
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == H && k_cache.size(3) == W && v_cache.sizes() == k_cache.sizes() &&
              value.sizes() == key.sizes() && slots.numel() == T, "shapes disagree");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head rows must be contiguous");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= sp[t] && sp[t] < nslots, "slot out of range");
  switch (k_cache.scalar_type()) {
    case torch::kFloat32: kv_write::rows<float>(key, value, k_cache, v_cache, sp, W); break;
    case torch::kBFloat16: kv_write::rows<at::BFloat16>(key, value, k_cache, v_cache, sp, W); break;
    case torch::kHalf: kv_write::rows<at::Half>(key, value, k_cache, v_cache, sp, W); break;
    case torch::kInt8: kv_write::rows<int8_t>(key, value, k_cache, v_cache, sp, W); break;
    default: TORCH_CHECK(false, "KV cache must be fp32, bf16, fp16 or int8");
  }
}
